"""`receiver.py demo`: the service with sample orders and local stand-ins for the worker,
Frappe, Telegram and SMTP, and the commands to try printed once it listens.

Orders are written by other systems, so a fresh install has none a webhook could act on.
The demo keeps a database and a spool of its own (in --folder, var/demo by default, made
afresh at every start) and uses nothing of the environment but where to listen: whatever
DATABASE_URL names is never opened. A second demo on the same folder or port stops before
it touches the first one's database."""
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import sys
from typing import IO, Mapping, TextIO

import migrations
from app.logs import configure_logging
from app.server import CannotStart, bind, serve
from app.standins import StandIns
from domain.links import signed_link
from models import ComplianceOrder, CrtcOrder, FormationOrder, BundleOrder, database
from engine.connection import open_database
from ops.passwords import hash_password
from settings import Settings

DATABASE_FILES = ("receiver.sqlite3", "receiver.sqlite3-wal", "receiver.sqlite3-shm")
LOCK_FILE = "demo.lock"
WEBHOOK_SECRET = "demo-webhook-secret"
CRYPTO_API_KEY = "demo-shkeeper-api-key"
ORDERS_API_KEY = "demo-orders-api-key"
CONSOLE_PASSWORD = "demo-console-password"
# Only the address is taken from the environment; everything else is the demo's own.
FROM_ENVIRONMENT = ("RECEIVER_HOST", "RECEIVER_PORT", "RECEIVER_LOG_FORMAT")
# What the console needs and no command does: not printed with the commands' settings.
CONSOLE_ONLY = ("CONSOLE_PASSWORD_HASH", "COOKIE_SECRET")

ORDERS = (
    (FormationOrder, {"order_number": "FO-0001", "order_name": "ORD-0001",
                      "customer_email": "ana@example.com", "service_name": "Wyoming LLC"}),
    (FormationOrder, {"order_number": "FO-0002", "order_name": "ORD-0002",
                      "customer_email": "ben@example.com", "service_name": "Delaware LLC",
                      "payment_status": "paid"}),
    (ComplianceOrder, {"order_number": "CO-20001", "service_slug": "ifta",
                       "service_name": "IFTA quarterly filing",
                       "customer_email": "carla@example.com"}),
    (ComplianceOrder, {"order_number": "CO-20002", "service_slug": "ucr",
                       "service_name": "UCR registration", "customer_email": "dev@example.com"}),
    (BundleOrder, {"order_number": "BU-0001", "customer_email": "eve@example.com",
                   "service_name": "Formation and compliance bundle"}),
    (CrtcOrder, {"order_number": "CA-0001", "customer_email": "fay@example.com",
                 "service_name": "CRTC registration", "total_cents": 780}),
    (CrtcOrder, {"order_number": "CA-0002", "customer_email": "gus@example.com",
                 "service_name": "CRTC registration", "total_cents": 12900}),
)

# The order the demo's first step creates through the orders API, as a shop would.
NEW_ORDER = ("canada_crtc", "CA-0003")
NEW_ORDER_FIELDS = json.dumps({
    "customer_email": "hal@example.com", "customer_name": "Hal Hertz Radio",
    "service_name": "CRTC registration", "total_cents": 780, "currency": "USD"})
# As SHKeeper (2.5.16 and later) sends it: every amount a string with its trailing zeros
# stripped, keys sorted, no spaces.
PAID_CALLBACK = json.dumps({
    "external_id": NEW_ORDER[1], "crypto": "BTC", "addr": "bc1qdemo0address", "fiat": "USD",
    "balance_fiat": "7.8", "balance_crypto": "0.00012345", "paid": True, "status": "PAID",
    "transactions": [{
        "txid": "demo-tx-1", "date": "2026-11-20 09:00:12", "amount_crypto": "0.00012345",
        "amount_fiat": "7.8", "amount_fiat_without_fee": "7.6470588235",
        "fee_fiat": "0.1529411765", "trigger": True, "crypto": "BTC"}],
    "fee_percent": "2", "fee_fixed": "0", "fee_policy": "PERCENT_FEE", "overpaid_fiat": "0.00",
}, sort_keys=True, separators=(",", ":"))
SUBMITTED = ('{"order_name": "ORD-0001", "order_number": "FO-0001", "state_code": "WY", '
             '"entity_name": "Acme Demo LLC"}')


def demo_environment(environ: Mapping[str, str], folder: str,
                     standins: StandIns) -> dict[str, str]:
    """The demo's settings as environment variables: the service runs with them, and the
    commands it prints are given them, so that `link` signs with the demo's LINK_SECRET
    and `spool quarantined` reads the demo's spool."""
    env = {name: environ[name] for name in FROM_ENVIRONMENT if name in environ}
    env.update(standins.settings, DATABASE_URL=f"sqlite:///{folder}/receiver.sqlite3",
               SPOOL_DIR=f"{folder}/spool", WEBHOOK_SECRET=WEBHOOK_SECRET,
               LINK_SECRET="demo-link-secret", CRYPTO_PROCESSOR_API_KEY=CRYPTO_API_KEY,
               ORDERS_API_KEY=ORDERS_API_KEY, SENDERS="workflow,card,crypto,orders",
               ADMIN_EMAIL="admin@example.com", MAIL_FROM="receiver@example.com",
               CONSOLE_PASSWORD_HASH=hash_password(CONSOLE_PASSWORD),
               COOKIE_SECRET="demo-cookie-secret-for-this-machine-only",
               # Short, so that what the stand-ins receive shows up at once.
               SCHEDULER_TICK_SECONDS="2")
    env["PUBLIC_BASE_URL"] = Settings.from_env(env).public_base_url
    return env


