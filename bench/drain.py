"""The held backlog after a database cut, with two instances:
`python -m bench.drain [--tick S] [--runs N] [--cut-mode cut|freeze]`, or
`make bench BENCH_ARGS=--drain-cut` (bench/run.py).

Two instances of the service (`receiver.py serve`, started as the suite starts it:
tests/service_process.py) share one scratch PostgreSQL database beside
BENCH_POSTGRES_URL, each through the same TCP proxy (tests/service_process.TcpProxy)
and with a spool of its own. RATE calls a second for DURATION seconds, each to either
instance at random, about ORDERS hot formation orders:

- two thirds Frappe workflow webhooks: each order's document goes round its six
  formation states, one change after another, with a growing `modified`; the stand-in
  site (tests/frappe_site.py) saves the document and writes its workflow log before the
  webhook is sent, as Frappe does;
- a sixth signed Stripe events (payment_intent.payment_failed, a new intent each: a
  fact of no stream, about the order, handled after the answer);
- a sixth SHKeeper callbacks, each listing its invoice's transactions so far and one new.

The proxy is cut (connections reset, new ones refused) or frozen (every byte dropped)
from CUT_FROM to CUT_TO seconds into the load. A sampler counts the held and unfinished
events and the calls in the spools every second. After the load the backlog is given
WINDOW seconds to empty.

Each run's figures, in bench/results/drain-<when>.json: calls acknowledged, lost
(acknowledged, not stored), stored twice; held at the cut's end and at the load's end;
handled/s from the cut's end to the load's end; when the backlog was empty, counted from
the cut's end (or that it was not within WINDOW s of the load's end); the drain rate
after the load; the share of calls answered from the cut on that were handled within 2 s
of their answer; the changes handled as history; the jobs each order's stream sent out of
order (by the order the worker stand-in received them in) and the jobs sent twice.

A backlog left unfinished is a stall, and is said as one: the run's `stall` names the
heads of the streams that wait (status, attempts, when due), what each instance's inbox
job did (its runs by result from /metrics) and when each instance last handled an event,
and keeps, beside the results, py-spy dumps of both instances, the server's advisory
locks and sessions, their /metrics and their logs. The command then exits 1."""
import argparse
import asyncio
import collections
import dataclasses
import datetime
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from typing import NamedTuple

import aiohttp

from bench.run import PYTHON, RESULTS, ROOT, postgres_scratch
from bench.seed import seed_orders
from domain.reconcile import canonical_modified
from engine.connection import open_database
from engine.inbox import AWAITING_HANDLING, FINAL_STATUSES, held_count
from models import Outbox, WebhookEvent, database
from scheduler import JOBS
from tests import shkeeper, stripe_events
from tests.conftest import WEBHOOK_SECRET
from tests.frappe_site import API_KEY, API_SECRET, FrappeSite, frappe_text
from tests.peers import HttpPeer, SmtpPeer
from tests.service_process import ServiceProcess, TcpProxy
from tests.test_multiprocess import spooled_lines

DOCTYPE = "Formation Order"
# The fields the stand-in site's doctypes have (the service lists them, and checks both
# doctypes at its start).
FIELDS = {DOCTYPE: ["order_number", "state_code", "entity_name"],
          "CRTC Order": ["order_number", "incorporation_number"]}
# A formation order's document goes round these, in this order (path, Frappe's state).
CYCLE = (("formation/submitted", "Submitted"), ("formation/name-available", "Name Available"),
         ("formation/filed-needs-ein", "Filed Needs EIN"),
         ("formation/ein-obtained", "EIN Obtained"), ("formation/approved", "Approved"),
         ("formation/ready", "Ready"))
# Of every six calls: four workflow webhooks, one Stripe event, one SHKeeper callback.
SENDERS = ("workflow", "workflow", "card", "workflow", "workflow", "crypto")
ORDER_NUMBER = "FO-H{:02d}"
ACKNOWLEDGED = (200, 202)
CALL_TIMEOUT_SECONDS = 30
# An answered call counts as handled promptly within this long of its answer.
PROMPT_SECONDS = 2.0
# How long after the backlog is empty the sent jobs are waited for (the live sends and
# the scheduled sender's last tick), at most.
JOBS_WAIT_SECONDS = 60
# The jobs' advisory lock ids, to name them among the server's locks.
LOCK_NAMES = {job.lock_id: job.name for job in JOBS}
HANDLED_LINE = re.compile(r"^(\S+ \S+) INFO receiver\.events event #\d+ \S+ \S+ "
                          r"(processed|ignored|rejected|dead)\b", re.MULTILINE)


