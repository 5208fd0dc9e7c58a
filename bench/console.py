"""The operator console's pages with 1M events, 1M outbox rows and 1M send attempts, and
what recording attempts costs: `make bench BENCH_ARGS=--console`, or alone:
`python -m bench.console [--rows N] [--sqlite-only]`.

Seeds a scratch database as 30 days of traffic (the retention period) would leave it,
starts `receiver.py serve` with the console on, logs in as a browser does, and times
each page from this process over loopback (the whole request, HTML included). Then, on
the same database, times the UPDATEs that record send outcomes with the trigger that
copies each attempt into `attempts` (migration 0013) and without it."""
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

from models import Attempt, Outbox, WebhookEvent, database, is_postgres, utcnow
from engine.connection import open_database

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
# Outcomes recorded per timing of the attempts' cost: as a drain records them (batches
# of this many sent rows in one UPDATE), and one by one as a live request's are.
OUTCOME_BATCH = 100
OUTCOMES = 1000


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
                Attempt.insert_many([attempt_row(n, at) for n, at in times.items()]).execute()
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


PAYLOADS = {
    "job": lambda order: {"action": "name_search", "payload": {"order_number": order}},
    "workflow_action": lambda order: {"doctype": "Formation Order", "name": f"ORD-{order}",
                                      "action": "Start Name Check"},
    "email": lambda order: {"to": ["customer@example.test"], "subject": f"Order {order}",
                            "text": "Thank you.", "html": "<p>Thank you.</p>"},
}


def effect_row(n, at):
    status = effect_status(n)
    kind = KINDS[n % len(KINDS)]
    return {"event": n + 1, "kind": kind, "order_number": order_of(n),
            "payload": json.dumps(PAYLOADS[kind](order_of(n))), "idempotency_key": f"seed-{n}", "status": status,
            "attempts": 1, "next_attempt_at": at, "created_at": at, "updated_at": at,
            "sent_at": at if status == "sent" else None,
            "last_error": "HTTP 400" if status == "dead" else None}


def attempt_row(n, at):
    """Each effect's last attempt (outbox ids are n + 1: the seed fills an empty table)."""
    status = effect_status(n)
    return {"outbox_id": n + 1, "destination": KINDS[n % len(KINDS)], "attempted_at": at,
            "outcome": status, "status_code": 400 if status == "dead" else
            503 if status == "pending" else 200, "duration_ms": 40 + n % 50,
            "error": "HTTP 400" if status == "dead" else None,
            "reply": '{"ok": true}', "created_at": at, "updated_at": at}


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
        "effect page": f"/console/outbox/{rows // 2 + 1}",
        "outbox, dead": "/console/outbox?status=dead",
        "settlement": "/console/settlement",
    }


def attempt_cost(database_url):
    """Microseconds per recorded outcome, {with the trigger, without}: a drain's batch of
    sent rows in one UPDATE, and a live send's retry outcome, one UPDATE each."""
    import importlib

    from app.context import Context
    from clients.http import Result
    from engine import outbox
    from settings import Settings
    attempts_migration = importlib.import_module("migrations.0013_attempts")
    db = open_database(database_url)
    ctx = Context.create(Settings())
    now = utcnow()
    with database.atomic():
        Outbox.insert_many([{
            "kind": "job", "order_number": f"COST-{n}", "payload": "{}",
            "idempotency_key": f"cost-{n}", "status": "pending", "attempts": 0,
            "next_attempt_at": now, "created_at": now, "updated_at": now}
            for n in range(OUTCOMES)]).execute()
    rows = list(Outbox.select().where(Outbox.idempotency_key.startswith("cost-"))
                .order_by(Outbox.id))
    for row in rows:
        row.last_attempt_at, row.last_duration_ms = now, 42
        row.last_status_code, row.last_reply = 200, '{"ok": true}'
    sent, failed = Result(ok=True, status=200), Result.failed("HTTP 503: busy", status=503)

    def put_back():  # an UPDATE to fewer attempts: no attempt kept
        Outbox.update(status="pending", attempts=0).where(
            Outbox.idempotency_key.startswith("cost-")).execute()
        for row in rows:
            row.attempts = 0

    def timed_outcomes():
        put_back()
        started = time.perf_counter()
        for at in range(0, OUTCOMES, OUTCOME_BATCH):
            batch = rows[at:at + OUTCOME_BATCH]
            with database.atomic():
                outbox.record_outcomes(ctx, batch, [sent] * len(batch))
        batched = time.perf_counter() - started
        put_back()
        started = time.perf_counter()
        for row in rows:
            with database.atomic():
                outbox.record_outcome(ctx, row, failed)
        one_by_one = time.perf_counter() - started
        return {"batch_us_per_outcome": round(1e6 * batched / OUTCOMES, 1),
                "one_by_one_us_per_outcome": round(1e6 * one_by_one / OUTCOMES, 1)}
    drop_trigger = ("DROP TRIGGER outbox_attempt ON outbox" if is_postgres(db)
                    else "DROP TRIGGER outbox_attempt")
    figures = {"with attempts kept": [], "without": []}
    try:
        # Each way twice, alternately, so that neither has the warmer cache; the lower.
        for _ in range(2):
            figures["with attempts kept"].append(timed_outcomes())
            db.execute_sql(drop_trigger)
            figures["without"].append(timed_outcomes())
            attempts_migration.apply(db, None)  # the trigger back as it was
        kept = Attempt.select().where(Attempt.outbox_id >= rows[0].id).count()
        assert kept == 4 * OUTCOMES, kept
    finally:
        database.close()
    return {way: {name: min(run[name] for run in runs) for name in runs[0]}
            for way, runs in figures.items()}


def measure(label, database_url, rows):
    started = time.monotonic()
    seed(database_url, rows)
    print(f"console    {label:<10} seeded {rows} events, outbox rows and attempts in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    results = {}
    with console_service(database_url) as base:
        session = logged_in(base)
        for name, path in pages(session, base, rows).items():
            results[name] = timed(session, base + path)
            print(f"console    {label:<10} {name:<32} p50 {results[name]['p50_ms']:>7.1f} ms"
                  f"  max {results[name]['max_ms']:>7.1f} ms", flush=True)
    results["recording outcomes"] = cost = attempt_cost(database_url)
    print(f"console    {label:<10} recording outcomes, us each: {json.dumps(cost)}", flush=True)
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