def lock_demo_folder(folder: str) -> IO[str]:
    """Lock `folder` for this demo's life (the lock goes with the process), or refuse:
    another demo there would lose its database to this one's fresh start."""
    os.makedirs(folder, exist_ok=True)
    lock = open(os.path.join(folder, LOCK_FILE), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise CannotStart(f"another demo is running on {folder}: stop it first (Ctrl-C in "
                          "its terminal), or give this one --folder DIR", 1) from None
    return lock


def refuse_a_taken_port(settings: Settings) -> None:
    """Refuse before the fresh start when the port is taken (by a demo on another folder,
    or anything else): CannotStart says so."""
    for sock in bind(settings):
        sock.close()


def fresh_database(settings: Settings, folder: str) -> None:
    """The demo's database made afresh, with the schema and the sample orders; its
    previous database and spool go (only those: the folder may hold other things)."""
    for name in DATABASE_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    shutil.rmtree(os.path.join(folder, "spool"), ignore_errors=True)
    db = open_database(settings.database_url)
    migrations.migrate(db)
    with database.atomic():
        for model, fields in ORDERS:
            model.create(**fields)
    db.close()


def instructions(settings: Settings, env: dict[str, str], folder: str,
                 standins: StandIns) -> str:
    base = settings.public_base_url
    cli = ".venv/bin/python receiver.py"
    exports = "\n".join(f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())
                        if name not in CONSOLE_ONLY)
    sign = ("python3 -c 'import hashlib, hmac, sys; print(hmac.new(sys.argv[1].encode(), "
            "sys.stdin.buffer.read(), hashlib.sha256).hexdigest())' " + CRYPTO_API_KEY)
    return f"""
The demo listens on {base}.
Its sample orders (FO-0001, FO-0002, CO-20001 for IFTA, CO-20002 for UCR, BU-0001, CA-0001,
CA-0002) are in {folder}/receiver.sqlite3, made afresh at every start; DATABASE_URL is
never opened. The worker, Frappe and Telegram are stand-ins on 127.0.0.1:{standins.http_port},
the mail server one on 127.0.0.1:{standins.smtp_port}; what they receive is logged below as
"stand-in ...". Try these in another terminal, in this folder:

# 1. The shop creates CRTC order {NEW_ORDER[1]} through the orders API (docs/ORDERS.md): 201 and the order as the service sees it; the same call again is 200 and changes nothing
curl -s -X PUT {base}/api/v1/orders/{NEW_ORDER[0]}/{NEW_ORDER[1]} -H 'Authorization: Bearer {ORDERS_API_KEY}' -H 'Content-Type: application/json' -d '{NEW_ORDER_FIELDS}'

# 2. Frappe says formation order FO-0001 was submitted: the name-search job goes to the worker
curl -s -X POST {base}/api/v1/webhooks/formation/submitted -H 'X-Webhook-Secret: {WEBHOOK_SECRET}' -H 'Content-Type: application/json' -d '{SUBMITTED}'

# 3. SHKeeper says the invoice of {NEW_ORDER[1]} (step 1's order) is paid, signed as SHKeeper signs (HMAC-SHA256 of "<timestamp>.<body>" with the API key): the order becomes paid, a treasury job and a ledger entry are written, Telegram gets the alert
body='{PAID_CALLBACK}'
ts=$(date +%s); sig=$(printf '%s.%s' "$ts" "$body" | {sign})
curl -s -X POST {base}/api/v1/webhooks/crypto-processor -H 'Content-Type: application/json' -H 'X-Shkeeper-Api-Key: {CRYPTO_API_KEY}' -H "X-Shkeeper-Timestamp: $ts" -H "X-Shkeeper-Signature: $sig" -d "$body"

# 4. The command line on the demo's database: first give that terminal the demo's settings (the export lines), then ask what was stored and sent (the ID of `events show` is the first column of `events list`)
{exports}
{cli} events list
{cli} outbox list
{cli} events show 1
{cli} spool quarantined

# 5. The "I already filed" link of an IFTA reminder for compliance order CO-20001 (open it in a browser: it asks, and its button records; `{cli} link ifta CO-20001 2026-Q3` prints it, with the settings of step 4)
{signed_link(settings, "ifta", "CO-20001", "2026-Q3")}

# 6. The operator console (open it in a browser; log in with any name and the password {CONSOLE_PASSWORD}): what came in, what went out, {NEW_ORDER[1]}'s timeline
{base}/console/orders/{NEW_ORDER[1]}

Stop the demo with Ctrl-C; the next `make demo` starts from the sample orders again.
"""


async def run(environ: Mapping[str, str], folder: str, out: TextIO = sys.stdout) -> None:
    standins = StandIns()
    try:
        env = demo_environment(environ, folder, standins)
        settings = Settings.from_env(env)
        configure_logging(settings)
        with lock_demo_folder(folder):
            refuse_a_taken_port(settings)
            fresh_database(settings, folder)
            await serve(settings, ready=lambda: print(
                instructions(settings, env, folder, standins), file=out, flush=True))
    finally:
        standins.stop()