class HotOrders:
    """The orders every call is about, as bench.seed seeds a scenario's."""
    orders = ("formation", ORDER_NUMBER)


@dataclasses.dataclass
class Call:
    sender: str
    instance: int
    identity: tuple
    due_at: float  # when the rate has it sent
    sent_at: float
    answered_at: float | None = None
    status: int | None = None


class Calls:
    """What the load sends: call `number`'s path, body, headers and identity (what its
    stored event is known by: `stored_identity`). Each order's document and invoice keep
    their state here, and the stand-in site is told of each save before its webhook."""

    def __init__(self, site, orders, run):
        self.site, self.orders, self.run = site, orders, run
        self.steps = collections.Counter()
        self.turns = collections.Counter()
        self.last_modified = {}
        self.transactions = collections.defaultdict(list)
        # The workflow log entry's time of each save -> the save's `modified`: a change
        # found in the log (reconciliation, or a webhook reading its predecessors) is
        # the same change as its webhook.
        self.saved_at = {}

    def make(self, number):
        """Each sender goes round the orders in turn: a document changes every
        orders / (its share of the rate) seconds, later than its last change's log
        entry (40 ms after its save) at any rate this bench is run at."""
        sender = SENDERS[number % len(SENDERS)]
        order = ORDER_NUMBER.format(self.turns[sender] % self.orders)
        self.turns[sender] += 1
        return (sender, *getattr(self, sender)(order))

    def workflow(self, order):
        path, state = CYCLE[self.steps[order] % len(CYCLE)]
        self.steps[order] += 1
        name = f"ORD-{order}"
        now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
        before = self.last_modified.get(name)
        modified = now if before is None or now > before else \
            before + datetime.timedelta(microseconds=1)
        self.last_modified[name] = modified
        self.site.add(DOCTYPE, name, state, modified, order_number=order, state_code="WY",
                      entity_name=f"Acme {order} LLC")
        logged_at = modified + datetime.timedelta(milliseconds=40)
        self.saved_at[(name, canonical_modified(frappe_text(logged_at)))] = \
            canonical_modified(frappe_text(modified))
        body = {"order_name": name, "order_number": order, "modified": frappe_text(modified),
                "state_code": "WY", "entity_name": f"Acme {order} LLC"}
        return (f"/api/v1/webhooks/{path}", json.dumps(body).encode(),
                {"X-Webhook-Secret": WEBHOOK_SECRET, "Content-Type": "application/json"},
                ("workflow", path, name, canonical_modified(body["modified"])))

    def card(self, order):
        intent = stripe_events.payment_intent(
            order, "formation", status="requires_payment_method",
            last_payment_error=stripe_events.card_declined())
        evt = stripe_events.event("payment_intent.payment_failed", intent,
                                  created=int(time.time()))
        raw = stripe_events.raw_of(evt)
        return (stripe_events.CARD_URL, raw,
                {"Stripe-Signature": stripe_events.sign(raw, timestamp=int(time.time())),
                 "Content-Type": "application/json"}, ("card", evt["id"]))

    def crypto(self, order):
        listed = self.transactions[order]
        txid = f"tx-{self.run}-{order}-{len(listed) + 1}"
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        listed[:] = [{**tx, "trigger": False} for tx in listed]
        listed.append(shkeeper.transaction(txid, "0.0001", "9.6", trigger=True, date=when))
        count = len(listed)
        callback = shkeeper.invoice(order, "PAID", list(listed), f"{count * 0.0001:.4f}",
                                    f"{count * 9.6:.1f}")
        return (shkeeper.URL, shkeeper.encode(callback), shkeeper.key_headers(),
                ("crypto", txid))

    def stored_identity(self, event):
        """The identity `make` gave the call `event` was stored for; a change found in
        the workflow log is its webhook's (the save its log entry follows)."""
        payload = json.loads(event.payload)
        if event.source == "card":
            return ("card", event.external_id)
        if event.source == "crypto":
            [txid] = [tx["txid"] for tx in payload["transactions"] if tx.get("trigger")]
            return ("crypto", txid)
        name = payload["order_name"]
        modified = canonical_modified(payload.get("modified")) or self.saved_at.get(
            (name, canonical_modified(payload.get("entered_at"))))
        # A change no save of this load's made (none should be): its log entry alone.
        return ("workflow", event.event_type, name,
                modified or f"entry {payload.get('workflow_entry')}")


