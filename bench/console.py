"""The operator console's pages with 1M events and 1M outbox rows: `make bench
BENCH_ARGS=--console`, or alone: `python -m bench.console [--rows N] [--sqlite-only]`.

Seeds a scratch database as 30 days of traffic (the retention period) would leave it,
starts `receiver.py serve` with the console on, logs in as a browser does, and times
each page from this process over loopback (the whole request, HTML included)."""
import argparse
import contextlib
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time

import requests

from models import Outbox, WebhookEvent, database, is_postgres, open_database, utcnow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSWORD = "bench console password"
BATCH = 5000
RETENTION = datetime.timedelta(days=30)
# Of every 1,000 events: sources, and how they ended.
SOURCES = (("workflow", "formation/submitted", 600), ("card", "checkout.session.completed", 300),
           ("crypto", "PAID", 100))
KINDS = ("job", "job", "workflow_action", "email")
REPEAT = 20
DEPTH = 200


def source_of(n):
    slot = n % 1000
    for source, event_type, share in SOURCES:
        if slot < share:
            return source, event_type
        slot -= share
    raise AssertionError(n)


def event_status(n):
    return "failed" if n % 97 == 0 else "ignored" if n % 89 == 0 else "processed"


def effect_status(n):
    return "dead" if n % 199 == 0 else "pending" if n % 101 == 0 else "sent"


def seed(database_url, rows):
    """`rows` events over the last 30 days, each with one effect; five events per order."""
    import migrations
    db = open_database(database_url)
    migrations.migrate(db)
    now = utcnow()
    step = RETENTION / rows
    try:
        for first in range(0, rows, BATCH):
            times = {n: now - (rows - n) * step for n in range(first, min(first + BATCH, rows))}
            with database.atomic():
                WebhookEvent.insert_many([event_row(n, at) for n, at in times.items()]).execute()
                Outbox.insert_many([effect_row(n, at) for n, at in times.items()]).execute()
        # What autovacuum does on a live PostgreSQL (statistics, and the visibility map
        # index-only scans need); SQLite's planner reads the same statistics.
        db.execute_sql("VACUUM ANALYZE" if is_postgres(db) else "ANALYZE")
    finally:
        database.close()


def event_row(n, at):
    source, event_type = source_of(n)
    status = event_status(n)
    return {"source": source, "event_type": event_type, "dedup_key": f"seed-{n}",
            "external_id": f"evt_{n}" if source != "workflow" else None,
            "order_number": order_of(n), "payload": json.dumps({"order_number": order_of(n)}),
            "status": status, "attempts": 1, "received_at": at, "created_at": at,
            "updated_at": at, "processed_at": at if status == "processed" else None,
            "last_error": "OrderNotFound" if status == "failed" else None}


def effect_row(n, at):
    status = effect_status(n)
    return {"event": n + 1, "kind": KINDS[n % len(KINDS)], "order_number": order_of(n),
            "payload": "{}", "idempotency_key": f"seed-{n}", "status": status,
            "attempts": 1, "next_attempt_at": at, "created_at": at, "updated_at": at,
            "sent_at": at if status == "sent" else None,
            "last_error": "HTTP 400" if status == "dead" else None}


def order_of(n):
    return f"FO-{n // 5}"


@contextlib.contextmanager
def console_service(database_url):
    from bench.run import Processes, free_port
    from ops.passwords import hash_password
    port = free_port()
    processes = Processes()
    with tempfile.TemporaryDirectory() as folder:
        env = {"RECEIVER_PORT": str(port), "DATABASE_URL": database_url,
               "SPOOL_DIR": os.path.join(folder, "spool"),
               "CONSOLE_PASSWORD_HASH": hash_password(PASSWORD),
               "COOKIE_SECRET": "bench-cookie-secret-0123456789abcdef"}
        try:
            processes.start(["receiver.py", "serve"], port, env)
            yield f"http://127.0.0.1:{port}"
        finally:
            processes.stop_all()


def logged_in(base):
    session = requests.Session()
    # A port that accepts is not yet a service that is ready (migrations, the jobs run
    # at start on a loaded machine): wait for /readyz first.
    deadline = time.monotonic() + 60
    while session.get(base + "/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the console's service never became ready"
        time.sleep(0.2)
    page = session.get(base + "/console/login")
    token = re.search(r'name="_xsrf" value="([^"]+)"', page.text)
    assert token, (page.status_code, page.text[:500])
    token = token.group(1)
    answer = session.post(base + "/console/login", data={
        "_xsrf": token, "name": "bench", "password": PASSWORD}, allow_redirects=False)
    assert answer.status_code == 302, answer.status_code
    return session


def timed(session, url):
    times = []
    for _ in range(REPEAT):
        started = time.perf_counter()
        answer = session.get(url, allow_redirects=False)
        times.append(1000 * (time.perf_counter() - started))
        assert answer.status_code == 200, (url, answer.status_code)
    return {"p50_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1)}


def pages(session, base, rows):
    """The pages the issue names, and the slowest filters and a page deep in the list."""
    first = session.get(base + "/console/events").text
    after = re.search(r'href="/console/events\?after=([^"]+)" rel="next"', first).group(1)
    depth = min(DEPTH, rows // 5000)
    for _ in range(depth):  # a page deep in the list: 10,000 events in at 1M rows
        deep = session.get(base + "/console/events?after=" + after).text
        after = re.search(r'href="/console/events\?after=([^"]+)" rel="next"', deep).group(1)
    middle = order_of(rows // 2)
    return {
        "overview": "/console/",
        "events, first page": "/console/events",
        f"events, page {depth + 2}": "/console/events?after=" + after,
        "events, status=failed": "/console/events?status=failed",
        "events, source=crypto": "/console/events?source=crypto",
        "events, search by external id": f"/console/events?q=evt_{rows // 2 + 1}",
        "order timeline": f"/console/orders/{middle}",
        "outbox, dead": "/console/outbox?status=dead",
        "settlement": "/console/settlement",
    }


def measure(label, database_url, rows):
    started = time.monotonic()
    seed(database_url, rows)
    print(f"console    {label:<10} seeded {rows} events and {rows} outbox rows in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    results = {}
    with console_service(database_url) as base:
        session = logged_in(base)
        for name, path in pages(session, base, rows).items():
            results[name] = timed(session, base + path)
            print(f"console    {label:<10} {name:<32} p50 {results[name]['p50_ms']:>7.1f} ms"
                  f"  max {results[name]['max_ms']:>7.1f} ms", flush=True)
    return results


def main(argv=None):
    from bench.run import postgres_scratch, sqlite_scratch
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--sqlite-only", action="store_true")
    args = parser.parse_args(argv)
    report = {}
    for label, scratch in (("sqlite", sqlite_scratch), ("postgres", postgres_scratch)):
        if label == "postgres" and args.sqlite_only:
            continue
        with scratch() as url:
            if url is None:
                print(f"{label}: not reachable; skipped")
                continue
            report[label] = measure(label, url, args.rows)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
