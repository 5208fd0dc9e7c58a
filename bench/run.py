"""make bench: measure the receivers against the single-process ceiling, in one run.

Starts the peers (worker, Frappe, Telegram, SMTP), a bare Tornado app (the ceiling) and
the service (on SQLite, and on PostgreSQL when reachable), drives each scenario from the
load generator in its own process, and writes bench/results/latest.json and .md.
"""
import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PYTHON = sys.executable
SECRET = "bench-webhook-secret"
POSTGRES_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing answered on port {port} within {timeout}s")


class Processes:
    def __init__(self):
        self.running = []

    def start(self, args, port, env=None, log=None):
        process = subprocess.Popen(
            [PYTHON, *args], cwd=ROOT, env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL, stderr=log or subprocess.DEVNULL)
        self.running.append(process)
        wait_for_port(port)
        return process

    def stop_all(self):
        for process in self.running:
            process.terminate()
        for process in self.running:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def load(scenario, port, connections, duration, options=None):
    output = subprocess.run(
        [PYTHON, "-m", "bench.loadgen", scenario, "--port", str(port),
         "--connections", str(connections), "--duration", str(duration),
         "--options", json.dumps(options or {})],
        cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(output.stdout)


@contextlib.contextmanager
def postgres_scratch():
    """A database of its own beside BENCH_POSTGRES_URL, or None when unreachable."""
    import peewee
    parts = urllib.parse.urlsplit(POSTGRES_URL)
    admin = peewee.PostgresqlDatabase(parts.path.lstrip("/"), host=parts.hostname,
                                      port=parts.port or 5432, user=parts.username,
                                      password=parts.password, connect_timeout=3)
    try:
        admin.connect()
    except peewee.OperationalError:
        yield None
        return
    name = f"receiver_bench_{uuid.uuid4().hex[:10]}"
    admin.execute_sql(f'CREATE DATABASE "{name}"')
    try:
        yield urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        admin.execute_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def service_env(port, database_url, peer_url, smtp_port, folder):
    return {
        "RECEIVER_PORT": str(port), "DATABASE_URL": database_url,
        "WEBHOOK_SECRET": SECRET, "WORKER_URL": peer_url, "WORKFLOW_URL": peer_url,
        "WORKFLOW_API_KEY": "k", "WORKFLOW_API_SECRET": "s", "WORKFLOW_SITE_NAME": "bench",
        "TELEGRAM_API_URL": peer_url, "TELEGRAM_BOT_TOKEN": "1:bench",
        "TELEGRAM_CHAT_ID": "1", "SMTP_URL": f"smtp://127.0.0.1:{smtp_port}",
        "ADMIN_EMAIL": "admin@bench.test", "SPOOL_DIR": os.path.join(folder, "spool"),
    }


def measure_database(label, database_url, args, peer_url, smtp_port, ceiling, rows):
    with tempfile.TemporaryDirectory() as folder:
        processes = Processes()
        port = free_port()
        try:
            with open(os.path.join(folder, "service.log"), "wb") as log:
                processes.start(["receiver.py", "serve"], port,
                                service_env(port, database_url, peer_url, smtp_port, folder),
                                log=log)
                for scenario in ("workflow",):
                    load(scenario, port, args.connections, args.warmup)
                    result = load(scenario, port, args.connections, args.duration)
                    result.update(scenario=scenario, database=label,
                                  ratio_to_ceiling=round(result["rps"] / ceiling["rps"], 3))
                    rows.append(result)
                    print(format_row(result), flush=True)
        finally:
            processes.stop_all()


def format_row(row):
    ratio = row.get("ratio_to_ceiling")
    return (f"{row['scenario']:<10} {row['database']:<10} {row['rps']:>9.1f} req/s  "
            f"p50 {row['p50_ms']:>7.2f} ms  p99 {row['p99_ms']:>7.2f} ms  "
            f"ratio {'' if ratio is None else f'{ratio:.2f}':>5}  "
            f"errors {sum(row['unexpected_statuses'].values())}")


def write_results(rows, args):
    os.makedirs(args.results, exist_ok=True)
    report = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "connections": args.connections, "duration_s": args.duration, "rows": rows,
    }
    with open(os.path.join(args.results, "latest.json"), "w") as out:
        json.dump(report, out, indent=2)
    with open(os.path.join(args.results, "latest.md"), "w") as out:
        out.write("| scenario | database | req/s | p50 ms | p99 ms | ratio to ceiling |\n")
        out.write("|---|---|---|---|---|---|\n")
        for row in rows:
            out.write(f"| {row['scenario']} | {row['database']} | {row['rps']} | "
                      f"{row['p50_ms']} | {row['p99_ms']} | {row.get('ratio_to_ceiling', '')} |\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--sqlite-only", action="store_true")
    parser.add_argument("--results", default=RESULTS, help="folder for latest.json/.md")
    args = parser.parse_args(argv)

    rows = []
    processes = Processes()
    peer_port, smtp_port, ceiling_port = free_port(), free_port(), free_port()
    peer_url = f"http://127.0.0.1:{peer_port}"
    try:
        processes.start(["-m", "bench.peers", "--http-port", str(peer_port),
                         "--smtp-port", str(smtp_port)], peer_port)
        processes.start(["-m", "bench.ceiling", str(ceiling_port)], ceiling_port)
        load("ceiling", ceiling_port, args.connections, args.warmup)
        ceiling = load("ceiling", ceiling_port, args.connections, args.duration)
        ceiling.update(scenario="ceiling", database="-", ratio_to_ceiling=1.0)
        rows.append(ceiling)
        print(format_row(ceiling), flush=True)

        with tempfile.TemporaryDirectory() as folder:
            measure_database("sqlite", f"sqlite:///{folder}/bench.sqlite3", args,
                             peer_url, smtp_port, ceiling, rows)
        if not args.sqlite_only:
            with postgres_scratch() as url:
                if url is None:
                    print("PostgreSQL not reachable at BENCH_POSTGRES_URL: skipped")
                else:
                    measure_database("postgres", url, args, peer_url, smtp_port, ceiling, rows)
    finally:
        processes.stop_all()
    write_results(rows, args)
    print(f"results: {args.results}/latest.json and latest.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