class Sample(NamedTuple):
    at: float  # Unix time
    held: int  # waiting behind an earlier unfinished event of their stream
    unfinished: int  # received or failed
    spooled: int  # calls in the instances' spools
    finished: int  # events handled to their end so far
    due_heads: int  # streams (and events of no stream) whose first unfinished is due
    oldest_due: float | None  # since when the longest-due of those has been due


class Sampler:
    """Every second, in a thread of its own (on its own connection), a `Sample`."""

    def __init__(self, spools):
        self.spools = spools
        self.samples: list[Sample] = []
        self.failure: Exception | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()

    def _sample(self):
        try:
            while not self.stopped.is_set():
                at = time.time()
                unfinished = WebhookEvent.select().where(
                    WebhookEvent.status.in_(AWAITING_HANDLING)).count()
                finished = WebhookEvent.select().where(
                    WebhookEvent.status.in_(FINAL_STATUSES)).count()
                held, _ = held_count()
                due = [head.next_attempt_at for head in heads()
                       if head.next_attempt_at is not None and unix(head.next_attempt_at) <= at]
                self.samples.append(Sample(at, held, unfinished, spooled_lines(self.spools),
                                           finished, len(due),
                                           min(map(unix, due)) if due else None))
                self.stopped.wait(max(0.0, at + 1 - time.time()))
        except Exception as failure:
            self.failure = failure
            raise
        finally:
            database.close()

    def check(self):
        """Raise what stopped the sampling, if it stopped: a run without its samples
        has no figures."""
        if self.failure is not None:
            raise RuntimeError("the sampler stopped") from self.failure

    def at(self, moment):
        """The first sample taken at `moment` or after (the last one if none)."""
        return next((sample for sample in self.samples if sample.at >= moment),
                    self.samples[-1])

    def empty_since(self, moment):
        """When the first sample after `moment` found nothing unfinished or spooled."""
        return next((sample.at for sample in self.samples if sample.at >= moment
                     and sample.unfinished == 0 and sample.spooled == 0), None)

    def stalled_since(self, seconds):
        """When nothing was finished any more although a head was due, if that has lasted
        `seconds` by the last sample: the inbox retry (or whatever hands events over)
        does not take what is there to take. None otherwise."""
        if not self.samples:
            return None
        last = self.samples[-1]
        if not last.due_heads:
            return None
        since = last.at
        for sample in reversed(self.samples):
            if sample.finished != last.finished or not sample.due_heads:
                break
            since = sample.at
        return since if last.at - since >= seconds else None


class StandIns:
    """The worker, Frappe, Telegram and SMTP, on this process's loop (SMTP in a thread
    of its own): the worker keeps its requests in the order they arrived."""

    def __init__(self):
        self.worker = HttpPeer("worker", body={"ok": True, "job_id": "job-1"})
        self.telegram = HttpPeer("telegram", body={"ok": True, "result": {"message_id": 1}})
        self.site = FrappeSite(FIELDS)
        self.site.time_zone = "UTC"
        self.smtp = SmtpPeer()

    def env(self):
        return {"WORKER_URL": self.worker.url, "WORKFLOW_URL": self.site.url,
                "WORKFLOW_API_KEY": API_KEY, "WORKFLOW_API_SECRET": API_SECRET,
                "WORKFLOW_SITE_NAME": "bench", "TELEGRAM_API_URL": self.telegram.url,
                "TELEGRAM_BOT_TOKEN": "1:bench", "TELEGRAM_CHAT_ID": "1",
                "SMTP_URL": self.smtp.url, "ADMIN_EMAIL": "admin@bench.test",
                "STRIPE_SECRET_KEY": stripe_events.SECRET_KEY,
                "STRIPE_WEBHOOK_SECRET": stripe_events.SECRET,
                "CRYPTO_PROCESSOR_API_KEY": shkeeper.API_KEY}

    def stop(self):
        for peer in (self.worker, self.telegram, self.site):
            peer.stop()
        self.smtp.stop()


