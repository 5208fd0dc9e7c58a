"""make bench: measure the receivers against the single-process ceiling, in one run.

Starts the peers (worker, Frappe, Telegram, SMTP), a bare Tornado app (the ceiling) and
the service (on SQLite, and on PostgreSQL when reachable), drives each scenario from the
load generator in its own process, and writes bench/results/latest.json and .md.

Measured: every receiver against the ceiling and against the durable floor (a bare app
that commits each body to SQLite before answering), and each at one connection alone
after its run (the wait of a caller who finds the service idle); isolation (the crypto
callback while the worker answers workflow jobs after 2 s); drain (the worker down under
steady workflow traffic, then back: how fast the backlog empties, the live p99
meanwhile, every job once); on PostgreSQL, 2 instances of the service on one database
against 1; with --scale, the per-event cost of a card payment and a dispute with 1k and
with 1M rows (--scale-rows) in the order and ledger tables; with --memory N, the
service's RSS over N events; with --console, the operator console's pages with 1M
(--console-rows) events, outbox rows and send attempts, and what recording the attempts
costs (bench/console.py); with --drain-cut, on PostgreSQL, the held backlog after a
database cut under two instances (bench/drain.py).

It is one module so that `make bench` reads top to bottom as the run it makes, one
method a scenario; that is why it is longer than the others.
"""
import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid

from bench import console as console_pages, scenarios
from bench.seed import seed_ledger, seed_orders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PYTHON = sys.executable
SECRET = "bench-webhook-secret"
POSTGRES_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RECEIVERS = ("workflow", "card", "crypto")
SLOW_WORKER_SECONDS = 2.0


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port, process, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return  # it will never answer; the caller reports why it exited
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing answered on port {port} within {timeout}s")


class Processes:
    """The processes a run starts, each with its stderr kept in a file of its own, so
    that one that exits is reported with why, instead of being measured against."""

    def __init__(self):
        self.running = []

    def start(self, args, port, env=None, cwd=ROOT):
        stderr = tempfile.TemporaryFile()
        process = subprocess.Popen(
            [PYTHON, *args], cwd=cwd, env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL, stderr=stderr)
        process.stderr_file = stderr
        self.running.append(process)
        wait_for_port(port, process)
        self.check()
        return process

    def check(self):
        """Raise if any process started here has exited, with its code and its last
        words: a peer that died mid-run leaves every later figure without meaning."""
        for process in self.running:
            if process.poll() is not None:
                size = os.fstat(process.stderr_file.fileno()).st_size
                process.stderr_file.seek(max(0, size - 2000))
                last_words = process.stderr_file.read().decode(errors="replace")
                raise RuntimeError(f"{' '.join(process.args[1:])} exited with "
                                   f"{process.returncode}:\n{last_words}")

    def stop_all(self):
        for process in self.running:
            process.terminate()
        for process in self.running:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
            process.stderr_file.close()
        self.running = []


def loadgen_command(scenario, port, connections, duration, options=None, requests=None,
                    until_eof=False):
    return [PYTHON, "-m", "bench.loadgen", scenario, "--port", str(port),
            "--connections", str(connections), "--duration", str(duration),
            "--options", json.dumps(options or {}),
            *(["--requests", str(requests)] if requests else []),
            *(["--until-eof"] if until_eof else [])]


def load(*args, **kwargs):
    output = subprocess.run(loadgen_command(*args, **kwargs), cwd=ROOT,
                            capture_output=True, text=True)
    if output.returncode != 0:
        # The load generator's own traceback says why (a connection the service closed).
        raise RuntimeError(f"the load generator failed ({output.returncode}):\n"
                           f"{output.stderr[-4000:]}")
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


@contextlib.contextmanager
def sqlite_scratch():
    with tempfile.TemporaryDirectory() as folder:
        yield f"sqlite:///{folder}/bench.sqlite3"


def worker_stats(url):
    """(calls carrying an Idempotency-Key, distinct keys) the worker stand-in has seen."""
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as answer:
        stats = json.load(answer)
    return stats["calls"], stats["distinct"]


