"""deploy/: the systemd units pass systemd's own checks (and an instance keeps its port), the
nginx configuration lets only /api/v1/ through, and the example environment file
and docs/SETTINGS.md name every setting the service reads."""
import http.client
import http.server
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from app.connections import connection_cap
from settings import Settings
from tests.ops_helpers import ROOT
from tests.service_process import unused_port

DEPLOY = os.path.join(ROOT, "deploy")


def read(*path):
    with open(os.path.join(*path), encoding="utf-8") as f:
        return f.read()


class RecordingEnviron(dict):
    """An empty environment that notes every name the settings ask for."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def get(self, name, default=None):
        self.asked.add(name)
        return super().get(name, default)


def setting_names():
    environ = RecordingEnviron()
    Settings.from_env(environ)
    return environ.asked


def unit_settings():
    lines = read(DEPLOY, "receiver.service").splitlines()
    return [tuple(line.split("=", 1)) for line in lines if re.match(r"^[A-Z]\w*=", line)]


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed on this machine")


@needs_systemd_analyze
@pytest.mark.parametrize("names,instance", [
    (["receiver.service"], "receiver.service"),
    (["receiver@.service"], "receiver@8001.service"),
    (["receiver-backup.service"], "receiver-backup.service"),
    (["receiver-backup.timer", "receiver-backup.service"], "receiver-backup.timer")])
def test_the_unit_passes_systemd_analyze_verify(tmp_path, names, instance):
    # verify checks that ExecStart exists: point it at this checkout's interpreter.
    for name in names:
        unit = read(DEPLOY, name).replace(
            "/opt/receiver/.venv/bin/python", sys.executable).replace("/opt/receiver", ROOT)
        (tmp_path / name).write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", instance],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "")


def unit_lines(name):
    return [tuple(line.split("=", 1)) for line in read(DEPLOY, name).splitlines()
            if re.match(r"^[A-Z]\w*=", line)]


@needs_systemd_analyze
def test_the_backup_runs_every_day_and_catches_up_after_a_stop():
    timer = dict(unit_lines("receiver-backup.timer"))
    assert timer["Persistent"] == "true" and "Unit" not in timer  # the .service of its name
    calendar = subprocess.run(["systemd-analyze", "calendar", "--iterations=2",
                               timer["OnCalendar"]], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "TZ": "UTC"})
    assert calendar.returncode == 0, calendar.stderr
    elapses = re.findall(r"(?:Next elapse|Iter\. #2): \w+ (\S+) (\S+)", calendar.stdout)
    assert [time for _, time in elapses] == ["03:15:00", "03:15:00"]
    assert elapses[0][0] != elapses[1][0]  # one a day


def test_the_backup_runs_as_the_service_with_its_settings_and_writes_only_its_folders():
    service = dict(unit_lines("receiver-backup.service"))
    unit = dict(unit_settings())
    for option in ("User", "Group", "WorkingDirectory", "EnvironmentFile", "NoNewPrivileges",
                   "ProtectSystem", "ProtectHome", "PrivateTmp", "UMask"):
        assert service[option] == unit[option], option
    assert service["Type"] == "oneshot"
    assert service["ExecStart"] == "/opt/receiver/deploy/receiver-backup"
    backup_dir = dict(pair.split("=") for pair in service["Environment"].split())["BACKUP_DIR"]
    assert service["ReadWritePaths"].split() == [backup_dir, unit["ReadWritePaths"]]
    script = read(DEPLOY, "receiver-backup")
    assert f"dir=${{BACKUP_DIR:-{backup_dir}}}" in script


def test_deploy_md_installs_what_the_backups_need():
    """The packages, the folder (the unit starts only where it exists), the units, a
    restore for each database, and the rollback of an upgrade."""
    page = read(DEPLOY, "DEPLOY.md")
    backups = page[page.index("## Backups"):]
    backups = backups[:backups.index("\n## ", 1)]
    service = dict(unit_lines("receiver-backup.service"))
    backup_dir = dict(pair.split("=") for pair in service["Environment"].split())["BACKUP_DIR"]
    for needed in ("apt-get install -y sqlite3", "postgresql-client",
                   f"install -d -o receiver -g receiver -m 0700 {backup_dir}",
                   "deploy/receiver-backup.service", "deploy/receiver-backup.timer",
                   "systemctl enable --now receiver-backup.timer", "pg_restore",
                   "rcv migrate", "tests/test_backup.py"):
        assert needed in backups, needed
    assert "## Rolling an upgrade back" in page


def test_the_unit_gives_room_for_the_connections_it_allows():
    settings = dict(unit_settings())
    limit = int(settings["LimitNOFILE"])
    assert connection_cap(Settings().max_connections, limit) == Settings().max_connections


def test_the_unit_is_notify_restarting_and_hardened():
    settings = dict(unit_settings())
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "on-failure"
    # Exit 2 is a settings error (see receiver.py): restarting cannot mend it.
    assert settings["RestartPreventExitStatus"] == "2"
    assert settings["EnvironmentFile"] == "/etc/receiver/receiver.env"
    assert settings["User"] == "receiver" and settings["ExecStart"].endswith("receiver.py serve")
    assert settings["ProtectSystem"] == "strict"
    assert settings["ReadWritePaths"] == "/opt/receiver/var"
    for option in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "PrivateDevices"):
        assert settings[option] == "yes", option
    # The service's whole stop keeps within STOP_TIMEOUT_SECONDS, whose default is this
    # budget, so it exits by itself.
    from app.server import SHUTDOWN_GRACE_SECONDS
    from settings import Settings
    assert int(settings["TimeoutStopSec"]) == Settings.stop_timeout_seconds
    assert int(settings["TimeoutStopSec"]) > SHUTDOWN_GRACE_SECONDS


def test_the_instance_template_is_the_unit_with_the_port_as_its_instance_name():
    # One unit to keep hardened: the template may differ only in these lines.
    template = read(DEPLOY, "receiver@.service").splitlines()
    unit = read(DEPLOY, "receiver.service").splitlines()
    only_in_template = [line for line in template if line not in unit]
    only_in_unit = [line for line in unit if line not in template]
    settings = [line for line in only_in_template if not line.startswith("#")]
    assert settings == ["Description=Order-fulfilment webhook receiver on port %i",
                        "EnvironmentFile=-/etc/receiver/receiver-%i.env",
                        "ExecStart=/usr/bin/env RECEIVER_PORT=%i /opt/receiver/.venv/bin/python "
                        "/opt/receiver/receiver.py serve"]
    assert [line for line in only_in_unit if not line.startswith("#")] == [
        "Description=Order-fulfilment webhook receiver",
        "ExecStart=/opt/receiver/.venv/bin/python /opt/receiver/receiver.py serve"]


def test_the_example_environment_lists_every_setting_and_nothing_else():
    listed = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", read(DEPLOY, "receiver.env.example"),
                            re.MULTILINE))
    assert listed == setting_names()


ENVEXEC = os.path.join(DEPLOY, "envexec.py")


def run_with_env_file(path, code):
    """deploy/envexec.py reading `path`, then a Python child printing what it was given."""
    return subprocess.run([sys.executable, ENVEXEC, str(path), sys.executable, "-c", code],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_example_environment_reads_as_systemd_reads_it(tmp_path):
    """deploy/rcv runs envexec.py on the file: every line of the example, once uncommented
    and with the secrets filled in, gives the settings the service gets."""
    example = read(DEPLOY, "receiver.env.example")
    filled = re.sub(r"^#([A-Z])", r"\1", example, flags=re.MULTILINE)
    filled = re.sub(r"^([A-Z_]+(SECRET|_KEY))=$", r"\1=s3cret-of-32-random-characters-or-more",
                    filled, flags=re.MULTILINE)
    filled = filled.replace("\nADMIN_EMAIL=\n", "\nADMIN_EMAIL=ops@example.com\n")
    filled = filled.replace("=sqlite:///var/", f"=sqlite:///{tmp_path}/")
    (tmp_path / "receiver.env").write_text(filled)
    result = run_with_env_file(
        tmp_path / "receiver.env", "from settings import Settings; s = Settings.from_env(); "
        "print(s.env, s.workflow_doctype, s.crtc_funds_action, sep='|')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "production|Formation Order|Confirm Funds"


def test_rcv_takes_dollar_backquote_and_backslash_as_systemd_does(tmp_path):
    """What systemd's EnvironmentFile= makes of each line (env-file.c); `sh` would expand
    $HOME and `id`, and eat the backslashes."""
    (tmp_path / "receiver.env").write_text(
        "# a comment\n"
        "; another\n"
        "SMTP_PASS='p\"ss\\w0rd$HOME`id`'\n"
        'DOUBLE="a \\"b\\" \\$x \\\\ \\q"\n'
        "BARE=x\\$y\\ z$HOME  \n"
        "  SPACED = keep inner  spaces\n"
        "CONTINUED=one\\\ntwo\n"
        "EMPTY=\n"
        "NO_EQUALS\n"
        "9BAD=ignored\n")
    names = ["SMTP_PASS", "DOUBLE", "BARE", "SPACED", "CONTINUED", "EMPTY", "NO_EQUALS",
             "9BAD"]
    result = run_with_env_file(
        tmp_path / "receiver.env",
        f"import json, os; print(json.dumps({{n: os.environ.get(n) for n in {names!r}}}))")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "SMTP_PASS": 'p"ss\\w0rd$HOME`id`', "DOUBLE": 'a "b" $x \\ \\q',
        "BARE": "x$y z$HOME", "SPACED": "keep inner  spaces", "CONTINUED": "onetwo",
        "EMPTY": "", "NO_EQUALS": None, "9BAD": None}


def test_rcv_reads_the_file_with_envexec_not_a_shell():
    rcv = read(DEPLOY, "rcv")
    assert "envexec.py /etc/receiver/receiver.env" in rcv and ". /etc/" not in rcv


def test_the_example_environment_sets_no_secret():
    example = read(DEPLOY, "receiver.env.example")
    for name in ("WEBHOOK_SECRET", "STRIPE_SECRET_KEY", "STRIPE_WEBHOOK_SECRET",
                 "CRYPTO_PROCESSOR_API_KEY", "LINK_SECRET", "WORKFLOW_API_SECRET"):
        assert re.search(rf"^{name}=$", example, re.MULTILINE), name


def test_the_settings_page_documents_every_setting():
    page = read(ROOT, "docs", "SETTINGS.md")
    missing = sorted(name for name in setting_names() if name not in page)
    assert missing == []


# --- receiver@.service: the instance's port wins --------------------------------------------

def started_as_systemd_starts(unit_name, instance, env_file, tmp_path):
    """The unit's ExecStart for `instance`, in the environment systemd gives it: the
    unit's Environment= lines first, then its EnvironmentFile (read by envexec.py, as
    systemd reads it), whose settings win over Environment= (systemd.exec(5))."""
    unit = dict(tuple(line.split("=", 1)) for line in read(DEPLOY, unit_name).splitlines()
                if re.match(r"^(Environment|ExecStart)=", line))
    command = unit["ExecStart"].replace("%i", str(instance)).replace(
        "/opt/receiver/.venv/bin/python", sys.executable).replace("/opt/receiver", ROOT)
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if "Environment" in unit:
        name, value = unit["Environment"].replace("%i", str(instance)).split("=", 1)
        environment[name] = value
    return subprocess.Popen([sys.executable, ENVEXEC, str(env_file), *command.split()],
                            cwd=tmp_path, env=environment, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "service.log", "wb"))


def answers_healthz(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def test_an_instance_listens_on_its_port_whatever_the_shared_environment_file_says(tmp_path):
    instance, left_in_the_file = unused_port(), unused_port()
    (tmp_path / "receiver.env").write_text(
        f"RECEIVER_PORT={left_in_the_file}\n"
        f"DATABASE_URL=sqlite:///{tmp_path}/receiver.sqlite3\n"
        f"SPOOL_DIR={tmp_path}/spool\n")
    process = started_as_systemd_starts("receiver@.service", instance,
                                        tmp_path / "receiver.env", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (answers_healthz(instance) or answers_healthz(left_in_the_file)
                   or process.poll() is not None):
            assert time.monotonic() < deadline, (tmp_path / "service.log").read_text()
            time.sleep(0.1)
        assert answers_healthz(instance), (tmp_path / "service.log").read_text()
        assert not answers_healthz(left_in_the_file)
    finally:
        process.terminate()
        process.wait(30)


# --- nginx: the configuration DEPLOY.md installs ---------------------------------------------

needs_nginx = pytest.mark.skipif(
    shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"),
    reason="nginx is not installed on this machine")
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CERTIFICATES = ("/etc/letsencrypt/live/receiver.example.com/fullchain.pem",
                "/etc/letsencrypt/live/receiver.example.com/privkey.pem",
                "/etc/nginx/receiver-console.crt", "/etc/nginx/receiver-console.key")


def uncommented_console(config, way):
    """The config with one of its commented ways to expose the console switched on."""
    lines = config.split("\n")
    if way == "basic auth":
        start = lines.index("    #location /console {")
        end = lines.index("    #}", start)
        lines[start:end + 1] = [line.replace("#", "", 1) for line in lines[start:end + 1]]
    elif way == "private address":
        start = lines.index("#server {")
        end = lines.index("#}", start)
        lines[start:end + 1] = [line[1:] for line in lines[start:end + 1]]
    return "\n".join(lines)


def nginx_prefix(tmp_path, config, ports=None):
    """A folder nginx runs in as root would: its own pid, logs and temporary files, a
    self-signed certificate in place of certbot's, and `config` included as
    /etc/nginx/conf.d/receiver.conf is. `ports` moves the listeners and the upstream."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=receiver.example.com", "-keyout", str(tmp_path / "key.pem"),
                    "-out", str(tmp_path / "cert.pem")], check=True, capture_output=True)
    for path in CERTIFICATES:
        config = config.replace(path, str(tmp_path / ("key.pem" if "key" in path else "cert.pem")))
    if ports:
        for old, new in ports.items():
            config = config.replace(old, new)
    (tmp_path / "receiver.conf").write_text(config)
    (tmp_path / "nginx.conf").write_text(f"""
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
events {{}}
http {{
    access_log off;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fastcgi;
    uwsgi_temp_path {tmp_path}/uwsgi;
    scgi_temp_path {tmp_path}/scgi;
    include {tmp_path}/receiver.conf;
}}
""")
    return tmp_path / "nginx.conf"