class Cut:
    """The proxy's fault: `cut` resets every connection and refuses new ones, `freeze`
    drops every byte; `end` lifts it."""

    def __init__(self, proxy, mode):
        self.proxy, self.mode = proxy, mode

    def begin(self):
        (self.proxy.cut if self.mode == "cut" else self.proxy.freeze)()

    def end(self):
        (self.proxy.restore if self.mode == "cut" else self.proxy.thaw)()


async def send(session, instance, path, raw, headers, call):
    try:
        async with session.post(f"{instance.url}{path}", data=raw, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_SECONDS)
                                ) as answer:
            await answer.read()
            call.status = answer.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        call.status = None  # no answer: not acknowledged, as a sender would see it
    call.answered_at = time.time()


async def drive(args, instances, calls, cut):
    """The load, open loop at args.rate a second, and the cut; (calls, load start, cut
    start, cut end, load end), times as Unix times."""
    rng = random.Random(args.seed)
    sent, tasks = [], []
    total = int(args.rate * args.duration)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.time()
        times = {}

        async def cutter():
            await asyncio.sleep(max(0.0, started + args.cut_from - time.time()))
            times["cut_from"] = time.time()
            cut.begin()
            await asyncio.sleep(max(0.0, started + args.cut_to - time.time()))
            cut.end()
            times["cut_to"] = time.time()
        cutting = asyncio.create_task(cutter())
        for number in range(total):
            # Late (a busy loop) it catches up at once: the calls keep their count.
            due = started + number / args.rate
            await asyncio.sleep(max(0.0, due - time.time()))
            sender, path, raw, headers, identity = calls.make(number)
            which = rng.randrange(len(instances))
            call = Call(sender, which, identity, due, time.time())
            sent.append(call)
            tasks.append(asyncio.create_task(
                send(session, instances[which], path, raw, headers, call)))
        load_end = time.time()
        await cutting
        await asyncio.gather(*tasks)
    return sent, started, times["cut_from"], times["cut_to"], load_end


def stored_events():
    return list(WebhookEvent.select(
        WebhookEvent.id, WebhookEvent.source, WebhookEvent.event_type,
        WebhookEvent.external_id, WebhookEvent.payload, WebhookEvent.status,
        WebhookEvent.stream, WebhookEvent.version, WebhookEvent.received_at,
        WebhookEvent.processed_at, WebhookEvent.last_error))


def unix(moment):
    return None if moment is None else moment.timestamp()


def handled_between(events, start, end):
    return sum(1 for event in events if event.status in FINAL_STATUSES
               and event.processed_at is not None
               and start <= unix(event.processed_at) <= end)


def jobs_out_of_order(worker):
    """(jobs that reached the worker after a job of a later event of their stream, the
    streams with one, jobs that reached it more than once, a few of the late ones): each
    key's first arrival, against its event's place in its stream (version, arrival, id)."""
    arrivals, seen = [], collections.Counter()
    for request in worker.posts:
        key = request.headers.get("Idempotency-Key")
        seen[key] += 1
        if seen[key] == 1:
            arrivals.append(key)
    jobs = {row.idempotency_key: row.event_id for row in Outbox.select(
        Outbox.idempotency_key, Outbox.event).where(Outbox.kind == "job")}
    events = {event.id: event for event in WebhookEvent.select(
        WebhookEvent.id, WebhookEvent.stream, WebhookEvent.version, WebhookEvent.received_at,
        WebhookEvent.event_type, WebhookEvent.reconciled).where(WebhookEvent.id.in_(
            [event_id for event_id in jobs.values() if event_id is not None]))}
    latest, late, streams = {}, [], set()
    for key in arrivals:
        event = events.get(jobs.get(key))
        if event is None or event.stream is None:
            continue
        place = (event.version or "", event.received_at, event.id)
        if event.stream in latest and place < latest[event.stream][0]:
            late.append({"stream": event.stream, "late": described(event),
                         "after": described(latest[event.stream][1])})
            streams.add(event.stream)
        else:
            latest[event.stream] = (place, event)
    return len(late), len(streams), sum(1 for count in seen.values() if count > 1), late[:5]