def run_counts(port):
    """From one scrape: the service's statements, round trips and group-commit turns so
    far (over a run, per webhook and per turn, the scheduler's included), and the files
    in its spool now."""
    return metric_values(port, ("receiver_database_statements_total",
                                "receiver_database_round_trips_total",
                                "receiver_database_turns_total", "receiver_spool_files"))


def metric_values(port, wanted):
    found = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                found[name] = float(value)
    missing = set(wanted) - set(found)
    if missing:
        raise RuntimeError(f"/metrics has no {', '.join(sorted(missing))}")
    return tuple(found[name] for name in wanted)


def jobs_not_sent(database_url, up_to=None):
    """Jobs not sent yet; with `up_to`, only those stored up to that outbox id."""
    from models import Outbox

    def count():
        unsent = Outbox.select().where(Outbox.kind == "job",
                                       Outbox.status.not_in(["sent", "dead"]))
        return (unsent if up_to is None else unsent.where(Outbox.id <= up_to)).count()
    return database_rows(database_url, count)


def last_outbox_id(database_url):
    from peewee import fn

    from models import Outbox
    return database_rows(database_url, lambda: Outbox.select(fn.MAX(Outbox.id)).scalar()) or 0


def database_rows(database_url, query):
    from models import database
    from engine.connection import open_database
    open_database(database_url)
    try:
        return query()
    finally:
        database.close()


def outcomes(database_url, source):
    """How the events of `source` ended, warm-up included: proof the load did real work."""
    from peewee import fn

    from models import WebhookEvent
    return database_rows(database_url, lambda: dict(
        WebhookEvent.select(WebhookEvent.status, fn.COUNT(WebhookEvent.id))
        .where(WebhookEvent.source == source).group_by(WebhookEvent.status).tuples()))


def handling_ms(database_url, source, event_type, since):
    """Mean time from storing to handled of the events received since `since`: the
    per-event cost, also for events handled after the answer."""
    from models import WebhookEvent

    def query():
        events = (WebhookEvent.select(WebhookEvent.received_at, WebhookEvent.processed_at)
                  .where(WebhookEvent.source == source, WebhookEvent.event_type == event_type,
                         WebhookEvent.status == "processed", WebhookEvent.received_at >= since))
        return [1000 * (e.processed_at - e.received_at).total_seconds() for e in events]
    costs = database_rows(database_url, query)
    return round(statistics.fmean(costs), 2) if costs else None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """The CPU time (user and system) process `pid` has used, 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def postgres_cpu():
    """{pid: CPU seconds} of every PostgreSQL process on this machine (its server, on
    127.0.0.1 in the bench, shares the cores with the service)."""
    used = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/comm") as comm:
                    if comm.read().strip() != "postgres":
                        continue
            except OSError:
                continue
            used[int(name)] = cpu_seconds(name)
    return used


def machine_seconds():
    """(all, idle) CPU seconds of the machine's cores since boot."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return sum(ticks) / CLOCK_TICKS, (ticks[3] + ticks[4]) / CLOCK_TICKS