@needs_nginx
@pytest.mark.parametrize("name,way", [("nginx-receiver.conf", None),
                                      ("nginx-receiver.conf", "basic auth"),
                                      ("nginx-receiver.conf", "private address"),
                                      ("nginx-receiver-instances.conf", None)])
def test_the_nginx_config_passes_nginx_t(tmp_path, name, way):
    config = uncommented_console(read(DEPLOY, name), way)
    assert way is None or "\n    location /console {" in config or "\nserver {\n    listen 10." in config
    result = subprocess.run([NGINX, "-t", "-c", str(nginx_prefix(tmp_path, config))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


class Backend(http.server.BaseHTTPRequestHandler):
    """The service's port, noting every path that reached it."""
    reached = []

    def do_GET(self):
        Backend.reached.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def fetch(url):
    """(status, Location) of a GET, certificates unchecked (a self-signed one)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    parts = urllib.parse.urlsplit(url)
    connection = (http.client.HTTPSConnection(parts.hostname, parts.port, context=context)
                  if parts.scheme == "https" else
                  http.client.HTTPConnection(parts.hostname, parts.port))
    try:
        connection.request("GET", parts.path, headers={"Host": "receiver.example.com"})
        reply = connection.getresponse()
        return reply.status, reply.getheader("Location")
    finally:
        connection.close()


# Each config's upstream servers, and what stands for them in the test.
UPSTREAMS = {"nginx-receiver.conf": ("server 127.0.0.1:8000;",),
             "nginx-receiver-instances.conf": (
                 "server 127.0.0.1:8001 max_fails=3 fail_timeout=10s;",
                 "server 127.0.0.1:8002 max_fails=3 fail_timeout=10s;")}


@needs_nginx
@pytest.mark.parametrize("name", UPSTREAMS)
def test_nginx_lets_only_the_api_through_to_the_service(tmp_path, name):
    """DEPLOY.md: expose only /api/v1/. The console, /metrics, /healthz and /readyz are
    404 at nginx and never reach the service; plain HTTP is sent to HTTPS."""
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    https_port, http_port = unused_port(), unused_port()
    Backend.reached = []
    config = nginx_prefix(tmp_path, read(DEPLOY, name), ports={
        "    listen [::]:80;\n": "", "    listen [::]:443 ssl;\n": "",
        "listen 80;": f"listen 127.0.0.1:{http_port};",
        "listen 443 ssl;": f"listen 127.0.0.1:{https_port} ssl;",
        **{upstream: f"server 127.0.0.1:{backend.server_address[1]};"
           for upstream in UPSTREAMS[name]}})
    nginx = subprocess.Popen([NGINX, "-c", str(config), "-g", "daemon off; master_process off;"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                fetch(f"https://127.0.0.1:{https_port}/")
                break
            except OSError:
                assert nginx.poll() is None and time.monotonic() < deadline, nginx.stderr.read()
                time.sleep(0.1)
        base = f"https://127.0.0.1:{https_port}"
        assert fetch(base + "/api/v1/openapi.yaml") == (200, None)
        for path in ("/console/", "/console/login", "/metrics", "/healthz", "/readyz", "/"):
            assert fetch(base + path) == (404, None), path
        assert fetch(f"http://127.0.0.1:{http_port}/api/v1/openapi.yaml") == (
            301, "https://receiver.example.com/api/v1/openapi.yaml")
        assert Backend.reached == ["/api/v1/openapi.yaml"]
    finally:
        nginx.terminate()
        nginx.wait(30)
        backend.shutdown()