def described(event):
    """An event as a late job's example names it: what it was, and when it was stored."""
    return {"event": event.id, "type": event.event_type, "version": event.version,
            "stored_at": event.received_at.isoformat(), "found_in_the_log": event.reconciled}


def jobs_unsent():
    return Outbox.select().where(Outbox.kind == "job",
                                 Outbox.status.not_in(["sent", "dead"])).count()


def heads():
    """The first unfinished event of each stream that has one, and each unfinished event
    of no stream (a Stripe fact), in their stream's order: what a backlog waits on."""
    unfinished = WebhookEvent.select().where(WebhookEvent.status.in_(AWAITING_HANDLING))
    first = (unfinished.where(WebhookEvent.stream.is_null(False))
             .order_by(WebhookEvent.source, WebhookEvent.stream, WebhookEvent.version,
                       WebhookEvent.received_at, WebhookEvent.id)
             .distinct(WebhookEvent.source, WebhookEvent.stream))
    return [*first, *unfinished.where(WebhookEvent.stream.is_null())]


def stream_heads(limit=10):
    """How many heads wait (`heads`), and the `limit` longest due of them."""
    now = datetime.datetime.now(datetime.timezone.utc)
    waiting = sorted(heads(), key=lambda head: head.next_attempt_at or head.received_at)
    return len(waiting), [
        {"event": head.id, "source": head.source, "stream": head.stream,
         "status": head.status, "attempts": head.attempts,
         "received_at": head.received_at.isoformat(),
         "next_attempt_at": head.next_attempt_at and head.next_attempt_at.isoformat(),
         "due_for_s": round((now - head.next_attempt_at).total_seconds(), 1)
         if head.next_attempt_at is not None and head.next_attempt_at <= now else None,
         "last_error": head.last_error} for head in waiting[:limit]]


