"""make profile: where a receiver's time goes under load, sampled by py-spy.

For each database and receiver: the service as `make bench` starts it, warmed up, then
sampled by py-spy (100 samples a second, every thread, idle waits left out) for the
length of a load run. Writes, in --out:
    <receiver>-<database>.svg   the flame graph
    profile.json, profile.md    each receiver's samples by what they were doing

Each thread apart (the loop, the database thread, the others), a sample is put in the first category whose rule matches a frame, walking its stack from
the innermost frame out, so a statement made by a plugin counts as a statement and the
plugin's own Python as plugin. "other" is what no rule names (Tornado's own loop
bookkeeping, asyncio, the scheduler).

With --gil only the thread holding the interpreter's lock is sampled, and each share is
of all the samples, every thread together: the service runs its Python on one core at a
time, so when it is bound by that core (`make bench` prints its share of a core), this
is what the core's time goes to, and what cutting a part would win."""
import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

from bench import scenarios
from bench.run import (Bench, PYTHON, RECEIVERS, ROOT, load, postgres_scratch,
                       sqlite_scratch, with_cpu)
from bench.seed import seed_orders

# (category, substrings of a frame's "function (file:line)"), tried in this order.
RULES = (
    ("waiting for work", ("EpollSelector.select", "_worker (concurrent/futures/thread.py:81)")),
    ("logging", ("/logging/", "lograte.py", "app/logs.py")),
    ("statements", ("peewee.py", "playhouse/", "psycopg2", "sqlite3", "engine/prepared.py",
                    "engine/connection.py", "engine/joined.py", "(models.py")),
    ("outbound HTTP", ("aiohttp/", "clients/", "multidict", "yarl/")),
    ("hand-off", ("concurrent/futures", "engine/commits.py", "threading.py",
                  "run_in_executor", "call_soon_threadsafe")),
    ("plugin", ("plugins/", "domain/")),
    ("engine", ("engine/",)),
    ("authenticate", ("hmac.py", "secrets.py", "_authenticate", "authenticate",
                      "handlers/ratelimit.py", "handlers/budget.py")),
    ("parse", ("json/", "engine/payload.py", "handlers/")),
    ("HTTP server", ("tornado/http1connection.py", "tornado/httputil.py",
                     "tornado/iostream.py", "tornado/web.py", "tornado/httpserver.py",
                     "app/connections.py")),
    ("metrics", ("prometheus_client/", "ops/metrics.py")),
)


def category(stack: str) -> tuple:
    """(thread, category) of one sampled stack; py-spy's --threads puts the thread
    first, "thread (TID): NAME"."""
    frames = stack.split(";")
    thread = frames[0].partition(": ")[2] if frames[0].startswith("thread (") else ""
    thread = ("loop" if thread == "MainThread" else
              "database thread" if thread.startswith("database") else "other threads")
    for frame in reversed(frames):
        for name, needles in RULES:
            if any(needle in frame for needle in needles):
                return thread, name
    return thread, "other"


# The service's own code: a frame "function (handlers/base.py:12)" is in module
# handlers/base.py.
OWN = ("handlers/", "plugins/", "domain/", "engine/", "clients/", "app/", "ops/",
       "models.py", "scheduler.py", "settings.py")


def own_functions(stack: str) -> set:
    """The service's functions on a stack ("module:function"), each once."""
    found = set()
    for frame in stack.split(";"):
        function, _, where = frame.rpartition(" (")
        module = where.partition(":")[0]
        if module.startswith(OWN):
            found.add(f"{module}:{function.rpartition('.')[2] or function}")
    return found


def summarise(raw_path: str, of_all: bool = False) -> dict:
    """Per thread, the share of its samples in each category, from py-spy's raw
    (collapsed stack) output (a thread's total is the time it was sampled running), or of
    every thread's samples together when `of_all`; and the service's functions that took
    the most samples, their callees included."""
    counts = collections.defaultdict(collections.Counter)
    inclusive = collections.Counter()
    with open(raw_path) as raw:
        for line in raw:
            stack, _, samples = line.rstrip("\n").rpartition(" ")
            if stack:
                thread, name = category(stack)
                counts[thread][name] += int(samples)
                for function in own_functions(stack):
                    inclusive[function] += int(samples)
    total = sum(sum(names.values()) for names in counts.values()) or 1
    summary = {thread: {"samples": sum(names.values()),
                        "share": {name: round(100 * count / (
                            total if of_all else sum(names.values())), 1)
                                  for name, count in names.most_common()}}
               for thread, names in counts.items()}
    summary["functions, share of all samples"] = {
        function: round(100 * count / total, 1) for function, count in inclusive.most_common(25)}
    return summary


