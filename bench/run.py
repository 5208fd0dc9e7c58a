"""make bench: measure the receivers against the single-process ceiling, in one run.

Starts the peers (worker, Frappe, Telegram, SMTP), a bare Tornado app (the ceiling) and
the service (on SQLite, and on PostgreSQL when reachable), drives each scenario from the
load generator in its own process, and writes bench/results/latest.json and .md.

Measured: every receiver against the ceiling; isolation (the crypto callback while the
worker answers workflow jobs after 2 s); with --scale, the per-event cost of a card
payment and a dispute with 1k and with 1M rows (--scale-rows) in the order and ledger
tables; with --memory N, the service's RSS over N events.
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
import uuid

from bench import scenarios
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
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        self.running = []


def loadgen_command(scenario, port, connections, duration, options=None, requests=None):
    return [PYTHON, "-m", "bench.loadgen", scenario, "--port", str(port),
            "--connections", str(connections), "--duration", str(duration),
            "--options", json.dumps(options or {}),
            *(["--requests", str(requests)] if requests else [])]


def load(*args, **kwargs):
    output = subprocess.run(loadgen_command(*args, **kwargs), cwd=ROOT, check=True,
                            capture_output=True, text=True)
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


def database_rows(database_url, query):
    from models import database, open_database
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


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def format_row(row):
    ratio = row.get("ratio_to_ceiling")
    return (f"{row['scenario']:<10} {row['database']:<10} {row['rps']:>9.1f} req/s  "
            f"p50 {row['p50_ms']:>7.2f} ms  p99 {row['p99_ms']:>7.2f} ms  "
            f"ratio {'' if ratio is None else f'{ratio:.2f}':>5}  "
            f"errors {sum(row['unexpected_statuses'].values())}"
            + (f"  inbox {row['inbox']}" if row.get("inbox") else ""))


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.extra = {}
        self.processes = Processes()
        self.peer_port, self.slow_port, self.smtp_port = free_port(), free_port(), free_port()
        self.ceiling = None

    def peer_url(self, slow=False):
        return f"http://127.0.0.1:{self.slow_port if slow else self.peer_port}"

    def start_peers(self):
        self.processes.start(["-m", "bench.peers", "--http-port", str(self.peer_port),
                              "--smtp-port", str(self.smtp_port)], self.peer_port)
        self.processes.start(["-m", "bench.peers", "--http-port", str(self.slow_port),
                              "--delay", str(SLOW_WORKER_SECONDS)], self.slow_port)

    def measure_ceiling(self):
        port = free_port()
        ceiling = Processes()
        ceiling.start(["-m", "bench.ceiling", str(port)], port)
        try:
            load("ceiling", port, self.args.connections, self.args.warmup)
            self.ceiling = load("ceiling", port, self.args.connections, self.args.duration)
        finally:
            ceiling.stop_all()
        self.ceiling.update(scenario="ceiling", database="-", ratio_to_ceiling=1.0)
        self.record(self.ceiling)

    def record(self, row):
        self.rows.append(row)
        print(format_row(row), flush=True)

    @contextlib.contextmanager
    def service(self, database_url, slow_worker=False):
        """The real service, as `make run` starts it, with the peers' addresses."""
        port = free_port()
        processes = Processes()
        with tempfile.TemporaryDirectory() as folder:
            peer = self.peer_url()
            env = {
                "RECEIVER_PORT": str(port), "DATABASE_URL": database_url,
                "WEBHOOK_SECRET": SECRET, "WORKER_URL": self.peer_url(slow_worker),
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
                with open(os.path.join(folder, "service.log"), "wb") as log:
                    yield port, processes.start(["receiver.py", "serve"], port, env, log=log)
            finally:
                processes.stop_all()

    def run_receiver(self, label, database_url, port, scenario, start):
        """Warm up on the first third of the seeded orders, measure on the second."""
        third = self.args.orders // 3
        options = (lambda offset: {"start": offset}) if start is not None else (lambda _: None)
        load(scenario, port, self.args.connections, self.args.warmup, options(0))
        result = load(scenario, port, self.args.connections, self.args.duration,
                      options(third))
        result.update(scenario=scenario, database=label,
                      ratio_to_ceiling=round(result["rps"] / self.ceiling["rps"], 3),
                      inbox=outcomes(database_url, scenario))
        self.record(result)
        return result

    def measure_receivers(self, label, database_url):
        baseline = {}
        with self.service(database_url) as (port, _):
            for scenario in RECEIVERS:
                paying = scenarios.SCENARIOS[scenario]
                if hasattr(paying, "orders"):
                    seed_orders(database_url, paying, self.args.orders)
                baseline[scenario] = self.run_receiver(
                    label, database_url, port, scenario,
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
        result.update(scenario="isolation", database=label,
                      ratio_to_ceiling=round(result["rps"] / self.ceiling["rps"], 3),
                      baseline_p99_ms=baseline["p99_ms"],
                      p99_vs_baseline=round(result["p99_ms"] / baseline["p99_ms"], 2),
                      slow_stream={k: workflow[k] for k in ("requests", "rps", "p50_ms")})
        self.record(result)
        print(f"           crypto p99 {result['p99_ms']} ms with the slow stream, "
              f"{baseline['p99_ms']} ms without: x{result['p99_vs_baseline']}", flush=True)

    def measure_scale(self, label, database_url_factory):
        """Per-event cost of a card payment and a dispute with 1k, then 1M, rows."""
        costs = {}
        sizes = (1_000, self.args.scale_rows)
        for rows in sizes:
            with database_url_factory() as database_url:
                with self.service(database_url) as (port, _):
                    for scenario in ("card", "dispute"):
                        seed_orders(database_url, scenarios.SCENARIOS[scenario], rows)
                    seed_ledger(database_url, rows)
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
            out.write("| scenario | database | req/s | p50 ms | p99 ms | ratio to ceiling |\n")
            out.write("|---|---|---|---|---|---|\n")
            for row in self.rows:
                out.write(f"| {row['scenario']} | {row['database']} | {row['rps']} | "
                          f"{row['p50_ms']} | {row['p99_ms']} | {row['ratio_to_ceiling']} |\n")
            for name in ("scale", "memory"):
                if name in self.extra:
                    out.write(f"\n{name}: `{json.dumps(self.extra[name])}`\n")
        print(f"results: {args.results}/latest.json and latest.md")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--sqlite-only", action="store_true")
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
    parser.add_argument("--results", default=RESULTS, help="folder for latest.json/.md")
    args = parser.parse_args(argv)

    bench = Bench(args)
    databases = [("sqlite", sqlite_scratch)]
    if not args.sqlite_only:
        databases.append(("postgres", postgres_scratch))
    try:
        bench.start_peers()
        bench.measure_ceiling()
        for label, scratch in databases:
            with scratch() as url:
                if url is None:
                    print(f"{label}: not reachable (BENCH_POSTGRES_URL); skipped")
                    continue
                bench.measure_receivers(label, url)
            if args.scale:
                bench.measure_scale(label, scratch)
            if args.memory:
                with scratch() as url:
                    bench.measure_memory(label, url, args.memory)
    finally:
        bench.processes.stop_all()
    bench.write_results()
    return 0


if __name__ == "__main__":
    sys.exit(main())