def job_runs(instance, job="inbox"):
    """{result: runs} of `job` in the instance, from its /metrics; None unanswered."""
    pattern = re.compile(rf'^receiver_job_runs_total{{job="{job}",result="(\w+)"}} (\S+)$',
                         re.MULTILINE)
    try:
        with urllib.request.urlopen(f"{instance.url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except OSError as failure:
        return {"unanswered": str(failure)}
    return {result: int(float(value)) for result, value in pattern.findall(text)}


def last_handled(instance):
    """When the instance last logged an event handled to its end, and how many it did."""
    lines = HANDLED_LINE.findall(instance.log())
    return (lines[-1][0] if lines else None), len(lines)


def capture(folder, instances, database_name):
    """py-spy dumps of both instances, the server's advisory locks and the sessions on
    the database, each instance's /metrics and its log, into `folder`; what was kept."""
    os.makedirs(folder, exist_ok=True)
    py_spy = shutil.which("py-spy", path=os.path.dirname(PYTHON)) or "py-spy"
    kept = {}
    for name, instance in zip("ab", instances):
        for extra in ((), ("--native",)):
            dump = subprocess.run([py_spy, "dump", "--pid", str(instance.process.pid),
                                   *extra], capture_output=True, text=True, timeout=60)
            if dump.returncode == 0:
                break
        path = os.path.join(folder, f"py-spy-{name}.txt")
        with open(path, "w") as out:
            out.write(dump.stdout + dump.stderr)
        shutil.copy(instance.log_path, os.path.join(folder, f"service-{name}.log"))
        try:
            with urllib.request.urlopen(f"{instance.url}/metrics", timeout=10) as answer:
                metrics = answer.read().decode()
        except OSError as failure:
            metrics = f"unanswered: {failure}"
        with open(os.path.join(folder, f"metrics-{name}.txt"), "w") as out:
            out.write(metrics)
        kept[name] = {"py_spy": path, "py_spy_ok": dump.returncode == 0}
    locks = database.execute_sql(
        "SELECT l.objid, l.granted, l.pid, a.application_name, a.state, a.xact_start, "
        "a.state_change FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' ORDER BY l.objid").fetchall()
    sessions = database.execute_sql(
        "SELECT pid, application_name, state, backend_start, xact_start, query_start, "
        "state_change, wait_event_type, wait_event, left(query, 300) FROM "
        "pg_stat_activity WHERE datname = %s ORDER BY application_name, pid",
        (database_name,)).fetchall()
    server = {"advisory_locks": [
        {"job": LOCK_NAMES.get(objid, objid), "granted": granted, "pid": pid,
         "application_name": application, "state": state, "xact_start": str(xact_start),
         "state_change": str(changed)}
        for objid, granted, pid, application, state, xact_start, changed in locks],
        "sessions": [dict(zip(("pid", "application_name", "state", "backend_start",
                               "xact_start", "query_start", "state_change",
                               "wait_event_type", "wait_event", "query"),
                              map(str, row))) for row in sessions]}
    with open(os.path.join(folder, "server.json"), "w") as out:
        json.dump(server, out, indent=2)
    kept["server"] = server
    return kept


async def in_thread(function, *args):
    """`function(*args)` in a thread: a query must not hold the loop the stand-ins
    answer on."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def measure(args, run, results):
    """One run; its figures (and, when it stalled, what was captured in `results`)."""
    with postgres_scratch() as url:
        if url is None:
            raise SystemExit("PostgreSQL is not reachable at BENCH_POSTGRES_URL")
        await in_thread(seed_orders, url, HotOrders, args.orders)
        open_database(url)
        stand_ins = StandIns()
        proxy, proxied = TcpProxy.in_front_of(url)
        folder = tempfile.mkdtemp(prefix="drain-")
        spools = [os.path.join(folder, f"spool-{name}") for name in "ab"]
        instances = [ServiceProcess(
            os.path.join(folder, f"{name}.log"), **stand_ins.env(),
            DATABASE_URL=f"{proxied}?application_name=receiver-{name}", SPOOL_DIR=spool,
            SCHEDULER_TICK_SECONDS=args.tick, CLAIM_LEASE_SECONDS=args.lease,
            # The service's own defaults, where the suite's subprocesses set others; a
            # send's timeout within a shorter lease, as the service requires.
            DATABASE_TIMEOUT_MS=1000, OUTBOUND_TIMEOUT_SECONDS=min(10, max(1, args.lease - 1)))
            for name, spool in zip("ab", spools)]
        sampler = Sampler(spools)
        calls = Calls(stand_ins.site, args.orders, run)
        try:
            await asyncio.gather(*(instance.start() for instance in instances))
            sampler.start()
            sent, started, cut_from, cut_to, load_end = await drive(
                args, instances, calls, Cut(proxy, args.cut_mode))
            deadline = load_end + args.window
            stall = None
            while time.time() < deadline and sampler.empty_since(load_end) is None:
                sampler.check()
                since = sampler.stalled_since(stall_seconds(args))
                if since is not None and stall is None:
                    # Captured while it lasts: what holds it is there to be seen now.
                    stall = await stall_of(instances, results, run, url, since, started)
                    print(f"run {run}: STALL since {since - started:.0f} s into the load: "
                          f"{stall_line(stall)}", flush=True)
                await asyncio.sleep(1)
            sampler.check()
            empty_at = sampler.empty_since(load_end)
            if empty_at is not None:
                jobs_by = time.time() + JOBS_WAIT_SECONDS
                while await in_thread(jobs_unsent) and time.time() < jobs_by:
                    await asyncio.sleep(1)
            window_end = min(time.time(), deadline) if empty_at is None else empty_at
            figures = await in_thread(
                figures_of, calls, sent, sampler, stand_ins.worker,
                (started, cut_from, cut_to, load_end, empty_at, window_end))
            figures["stall"] = stall
            if empty_at is None:
                figures["not_empty"] = await in_thread(stream_heads)
            figures["refused_statements"] = refusals(instances)
        finally:
            sampler.stop()
            for instance in instances:
                if instance.process is not None and instance.process.poll() is None:
                    await instance.terminate()
            proxy.close()
            stand_ins.stop()
            database.close()
            shutil.rmtree(folder, ignore_errors=True)
    return figures


def refusals(instances):
    """The statements an instance ran outside the door (tests/checked_service.py): a
    run with any measured a service the suite would fail."""
    found = []
    for instance in instances:
        path = instance.log_path + ".refused"
        if os.path.exists(path):
            with open(path) as refused:
                found.append(refused.read()[:2000])
    return found


def stall_seconds(args):
    """How long nothing may be finished while a head is due before it is a stall: three
    ticks of the inbox retry, and never under 30 s (a handling waits on its sends, a
    send at most OUTBOUND_TIMEOUT_SECONDS)."""
    return max(30, 3 * args.tick)


async def stall_of(instances, results, run, url, since, started):
    """What a stall waits on, and the captures (`capture`) kept in `results`."""
    waiting, longest = await in_thread(stream_heads)
    kept = await in_thread(capture, os.path.join(results, f"run-{run}-stall"), instances,
                           urllib.parse.urlsplit(url).path.lstrip("/"))
    return {"since_s": round(since - started, 1),
            "detected_s": round(time.time() - started, 1),
            "heads_waiting": waiting, "longest_due": longest,
            "inbox_runs": {name: job_runs(instance) for name, instance in
                           zip("ab", instances)},
            "last_handled": {name: last_handled(instance) for name, instance in
                             zip("ab", instances)},
            "captured": kept}


def stall_line(stall):
    return (f"{stall['heads_waiting']} head(s) wait, the longest due "
            f"{json.dumps(stall['longest_due'][:2])}; inbox job runs {stall['inbox_runs']}; "
            f"last handled {stall['last_handled']}; captured in "
            f"{os.path.dirname(stall['captured']['a']['py_spy'])}")


def figures_of(calls, sent, sampler, worker, times):
    started, cut_from, cut_to, load_end, empty_at, window_end = times
    events = stored_events()
    stored = collections.Counter()
    handled_at = {}
    for event in events:
        identity = calls.stored_identity(event)
        stored[identity] += 1
        if event.status in FINAL_STATUSES and event.processed_at is not None:
            handled_at.setdefault(identity, unix(event.processed_at))
    acknowledged = [call for call in sent if call.status in ACKNOWLEDGED]
    answered_from_cut = [call for call in acknowledged if call.answered_at >= cut_from]
    prompt = sum(1 for call in answered_from_cut
                 if call.identity in handled_at
                 and handled_at[call.identity] - call.answered_at <= PROMPT_SECONDS)
    late, late_streams, twice, late_examples = jobs_out_of_order(worker)
    at_load_end, left = sampler.at(load_end), sampler.samples[-1]
    drained = handled_between(events, load_end, window_end)
    return {
        "calls": len(sent), "answers": dict(collections.Counter(
            str(call.status) for call in sent)),
        "acknowledged": len(acknowledged),
        "acknowledged_by_sender": dict(collections.Counter(
            call.sender for call in acknowledged)),
        "acknowledged_by_instance": dict(collections.Counter(
            "ab"[call.instance] for call in acknowledged)),
        # How far behind its rate the load fell (this process shares the cores).
        "sent_late_by_s_at_most": round(max(call.sent_at - call.due_at for call in sent), 2),
        "lost": sum(1 for call in acknowledged if not stored[call.identity]),
        "stored_twice": sum(1 for count in stored.values() if count > 1),
        "stored_twice_examples": [list(identity) for identity, count in stored.items()
                                  if count > 1][:5],
        "started_at": datetime.datetime.fromtimestamp(
            started, datetime.timezone.utc).isoformat(),
        "seconds": {"load": round(load_end - started, 1),
                    "cut_from": round(cut_from - started, 1),
                    "cut_to": round(cut_to - started, 1)},
        "held_at_cut_end": sampler.at(cut_to).held, "held_at_load_end": at_load_end.held,
        "unfinished_at_load_end": at_load_end.unfinished,
        "handled_per_s_cut_end_to_load_end": round(
            handled_between(events, cut_to, load_end) / max(0.1, load_end - cut_to), 1),
        "empty_after_cut_end_s": None if empty_at is None else round(empty_at - cut_to, 1),
        # None when nothing was left to drain at the load's end.
        "drain_per_s_after_load": round(drained / (window_end - load_end), 1)
        if window_end - load_end >= 1 else None,
        "handled_within_2s_from_the_cut": round(prompt / max(1, len(answered_from_cut)), 3),
        "history": sum(1 for event in events if event.status == "ignored"
                       and (event.last_error or "").startswith(("older than", "an older"))),
        "jobs_out_of_order": late, "streams_with_jobs_out_of_order": late_streams,
        "jobs_out_of_order_examples": late_examples,
        "jobs_sent_twice": twice, "jobs_unsent": jobs_unsent(),
        "left_at_the_end": {"held": left.held, "unfinished": left.unfinished,
                            "spooled": left.spooled},
        "longest_a_head_was_due_s": round(max(
            (sample.at - sample.oldest_due for sample in sampler.samples
             if sample.oldest_due is not None), default=0), 1),
        # (seconds into the load, held, unfinished, spooled, finished, heads due).
        "samples": [(round(sample.at - started, 1), *sample[1:6])
                    for sample in sampler.samples],
    }


def summary(run, figures, window):
    empty = figures["empty_after_cut_end_s"]
    line = (f"run {run}: {figures['acknowledged']}/{figures['calls']} acknowledged, "
            f"lost {figures['lost']}, stored twice {figures['stored_twice']}; held "
            f"{figures['held_at_cut_end']} at the cut's end, {figures['held_at_load_end']} "
            f"at the load's end; {figures['handled_per_s_cut_end_to_load_end']} handled/s "
            f"after the cut; backlog "
            + (f"empty {empty} s after the cut's end" if empty is not None
               else f"NOT empty within {window:g} s of the load's end")
            + f"; drain {figures['drain_per_s_after_load']} events/s; a head due for "
            f"{figures['longest_a_head_was_due_s']} s at most; "
            f"{figures['handled_within_2s_from_the_cut']:.1%} handled within 2 s from the "
            f"cut; jobs out of order {figures['jobs_out_of_order']}, twice "
            f"{figures['jobs_sent_twice']}, unsent {figures['jobs_unsent']}")
    if figures["stall"]:
        line += f"\nSTALL: {stall_line(figures['stall'])}"
    if "not_empty" in figures:
        waiting, longest = figures["not_empty"]
        line += (f"\nNOT EMPTY: {figures['left_at_the_end']} left; {waiting} head(s) "
                 f"wait, the longest due {json.dumps(longest[:3])}")
    return line


def commit():
    """The checkout's commit, marked when its tracked files differ from it (the figures
    are then of something no commit holds)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return f"{head} with changes" if changed else head


def parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tick", type=int, default=10, help="SCHEDULER_TICK_SECONDS")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--cut-mode", choices=("cut", "freeze"), default="cut")
    parser.add_argument("--rate", type=float, default=150, help="calls a second")
    parser.add_argument("--duration", type=float, default=60, help="seconds of load")
    parser.add_argument("--cut-from", type=float, default=26.2)
    parser.add_argument("--cut-to", type=float, default=33.8)
    parser.add_argument("--orders", type=int, default=24, help="hot orders")
    parser.add_argument("--window", type=float, default=300,
                        help="seconds after the load for the backlog to empty")
    parser.add_argument("--lease", type=int, default=60, help="CLAIM_LEASE_SECONDS")
    parser.add_argument("--seed", type=int, default=1, help="of the instances' choice")
    parser.add_argument("--results", default=RESULTS)
    return parser


def run_all(args):
    """Every run of `args`; the report written, and returned."""
    when = datetime.datetime.now(datetime.timezone.utc)
    stamp = when.strftime("%Y-%m-%dT%H-%M-%SZ")
    captures = os.path.join(args.results, f"drain-{stamp}")
    report = {"when": when.isoformat(timespec="seconds"), "commit": commit(),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average": os.getloadavg()},
              "settings": {key: value for key, value in vars(args).items()
                           if key != "results"},
              "runs": []}
    os.makedirs(args.results, exist_ok=True)
    path = report["path"] = os.path.join(args.results, f"drain-{stamp}.json")
    for run in range(1, args.runs + 1):
        figures = asyncio.run(measure(args, run, captures))
        report["runs"].append(figures)
        print(summary(run, figures, args.window), flush=True)
        with open(path, "w") as out:
            json.dump(report, out, indent=2, default=str)
    report["stalled"] = sum(1 for figures in report["runs"] if figures["stall"])
    report["not_empty"] = sum(1 for figures in report["runs"] if "not_empty" in figures)
    with open(path, "w") as out:
        json.dump(report, out, indent=2, default=str)
    print(f"results: {path}")
    return report


def main(argv=None):
    report = run_all(parser().parse_args(argv))
    return 1 if report["stalled"] or report["not_empty"] else 0


if __name__ == "__main__":
    sys.exit(main())