def with_cpu(pid, run, database=None):
    """`run()`'s load row, with what the run cost: the CPU process `pid` used (its share
    of one core over the run's time, and per request), how busy the machine's cores were
    meanwhile, and on PostgreSQL its server's CPU per request. A process whose share is
    near one core while the machine has cores idle is bound by its own CPU: one core is
    all one Python process's interpreter runs on."""
    before, machine_before = cpu_seconds(pid), machine_seconds()
    server_before = postgres_cpu() if database == "postgres" else None
    row = run()
    used = cpu_seconds(pid) - before
    total, idle = (after - then for after, then in zip(machine_seconds(), machine_before))
    requests = max(1, row["requests"])
    row.update(cpu_share=round(used / row["seconds"], 2),
               cpu_us_per_request=round(1e6 * used / requests),
               machine_busy=round(1 - idle / total, 2))
    if server_before is not None:
        server = sum(now - server_before.get(server_pid, 0.0)
                     for server_pid, now in postgres_cpu().items())
        row["database_cpu_us_per_request"] = round(1e6 * server / requests)
    return row


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def format_row(row):
    ratio, floor = row.get("ratio_to_ceiling"), row.get("ratio_to_floor")
    own = row.get("ratio_to_database_floor")
    return (f"{row['scenario']:<11} {row['database']:<10} {row['rps']:>9.1f} req/s  "
            f"p50 {row['p50_ms']:>7.2f} ms  p99 {row['p99_ms']:>7.2f} ms  "
            f"ratio {'' if ratio is None else f'{ratio:.3f}':>5}  "
            f"to floor {'' if floor is None else f'{floor:.3f}':>5}  "
            + (f"to its database's floor {own:.3f}  " if own is not None else "")
            + f"errors {sum(row['unexpected_statuses'].values())}"
            + (f"  statements/webhook {row['statements_per_webhook']}"
               if "statements_per_webhook" in row else "")
            + (f"  statements/turn {row['statements_per_turn']}"
               if "statements_per_turn" in row else "")
            + (f"  round trips/webhook {row['round_trips_per_webhook']}"
               f"  round trips/turn {row['round_trips_per_turn']}"
               if "round_trips_per_turn" in row else "")
            + (f"  one connection p50 {row['alone_p50_ms']:.2f} ms p99 "
               f"{row['alone_p99_ms']:.2f} ms" if "alone_p50_ms" in row else "")
            + (f"  CPU {row['cpu_share']:.2f} of a core, {row['cpu_us_per_request']} us/request"
               f" (machine {row['machine_busy']:.0%} busy)" if "cpu_share" in row else "")
            + (f"  PostgreSQL {row['database_cpu_us_per_request']} us/request"
               if "database_cpu_us_per_request" in row else "")
            + (f"  inbox {row['inbox']}" if row.get("inbox") else ""))