def sample(pid: int, seconds: float, svg: str, raw: str, gil: bool) -> list:
    """Two py-spy samplers on the service: a flame graph and collapsed stacks."""
    py_spy = shutil.which("py-spy", path=os.path.dirname(PYTHON)) or "py-spy"
    common = ["record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
              "--nonblocking", "--threads", *(["--gil"] if gil else [])]
    return [subprocess.Popen([py_spy, *common, "--format", fmt, "--output", path],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for fmt, path in (("flamegraph", svg), ("raw", raw))]


def profile_receiver(bench: Bench, label: str, url: str, receiver: str, out: str) -> dict:
    paying = scenarios.SCENARIOS[receiver]
    start = 0 if hasattr(paying, "orders") else None
    options = (lambda offset: {"start": offset}) if start is not None else (lambda _: None)
    third = bench.args.orders // 3
    if start is not None:
        seed_orders(url, paying, bench.args.orders)
    with bench.service(url) as (port, process):
        load(receiver, port, bench.args.connections, bench.args.warmup, options(0))
        with tempfile.TemporaryDirectory() as folder:
            raw = os.path.join(folder, "stacks.txt")
            samplers = sample(process.pid, bench.args.duration,
                              os.path.join(out, f"{receiver}-{label}.svg"), raw, bench.args.gil)
            result = with_cpu(process.pid, lambda: load(
                receiver, port, bench.args.connections, bench.args.duration, options(third)))
            for sampler in samplers:
                sampler.wait(60)
            summary = summarise(raw, of_all=bench.args.gil)
    print(f"{receiver:<9} {label:<9} {result['rps']:>7.1f} req/s, CPU {result['cpu_share']:.2f} "
          f"of a core, {result['cpu_us_per_request']} us/request", flush=True)
    functions = summary.pop("functions, share of all samples")
    for thread, row in summary.items():
        print(f"    {thread:<16} {row['share']}", flush=True)
    return {"rps": result["rps"], "p50_ms": result["p50_ms"], "cpu_share": result["cpu_share"],
            "cpu_us_per_request": result["cpu_us_per_request"], "threads": summary,
            "functions": functions}


def write(out: str, report: dict, args: argparse.Namespace) -> None:
    with open(os.path.join(out, "profile.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    names = [name for name, _ in RULES] + ["other"]
    with open(os.path.join(out, "profile.md"), "w") as handle:
        handle.write(("Shares of all samples, every thread together (--gil: the thread "
                      "holding the interpreter's lock)\n\n" if args.gil else
                      "Shares of each thread's samples\n\n")
                     + "| receiver | database | req/s | CPU us per request | thread | samples | "
                     + " | ".join(names) + " |\n")
        handle.write("|---|---|---|---|---|---|" + "---|" * len(names) + "\n")
        for key, row in report.items():
            receiver, label = key.split("/")
            for thread in ("loop", "database thread", "other threads"):
                if thread in row["threads"]:
                    part = row["threads"][thread]
                    shares = [f"{part['share'].get(name, 0.0)}" for name in names]
                    handle.write(f"| {receiver} | {label} | {row['rps']} | "
                                 f"{row['cpu_us_per_request']} | {thread} | "
                                 f"{part['samples']} | " + " | ".join(shares) + " |\n")
        for key, row in report.items():
            handle.write(f"\n{key}, the service's functions by their share of all samples "
                         "(callees included):\n\n")
            for function, share in row["functions"].items():
                handle.write(f"- {share}% `{function}`\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--databases", default="sqlite,postgres")
    parser.add_argument("--receivers", default=",".join(RECEIVERS))
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--orders", type=int, default=60_000)
    parser.add_argument("--out", default=os.path.join("bench", "results", "profile"))
    parser.add_argument("--gil", action="store_true",
                        help="sample only the thread holding the interpreter's lock; shares "
                             "of all samples")
    parser.add_argument("--root", default=ROOT,
                        help="the checkout whose `receiver.py serve` is profiled (default: "
                             "this one), to compare a commit before a change with the same "
                             "harness and load")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(args)
    scratches = {"sqlite": sqlite_scratch, "postgres": postgres_scratch}
    report = {}
    try:
        bench.start_peers()
        for label in args.databases.split(","):
            for receiver in args.receivers.split(","):
                with scratches[label]() as url:
                    if url is None:
                        print(f"{label}: not reachable (BENCH_POSTGRES_URL); skipped")
                        break
                    report[f"{receiver}/{label}"] = profile_receiver(
                        bench, label, url, receiver, args.out)
    finally:
        bench.processes.stop_all()
    write(args.out, report, args)
    print(f"results: {args.out}/profile.json, profile.md and one flame graph per receiver")
    return 0


if __name__ == "__main__":
    sys.exit(main())
