"""Attacks on the service, measured on loopback, bounded in count and time: the
service's memory while 500 unauthenticated connections each send a 1 MiB body (minus one
byte) to each family of routes, a webhook's latency while 20 clients scrape /metrics as
fast as they can, and while 20 clients try wrong console passwords (each claiming another
address in X-Real-IP) as fast as they are answered.

    .venv/bin/python -m bench.hostile [--root DIR]

`--root` is the checkout whose `receiver.py serve` is measured (default: this one), so
that the same script measures a version before a change and after it. Prints JSON.
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import aiohttp

from bench.run import cpu_seconds, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "bench-webhook-secret"
BODY_SIZE = 1024 * 1024 - 1
ATTACKERS = 500
SCRAPERS = 20
SENDERS = 4
PHASE_SECONDS = 8
GUESSERS = 20
# One route of each family, and the headers an unauthenticated caller sends to it.
ROUTE_FAMILIES = (
    ("workflow", "/api/v1/webhooks/formation/submitted", "X-Webhook-Secret: wrong\r\n"),
    ("card", "/api/v1/webhooks/card-processor", "Stripe-Signature: t=1,v1=00\r\n"),
    ("crypto", "/api/v1/webhooks/crypto-processor", "X-Shkeeper-Api-Key: wrong\r\n"),
    ("public", "/api/v1/survey", ""),
    ("probe", "/healthz", ""),
    ("metrics", "/metrics", ""),
    ("link_page", "/api/v1/ifta/filed", ""),
    ("openapi", "/api/v1/openapi.yaml", ""),
    ("console_login", "/console/login",
     "Content-Type: application/x-www-form-urlencoded\r\n"),
    ("console_page", "/console/events/1", ""),
)


def console_password_hash(root):
    """Made by the measured checkout, at its production cost."""
    return subprocess.run(
        [sys.executable, "-c", "from ops.passwords import hash_password; "
         "print(hash_password('bench-password'))"],
        cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def start_service(root, folder):
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RECEIVER_PORT": str(port),
           "DATABASE_URL": f"sqlite:///{folder}/bench.sqlite3", "SPOOL_DIR": f"{folder}/spool",
           "WEBHOOK_SECRET": SECRET, "LINK_SECRET": "bench-link-secret",
           "STRIPE_SECRET_KEY": "sk_test_bench", "STRIPE_WEBHOOK_SECRET": "whsec_bench",
           "CRYPTO_PROCESSOR_API_KEY": "bench-crypto-key",
           "CONSOLE_PASSWORD_HASH": console_password_hash(root),
           "COOKIE_SECRET": "bench-cookie-secret-0123456789abcdef0123456789"}
    log = open(f"{folder}/service.log", "wb")
    process = subprocess.Popen([sys.executable, "receiver.py", "serve"], cwd=root, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, port
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError("service did not start")


async def unauthenticated_upload(port, head):
    """One attacker: headers, then the body in 64 KiB pieces, then read what comes."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return "refused"
    try:
        writer.write(head)
        sent = 0
        while sent < BODY_SIZE:
            piece = min(65536, BODY_SIZE - sent)
            writer.write(b"x" * piece)
            await writer.drain()
            sent += piece
        answer = await asyncio.wait_for(reader.read(64), 30)
        return answer.split(b" ", 2)[1].decode() if answer else "closed"
    except (OSError, asyncio.TimeoutError, IndexError):
        return "closed"
    finally:
        writer.close()


async def memory_attack(pid, port, path, headers):
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}"
            f"Content-Length: {BODY_SIZE}\r\n\r\n").encode()
    before = rss_mb(pid)
    peak = [before]

    async def watch():
        while True:
            peak[0] = max(peak[0], rss_mb(pid))
            await asyncio.sleep(0.05)
    watcher = asyncio.ensure_future(watch())
    started = time.monotonic()
    answers = await asyncio.gather(*(unauthenticated_upload(port, head)
                                     for _ in range(ATTACKERS)))
    seconds = time.monotonic() - started
    await asyncio.sleep(2)
    watcher.cancel()
    counts = {}
    for answer in answers:
        counts[answer] = counts.get(answer, 0) + 1
    return {"path": path, "rss_mb_before": round(before, 1), "rss_mb_peak": round(peak[0], 1),
            "rss_mb_after": round(rss_mb(pid), 1), "seconds": round(seconds, 1),
            "answers": counts}


async def webhook_latencies(session, port, seconds):
    url = f"http://127.0.0.1:{port}/api/v1/webhooks/crtc/domain-ready"
    latencies = []
    deadline = time.monotonic() + seconds

    async def sender():
        while time.monotonic() < deadline:
            body = {"order_name": "ORD-1", "order_number": f"CA-{uuid.uuid4().hex[:10]}"}
            started = time.perf_counter()
            async with session.post(url, json=body, headers={"X-Webhook-Secret": SECRET}) as r:
                await r.read()
                assert r.status == 200, r.status
            latencies.append(1000 * (time.perf_counter() - started))
    await asyncio.gather(*(sender() for _ in range(SENDERS)))
    return latencies


def scrape_flood(port, seconds, counted):
    """SCRAPERS clients scraping /metrics back to back for `seconds`, in a process of
    their own (so their own work does not slow the webhook sender being timed)."""
    async def flood():
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            async def scraper():
                while time.monotonic() < deadline:
                    async with session.get(url) as response:
                        await response.read()
                    counted.value += 1
            await asyncio.gather(*(scraper() for _ in range(SCRAPERS)))
    asyncio.run(flood())