class FoundBack:
    """Polls the service's /readyz from the moment a destination comes back: `seconds()`
    is how long the service took to find it up (None if not within `timeout`)."""

    def __init__(self, port, destination, timeout):
        self.started = time.monotonic()
        self.found = None
        self.thread = threading.Thread(target=self._poll, daemon=True,
                                       args=(port, destination, timeout))
        self.thread.start()

    def _poll(self, port, destination, timeout):
        while time.monotonic() - self.started < timeout:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz",
                                            timeout=5) as answer:
                    if json.load(answer)["destinations"][destination] == "up":
                        self.found = time.monotonic() - self.started
                        return
            time.sleep(0.1)

    def seconds(self):
        self.thread.join()
        return None if self.found is None else round(self.found, 2)


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.extra = {}
        self.processes = Processes()
        self.peer_port, self.slow_port, self.smtp_port = free_port(), free_port(), free_port()
        self.ceiling = self.floor = None
        self.database_floors = {}

    def peer_url(self, slow=False):
        return f"http://127.0.0.1:{self.slow_port if slow else self.peer_port}"

    def start_peers(self):
        self.processes.start(["-m", "bench.peers", "--http-port", str(self.peer_port),
                              "--smtp-port", str(self.smtp_port)], self.peer_port)
        self.processes.start(["-m", "bench.peers", "--http-port", str(self.slow_port),
                              "--delay", str(SLOW_WORKER_SECONDS)], self.slow_port)

    def measure_references(self, databases):
        """The ceiling, the SQLite floor (the reference of every ratio to the floor), and
        the floor of each other database measured, for its rows' own reference."""
        self.ceiling = self.measure_reference("ceiling", "-", "bench.ceiling")
        with tempfile.TemporaryDirectory() as folder:
            self.floor = self.measure_reference("floor", "sqlite", "bench.floor",
                                                os.path.join(folder, "floor.sqlite3"))
        self.database_floors = {"sqlite": self.floor}
        for label, scratch in databases:
            if label == "postgres":
                with scratch() as url:
                    if url is not None:
                        self.database_floors[label] = self.measure_reference(
                            "floor", label, "bench.floor", url)

    def measure_reference(self, name, label, module, *arguments):
        """A bare app serving the ceiling scenario's requests, measured alone."""
        port = free_port()
        reference = Processes()
        process = reference.start(["-m", module, str(port), *arguments], port)
        try:
            load("ceiling", port, self.args.connections, self.args.warmup)
            row = with_cpu(process.pid, lambda: load(
                "ceiling", port, self.args.connections, self.args.duration), label)
        finally:
            reference.stop_all()
        row.update(scenario=name, database=label)
        row.update(self.ratios(row))
        self.record(row)
        return row

    def ratios(self, row):
        ratios = {"ratio_to_ceiling": round(row["rps"] / (self.ceiling or row)["rps"], 3),
                  "ratio_to_floor": round(row["rps"] / self.floor["rps"], 3)
                  if self.floor else None}
        own = self.database_floors.get(row.get("database"))
        if own is not None and own is not self.floor and row is not own:
            ratios["ratio_to_database_floor"] = round(row["rps"] / own["rps"], 3)
        return ratios

    def record(self, row):
        self.processes.check()
        self.rows.append(row)
        print(format_row(row), flush=True)

    @contextlib.contextmanager
    def service(self, database_url, slow_worker=False, worker_url=None):
        """The real service, as `make run` starts it, with the peers' addresses."""
        port = free_port()
        processes = Processes()
        with tempfile.TemporaryDirectory() as folder:
            peer = self.peer_url()
            env = {
                "RECEIVER_PORT": str(port), "DATABASE_URL": database_url,
                "WEBHOOK_SECRET": SECRET,
                "WORKER_URL": worker_url or self.peer_url(slow_worker),
                "WORKFLOW_URL": peer, "WORKFLOW_API_KEY": "k", "WORKFLOW_API_SECRET": "s",
                "WORKFLOW_SITE_NAME": "bench", "TELEGRAM_API_URL": peer,
                "TELEGRAM_BOT_TOKEN": "1:bench", "TELEGRAM_CHAT_ID": "1",
                "SMTP_URL": f"smtp://127.0.0.1:{self.smtp_port}",
                "ADMIN_EMAIL": "admin@bench.test", "SPOOL_DIR": os.path.join(folder, "spool"),
                "STRIPE_SECRET_KEY": "sk_test_bench",
                "STRIPE_WEBHOOK_SECRET": scenarios.CARD_SECRET,
                "CRYPTO_PROCESSOR_API_KEY": scenarios.CRYPTO_KEY,
            }
            try:
                yield port, processes.start(["receiver.py", "serve"], port, env,
                                            cwd=getattr(self.args, "root", ROOT))
            finally:
                processes.stop_all()

    def run_receiver(self, label, database_url, service, scenario, start):
        """Warm up on the first third of the seeded orders, measure on the second; then,
        on the orders of the second third that run left, one connection alone: the wait
        of a caller who finds the service idle."""
        port, process = service
        third = self.args.orders // 3
        options = (lambda offset: {"start": offset}) if start is not None else (lambda _: None)
        load(scenario, port, self.args.connections, self.args.warmup, options(0))
        *counts_before, _ = run_counts(port)
        result = with_cpu(process.pid, lambda: load(
            scenario, port, self.args.connections, self.args.duration, options(third)), label)
        *counts_after, spooled = run_counts(port)
        alone = load(scenario, port, 1, self.args.alone_duration,
                     options(third + result["requests"]))
        statements, round_trips, turns = (after - before for after, before in zip(
            counts_after, counts_before))
        requests = max(1, result["requests"])
        # Calls the service kept in its spool instead of the database (it took the
        # database for down): such a run measured the spool, and says so.
        if spooled:
            print(f"{scenario} {label}: {int(spooled)} spool file(s) after the run: it "
                  "measured the spool, not the database", flush=True)
        result.update(scenario=scenario, database=label, spool_files=int(spooled),
                      statements_per_webhook=round(statements / requests, 1),
                      statements_per_turn=round(statements / max(1, turns), 1),
                      round_trips_per_webhook=round(round_trips / requests, 1),
                      round_trips_per_turn=round(round_trips / max(1, turns), 1),
                      webhooks_per_turn=round(result["requests"] / max(1, turns), 1),
                      alone_p50_ms=alone["p50_ms"], alone_p99_ms=alone["p99_ms"],
                      inbox=outcomes(database_url, scenario))
        result.update(self.ratios(result))
        self.record(result)
        return result

    def measure_receivers(self, label, database_url):
        baseline = {}
        for scenario in RECEIVERS:
            paying = scenarios.SCENARIOS[scenario]
            if hasattr(paying, "orders"):
                seed_orders(database_url, paying, self.args.orders)
        with self.service(database_url) as service:
            for scenario in RECEIVERS:
                paying = scenarios.SCENARIOS[scenario]
                baseline[scenario] = self.run_receiver(
                    label, database_url, service, scenario,
                    0 if hasattr(paying, "orders") else None)
        self.measure_isolation(label, database_url, baseline["crypto"])

    def measure_isolation(self, label, database_url, baseline):
        """Crypto callbacks while a steady stream of workflow webhooks waits on a worker
        that answers after 2 s: the slow worker must not slow anybody else."""
        with self.service(database_url, slow_worker=True) as (port, _):
            stream = subprocess.Popen(
                loadgen_command("workflow", port, 16, self.args.duration + 2 * SLOW_WORKER_SECONDS,
                                {"prefix": f"ISO{os.getpid()}"}),
                cwd=ROOT, stdout=subprocess.PIPE, text=True)
            time.sleep(SLOW_WORKER_SECONDS)
            result = load("crypto", port, self.args.connections, self.args.duration,
                          {"start": 2 * (self.args.orders // 3)})
            workflow = json.loads(stream.communicate()[0])
        result.update(scenario="isolation", database=label, **self.ratios(result),
                      baseline_p99_ms=baseline["p99_ms"],
                      p99_vs_baseline=round(result["p99_ms"] / baseline["p99_ms"], 2),
                      slow_stream={k: workflow[k] for k in ("requests", "rps", "p50_ms")})
        self.record(result)
        print(f"           crypto p99 {result['p99_ms']} ms with the slow stream, "
              f"{baseline['p99_ms']} ms without: x{result['p99_vs_baseline']}", flush=True)

    def measure_drain(self, label, database_url):
        """The worker is down for --drain-outage seconds under steady workflow traffic,
        then comes back while the traffic goes on: how long until the service finds it
        back (its probe's backoff) and until the backlog is empty, how fast the backlog is
        sent once found back, the live p99 during the drain against the same traffic
        before the outage, and whether every job reached the worker exactly once."""
        args, worker_port = self.args, free_port()
        worker_url = f"http://127.0.0.1:{worker_port}"
        live_connections = max(1, args.connections // 4)
        with self.service(database_url, worker_url=worker_url) as (port, _):
            worker = Processes()
            try:
                worker.start(["-m", "bench.peers", "--http-port", str(worker_port)],
                             worker_port)
                before = load("workflow", port, live_connections, args.duration,
                              {"prefix": f"DRB{os.getpid()}"})
                self.wait_until_sent(database_url, args.drain_window)
                worker.stop_all()
                outage = load("workflow", port, args.connections, args.drain_outage,
                              {"prefix": f"DRO{os.getpid()}"})
                # The backlog is the jobs stored until now; the live stream's jobs, sent as
                # they come, are not waited for (some are always in flight).
                backlog_up_to = last_outbox_id(database_url)
                backlog = jobs_not_sent(database_url, backlog_up_to)
                worker.start(["-m", "bench.peers", "--http-port", str(worker_port)],
                             worker_port)
                found_back = FoundBack(port, "worker", args.drain_window)
                live_started = time.monotonic()
                live = subprocess.Popen(
                    loadgen_command("workflow", port, live_connections, args.drain_window,
                                    {"prefix": f"DRL{os.getpid()}"}, until_eof=True),
                    cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                drained_after = self.wait_until_sent(database_url, args.drain_window,
                                                     still=lambda: live.poll() is None,
                                                     up_to=backlog_up_to)
                # The live figures are those of the drain, over --duration at least;
                # communicate() closes the stream's input, which ends it.
                time.sleep(max(0.0, live_started + args.duration - time.monotonic()))
                during = json.loads(live.communicate()[0])
                left = self.wait_until_sent(database_url, args.drain_window)
                found_back_s = found_back.seconds()
                calls, distinct = worker_stats(worker_url)
            finally:
                worker.stop_all()
        # The worker that came back counts what reached it: the jobs of the outage and of
        # the drain (those of before were all sent to the first one).
        acknowledged = outage["requests"] + during["requests"]
        drained = drained_after is not None and found_back_s is not None
        sending_s = drained_after - found_back_s if drained else None
        row = {**during, "scenario": "drain", "database": label, **self.ratios(during),
               "backlog": backlog, "outage_s": args.drain_outage,
               "found_back_s": found_back_s,
               "drain_s": round(drained_after, 2) if drained else None,
               "drain_jobs_per_s": round(backlog / sending_s, 1)
               if drained and sending_s > 0 else None,
               "live_p99_before_ms": before["p99_ms"],
               "live_p99_vs_before": round(during["p99_ms"] / before["p99_ms"], 2),
               "jobs_acknowledged": acknowledged, "jobs_arrived": distinct,
               "jobs_duplicated": calls - distinct, "jobs_unsent": 0 if left is not None
               else jobs_not_sent(database_url)}
        self.record(row)
        print(f"            backlog {backlog} jobs after {args.drain_outage} s down; "
              f"worker found back after {found_back_s} s, backlog empty after "
              f"{row['drain_s']} s ({row['drain_jobs_per_s']} jobs/s once found); live p99 "
              f"{during['p99_ms']} ms vs {before['p99_ms']} ms before (x"
              f"{row['live_p99_vs_before']}); {distinct}/{acknowledged} jobs arrived, "
              f"{row['jobs_duplicated']} twice", flush=True)

    @staticmethod
    def wait_until_sent(database_url, timeout, still=lambda: True, up_to=None):
        """Seconds until no job (stored up to outbox id `up_to`, if given) is left
        unsent, or None after `timeout` (or once `still` says the caller's window
        closed)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout and still():
            if jobs_not_sent(database_url, up_to) == 0:
                return time.monotonic() - started
            time.sleep(0.25)
        return None

    def measure_instances(self, label, database_url):
        """Workflow webhooks against one instance, then against two instances of the
        service on the same database (the load split between them, same connections in
        all), with every job checked to have reached the worker exactly once."""
        args = self.args
        with self.service(database_url) as (port_a, _), self.service(database_url) as (port_b, _):
            load("workflow", port_a, args.connections, args.warmup, {"prefix": f"IW{os.getpid()}"})
            one = load("workflow", port_a, args.connections, args.duration,
                       {"prefix": f"I1{os.getpid()}"})
            self.record({**one, "scenario": "1 instance", "database": label,
                         **self.ratios(one)})
            calls_before, distinct_before = worker_stats(self.peer_url())
            half = max(1, args.connections // 2)
            streams = [subprocess.Popen(
                loadgen_command("workflow", port, half, args.duration,
                                {"prefix": f"I2{name}{os.getpid()}"}),
                cwd=ROOT, stdout=subprocess.PIPE, text=True)
                for name, port in (("a", port_a), ("b", port_b))]
            results = [json.loads(stream.communicate()[0]) for stream in streams]
            self.wait_until_sent(database_url, args.drain_window)
            calls, distinct = worker_stats(self.peer_url())
        requests = sum(r["requests"] for r in results)
        seconds = max(r["seconds"] for r in results)
        both = {"requests": requests, "seconds": seconds, "rps": round(requests / seconds, 1),
                "p50_ms": max(r["p50_ms"] for r in results),
                "p99_ms": max(r["p99_ms"] for r in results),
                "unexpected_statuses": {k: v for r in results
                                        for k, v in r["unexpected_statuses"].items()}}
        self.record({**both, "scenario": "2 instances", "database": label, **self.ratios(both),
                     "vs_1_instance": round(both["rps"] / one["rps"], 2),
                     "jobs_acknowledged": requests,
                     "jobs_arrived": distinct - distinct_before,
                     "jobs_duplicated": (calls - calls_before) - (distinct - distinct_before)})

    def measure_scale(self, label, database_url_factory):
        """Per-event cost of a card payment and a dispute with 1k, then 1M, rows."""
        costs = {}
        sizes = (1_000, self.args.scale_rows)
        for rows in sizes:
            with database_url_factory() as database_url:
                for scenario in ("card", "dispute"):
                    seed_orders(database_url, scenarios.SCENARIOS[scenario], rows)
                seed_ledger(database_url, rows)
                with self.service(database_url) as (port, _):
                    since = datetime.datetime.now(datetime.timezone.utc)
                    events = self.args.scale_events
                    card = load("card", port, 1, 120, {"start": 0}, requests=events)
                    load("dispute", port, 1, 120, {"start": 0}, requests=events)
                    time.sleep(1)  # disputes are handled after their answer
                    costs[rows] = {
                        "card_request_p50_ms": card["p50_ms"],
                        "card_handling_ms": handling_ms(database_url, "card",
                                                        "checkout.session.completed", since),
                        "dispute_handling_ms": handling_ms(database_url, "card",
                                                           "charge.dispute.created", since)}
            print(f"scale      {label:<10} {rows:>9} rows: {costs[rows]}", flush=True)
        small, large = (costs[size] for size in sizes)
        self.extra.setdefault("scale", {})[label] = {
            "rows": sizes, "small": small, "large": large,
            "ratio": {key: round(large[key] / small[key], 2) for key in small if small[key]}}
        print(f"scale      {label:<10} {sizes[1]}/{sizes[0]} rows: "
              f"{self.extra['scale'][label]['ratio']}", flush=True)

    def measure_memory(self, label, database_url, events):
        """RSS of the service over `events` workflow webhooks: start (after a warm-up),
        peak, end."""
        with self.service(database_url) as (port, process):
            load("workflow", port, 8, 30, {"prefix": "MEMWARM"}, requests=2_000)
            samples, done = [rss_kib(process.pid)], threading.Event()

            def sample():
                while not done.wait(0.5):
                    samples.append(rss_kib(process.pid))
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            result = load("workflow", port, self.args.connections, 24 * 3600,
                          {"prefix": "MEM"}, requests=events)
            done.set()
            sampler.join()
            samples.append(rss_kib(process.pid))
        memory = {"events": result["requests"], "start_kib": samples[0],
                  "peak_kib": max(samples), "end_kib": samples[-1],
                  "end_vs_start": round(samples[-1] / samples[0], 3)}
        self.extra.setdefault("memory", {})[label] = memory
        print(f"memory     {label:<10} {memory}", flush=True)

    def write_results(self):
        args = self.args
        os.makedirs(args.results, exist_ok=True)
        report = {
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "connections": args.connections, "duration_s": args.duration,
            "rows": self.rows, **self.extra,
        }
        with open(os.path.join(args.results, "latest.json"), "w") as out:
            json.dump(report, out, indent=2)
        with open(os.path.join(args.results, "latest.md"), "w") as out:
            out.write("| scenario | database | req/s | p50 ms | p99 ms | ratio to ceiling "
                      "| ratio to floor | ratio to its database's floor "
                      "| statements per webhook | statements per turn "
                      "| round trips per webhook | round trips per turn "
                      "| one connection: p50 ms | p99 ms "
                      "| CPU, share of a core | CPU us per request | machine busy "
                      "| PostgreSQL's CPU us per request |\n")
            out.write("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
            for row in self.rows:
                out.write(f"| {row['scenario']} | {row['database']} | {row['rps']} | "
                          f"{row['p50_ms']} | {row['p99_ms']} | {row['ratio_to_ceiling']} "
                          f"| {row['ratio_to_floor']} "
                          f"| {row.get('ratio_to_database_floor', '')} "
                          f"| {row.get('statements_per_webhook', '')} "
                          f"| {row.get('statements_per_turn', '')} "
                          f"| {row.get('round_trips_per_webhook', '')} "
                          f"| {row.get('round_trips_per_turn', '')} "
                          f"| {row.get('alone_p50_ms', '')} | {row.get('alone_p99_ms', '')} "
                          f"| {row.get('cpu_share', '')} | {row.get('cpu_us_per_request', '')} "
                          f"| {row.get('machine_busy', '')} "
                          f"| {row.get('database_cpu_us_per_request', '')} |\n")
            for row in self.rows:
                if row["scenario"] in ("drain", "2 instances"):
                    details = {k: v for k, v in row.items() if k.startswith(
                        ("backlog", "found_back", "drain", "live_", "jobs_", "outage", "vs_"))}
                    out.write(f"\n{row['scenario']} ({row['database']}): "
                              f"`{json.dumps(details)}`\n")
            for name in ("scale", "memory", "console", "drain_cut"):
                if name in self.extra:
                    out.write(f"\n{name}: `{json.dumps(self.extra[name])}`\n")
        print(f"results: {args.results}/latest.json and latest.md")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--alone-duration", type=float, default=5.0,
                        help="seconds of each receiver at one connection, after its run")
    parser.add_argument("--databases", default="sqlite,postgres",
                        help="comma-separated: sqlite, postgres (BENCH_POSTGRES_URL)")
    parser.add_argument("--orders", type=int, default=300_000,
                        help="orders seeded for each paying scenario (warm-up, run, isolation)")
    parser.add_argument("--scale", action="store_true",
                        help="also measure the per-event cost with 1k and 1M rows")
    parser.add_argument("--scale-rows", type=int, default=1_000_000,
                        help="the large table size of the scale run (the small one is 1k)")
    parser.add_argument("--scale-events", type=int, default=500,
                        help="card payments and disputes sent at each size")
    parser.add_argument("--memory", type=int, metavar="EVENTS",
                        help="also measure RSS over this many events")
    parser.add_argument("--drain-outage", type=float, default=30.0,
                        help="seconds the worker is down under load in the drain scenario")
    parser.add_argument("--drain-window", type=float, default=180.0,
                        help="at most this long for a backlog to drain")
    parser.add_argument("--console", action="store_true",
                        help="also time the operator console's pages (bench/console.py)")
    parser.add_argument("--console-rows", type=int, default=1_000_000,
                        help="events and outbox rows seeded for the console's pages")
    parser.add_argument("--drain-cut", action="store_true",
                        help="also the held backlog after a database cut, two instances on "
                        "PostgreSQL, at the default tick (bench/drain.py; about 7 minutes)")
    parser.add_argument("--results", default=RESULTS, help="folder for latest.json/.md")
    args = parser.parse_args(argv)

    bench = Bench(args)
    scratches = {"sqlite": sqlite_scratch, "postgres": postgres_scratch}
    databases = [(name, scratches[name]) for name in args.databases.split(",")]
    try:
        bench.start_peers()
        bench.measure_references(databases)
        for label, scratch in databases:
            with scratch() as url:
                if url is None:
                    print(f"{label}: not reachable (BENCH_POSTGRES_URL); skipped")
                    continue
                bench.measure_receivers(label, url)
            with scratch() as url:
                bench.measure_drain(label, url)
            if label == "postgres":
                with scratch() as url:
                    bench.measure_instances(label, url)
                if args.drain_cut:
                    bench.extra["drain_cut"] = measure_drain_cut(args.results)
            if args.scale:
                bench.measure_scale(label, scratch)
            if args.memory:
                with scratch() as url:
                    bench.measure_memory(label, url, args.memory)
            if args.console:
                with scratch() as url:
                    bench.extra.setdefault("console", {})[label] = console_pages.measure(
                        label, url, args.console_rows)
    finally:
        bench.processes.stop_all()
    bench.write_results()
    return 0


def measure_drain_cut(results):
    """bench/drain.py's run with its defaults: where its figures are, and each run's
    headline (its samples stay in its own file)."""
    # Imported here: bench.drain builds on this module.
    from bench import drain
    report = drain.run_all(drain.parser().parse_args(["--results", results]))
    return {"results": report["path"], "stalled": report["stalled"],
            "not_empty": report["not_empty"],
            "runs": [{key: value for key, value in run.items() if key != "samples"}
                     for run in report["runs"]]}


if __name__ == "__main__":
    sys.exit(main())