# Run in the measured checkout: what one scrape costs the event loop, with a backlog of
# 20,000 events and effects in the database.
SCRAPE_COST = """
import asyncio, sys, time, datetime
import migrations
from models import WebhookEvent, Outbox, database
from engine.connection import open_database
from app.context import Context
from settings import Settings
db = open_database(f"sqlite:///{sys.argv[1]}/cost.sqlite3")
migrations.migrate(db)
now = datetime.datetime.now(datetime.timezone.utc)
with database.atomic():
    for n in range(0, 20000, 500):
        WebhookEvent.insert_many([dict(source="workflow", event_type="formation/ready",
            dedup_key=f"k{n + i}", payload="{}", status=("failed", "processed")[i % 2],
            received_at=now, updated_at=now) for i in range(500)]).execute()
        Outbox.insert_many([dict(kind="job", idempotency_key=f"i{n + i}", payload="{}",
            status=("pending", "sent")[i % 2], created_at=now, updated_at=now,
            next_attempt_at=now) for i in range(500)]).execute()
async def main():
    ctx = Context.create(Settings(spool_dir=sys.argv[1] + "/spool"))
    started = time.perf_counter()
    for _ in range(200):
        await ctx.metrics.exposition(ctx)
    print(1000 * (time.perf_counter() - started) / 200)
asyncio.run(main())
"""


def scrape_cost_ms(root, folder):
    out = subprocess.run([sys.executable, "-c", SCRAPE_COST, folder], cwd=root,
                         capture_output=True, text=True, check=True, timeout=300).stdout
    return round(float(out.strip()), 2)


def summary(latencies):
    ordered = sorted(latencies)
    return {"requests": len(ordered), "p50_ms": round(statistics.median(ordered), 1),
            "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 1)}


async def scrape_attack(pid, port):
    async with aiohttp.ClientSession() as session:
        quiet = summary(await webhook_latencies(session, port, PHASE_SECONDS))
        counted = multiprocessing.Value("i", 0)
        scrapers = multiprocessing.Process(target=scrape_flood,
                                           args=(port, PHASE_SECONDS + 1, counted))
        scrapers.start()
        await asyncio.sleep(0.5)
        cpu = cpu_seconds(pid)
        flooded = summary(await webhook_latencies(session, port, PHASE_SECONDS))
        flooded["service_cpu_share"] = round((cpu_seconds(pid) - cpu) / PHASE_SECONDS, 2)
        scrapers.join()
        flooded["scrapes_per_second"] = round(counted.value / (PHASE_SECONDS + 1))
    return {"quiet": quiet, "scrape_flood": flooded}


def login_flood(port, seconds, counted):
    """GUESSERS clients posting wrong console passwords back to back for `seconds`, each
    try claiming a new address in X-Real-IP, in a process of their own."""
    async def flood():
        base = f"http://127.0.0.1:{port}/console/login"
        deadline = time.monotonic() + seconds
        # The console's cookies come from 127.0.0.1: a jar that keeps cookies of an
        # address, not only of a name.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            async with session.get(base) as page:
                token = re.search(r'name="_xsrf" value="([^"]+)"', await page.text()).group(1)

            async def guesser(n):
                tries = 0
                while time.monotonic() < deadline:
                    tries += 1
                    form = {"name": "x", "password": f"guess-{n}-{tries}", "_xsrf": token}
                    headers = {"X-Real-IP": f"10.{n}.{tries // 250 % 250}.{tries % 250}"}
                    async with session.post(base, data=form, headers=headers,
                                            allow_redirects=False) as response:
                        await response.read()
                        counted[str(response.status)] = counted.get(str(response.status), 0) + 1
            await asyncio.gather(*(guesser(n) for n in range(GUESSERS)))
    asyncio.run(flood())


async def login_attack(pid, port):
    async with aiohttp.ClientSession() as session:
        quiet = summary(await webhook_latencies(session, port, PHASE_SECONDS))
        with multiprocessing.Manager() as manager:
            counted = manager.dict()
            guessers = multiprocessing.Process(target=login_flood,
                                               args=(port, PHASE_SECONDS + 1, counted))
            guessers.start()
            await asyncio.sleep(0.5)
            cpu = cpu_seconds(pid)
            flooded = summary(await webhook_latencies(session, port, PHASE_SECONDS))
            flooded["service_cpu_share"] = round((cpu_seconds(pid) - cpu) / PHASE_SECONDS, 2)
            guessers.join()
            flooded["login_answers"] = dict(counted)
    return {"quiet": quiet, "login_flood": flooded}


async def main(root):
    with tempfile.TemporaryDirectory() as folder:
        process, port = await start_service(root, folder)
        try:
            results = {"root": root, "scrape_cost_ms": scrape_cost_ms(root, folder)}
            results["scrape"] = await scrape_attack(process.pid, port)
            results["login"] = await login_attack(process.pid, port)
            for family, path, headers in ROUTE_FAMILIES:
                results[f"memory_{family}"] = await memory_attack(process.pid, port, path,
                                                                  headers)
            with open(f"{folder}/service.log", "rb") as log:
                results["log_lines"] = log.read().count(b"\n")
        finally:
            process.terminate()
            process.wait(30)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=ROOT)
    asyncio.run(main(os.path.abspath(parser.parse_args().root)))
