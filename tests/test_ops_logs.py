"""The log of the real service (RECEIVER_LOG_FORMAT=json): one line per event keyed by its
id, and never a secret, not even from requests that carry every kind of secret there is,
right or wrong."""
import base64
import hashlib
import hmac
import json
import logging
import signal
import sys
import time
import urllib.parse

import pytest

from models import FormationOrder
from app.logs import JsonLogFormatter, RedactingFormatter, secrets_of
from settings import Settings
from domain.links import link_token
from tests import stripe_events as stripe_shaped
from tests.conftest import WEBHOOK_SECRET
from tests.ops_helpers import Service

SECRETS = {
    "WEBHOOK_SECRET": "wh-secret-AAAA1111",
    "WORKFLOW_WEBHOOK_SIGNING_SECRET": "frappe-sign-CCCC3333",
    "WORKFLOW_API_KEY": "wf-api-key-KKKK0000",
    "WORKFLOW_API_SECRET": "wf-api-secret-EEEE5555",
    "STRIPE_SECRET_KEY": stripe_shaped.SECRET_KEY,
    "STRIPE_WEBHOOK_SECRET": stripe_shaped.SECRET,
    "CRYPTO_PROCESSOR_API_KEY": "crypto-key-DDDD4444",
    "TELEGRAM_BOT_TOKEN": "123456:tg-token-FFFF6666",
    "LINK_SECRET": "link-secret-HHHH8888",
}
SMTP_PASSWORD = "smtp-pass-GGGG7777"
WRONG = {"webhook": "wrong-secret-BBBB2222", "crypto": "wrong-crypto-LLLL3333",
         "link": "bad-token-IIII9999", "stripe": "whsec_wrong_MMMM4444"}
# Another order than the card events', so their effects are not queued behind this one's.
ORDER = {"order_name": "ORD-8", "order_number": "FO-8", "state_code": "WY",
         "entity_name": "Secretive LLC"}


@pytest.fixture
def service(tmp_path, database_url, worker, frappe, smtp):
    dead_port = "http://127.0.0.1:1"  # Telegram unreachable: its URL (and token) in errors
    running = Service(tmp_path / "service.log", {
        **SECRETS, "RECEIVER_LOG_FORMAT": "json", "DATABASE_URL": database_url,
        "WORKER_URL": worker.url, "WORKFLOW_URL": frappe.url, "TELEGRAM_API_URL": dead_port,
        "TELEGRAM_CHAT_ID": "-1001", "ADMIN_EMAIL": "admin@example.test",
        "SMTP_URL": f"smtp://mailer:{SMTP_PASSWORD}@127.0.0.1:{smtp.port}",
        "OUTBOUND_TIMEOUT_SECONDS": "2", "SPOOL_DIR": str(tmp_path / "spool")})
    yield running
    running.kill()


def json_lines(log):
    return [json.loads(line) for line in log.splitlines() if line.strip()]


def frappe_signature(raw):
    key = SECRETS["WORKFLOW_WEBHOOK_SIGNING_SECRET"].encode()
    return base64.b64encode(hmac.new(key, raw, hashlib.sha256).digest()).decode()


async def send_every_kind_of_secret(client, url, frappe):
    frappe.fail_with(500)  # Frappe refuses: the error path is logged too
    raw = json.dumps(ORDER).encode()
    workflow = url + "/api/v1/webhooks/formation/submitted"
    signed = {"X-Frappe-Webhook-Signature": frappe_signature(raw),
              "Content-Type": "application/json"}
    answers = [
        await client.fetch(workflow, method="POST", body=raw, headers={
            **signed, "X-Webhook-Secret": SECRETS["WEBHOOK_SECRET"]}),
        await client.fetch(workflow, method="POST", body=raw, headers={
            **signed, "X-Webhook-Secret": WRONG["webhook"]}),
    ]
    card = url + stripe_shaped.CARD_URL
    for evt in (
            stripe_shaped.event("checkout.session.completed",
                                stripe_shaped.checkout_session("FO-9", "formation")),
            stripe_shaped.event("payment_intent.payment_failed", stripe_shaped.payment_intent(
                "FO-7", "formation", last_payment_error=stripe_shaped.card_declined()))):
        body = stripe_shaped.raw_of(evt)
        for secret in (stripe_shaped.SECRET, WRONG["stripe"]):
            answers.append(await client.fetch(card, method="POST", body=body, headers={
                "Stripe-Signature": stripe_shaped.sign(body, secret, int(time.time()))}))
    callback = json.dumps({"external_id": "FO-9", "status": "PAID", "crypto": "BTC",
                           "balance_fiat": "10.00", "balance_crypto": "0.0001",
                           "transactions": [{"txid": "tx-1"}]})
    for key in (SECRETS["CRYPTO_PROCESSOR_API_KEY"], WRONG["crypto"]):
        answers.append(await client.fetch(
            url + "/api/v1/webhooks/crypto-processor", method="POST", body=callback,
            headers={"X-Shkeeper-Api-Key": key, "Content-Type": "application/json"}))
    token = link_token(SECRETS["LINK_SECRET"], "ifta", "FO-9", "2026-Q3")
    for given in (token, WRONG["link"]):
        answers.append(await client.fetch(
            f"{url}/api/v1/ifta/filed?order=FO-9&cycle=2026-Q3&token={given}"))
    return answers, token


@pytest.mark.gen_test(timeout=90)
async def test_the_log_has_one_line_per_event_and_no_secret(service, client, frappe, smtp):
    FormationOrder.create(order_number="FO-9")
    FormationOrder.create(order_number="FO-7")
    await service.start()
    await service.wait_ready(client)

    answers, valid_token = await send_every_kind_of_secret(client, service.url, frappe)
    assert [a.code for a in answers] == [200, 401, 200, 400, 200, 400, 202, 401, 404, 403]
    service.process.send_signal(signal.SIGTERM)
    assert await service.wait_exit() == 0
    log = service.log()

    leaked = [name for name, secret in {
        **SECRETS, "SMTP password": SMTP_PASSWORD, "valid link token": valid_token,
        **{f"wrong {kind}": value for kind, value in WRONG.items()}}.items()
        if secret in log]
    assert leaked == []
    # The paths that could have leaked did run: Telegram and SMTP (with login) failed.
    failures = [line["message"] for line in json_lines(log)
                if line["logger"] == "receiver.outbox"]
    assert any(" alert failed " in m for m in failures), failures
    assert any(" email failed " in m for m in failures), failures
    lines = json_lines(log)
    events = [line for line in lines if "event_id" in line]
    assert {(e["source"], e["event_type"], e["outcome"]) for e in events} >= {
        ("workflow", "formation/submitted", "processed"),
        ("card", "checkout.session.completed", "processed"),
        ("card", "payment_intent.payment_failed", "processed")}
    assert len({e["event_id"] for e in events}) == len(events)
    assert all(isinstance(e["ms"], float) and e["time"].endswith("+00:00") for e in events)
    access = [line for line in lines if line["logger"] == "receiver.access"]
    assert any(line["message"].startswith("403 GET /api/v1/ifta/filed ") for line in access)
    # Each access line's parts are fields of their own too (it was only a message).
    assert any((line["status"], line["method"], line["path"]) == (403, "GET",
                                                                  "/api/v1/ifta/filed")
               for line in access)
    assert all(isinstance(line["ms"], float) for line in access)


def record_with_exception(message):
    try:
        raise ValueError(f"refused with {SECRETS['WORKFLOW_API_SECRET']}")
    except ValueError:
        return logging.LogRecord("tornado.application", logging.ERROR, __file__, 1, message,
                                 None, sys.exc_info())


@pytest.mark.parametrize("formatter", [JsonLogFormatter(), logging.Formatter()],
                         ids=["json", "text"])
def test_whatever_a_library_logs_a_secret_comes_out_redacted(formatter):
    settings = Settings(webhook_secret=SECRETS["WEBHOOK_SECRET"],
                        workflow_api_secret=SECRETS["WORKFLOW_API_SECRET"],
                        smtp_url="smtp://mailer:p%40ss-GGGG7777@127.0.0.1:25",
                        database_url="postgresql://app:db-pass-NNNN5555@127.0.0.1/receiver",
                        link_secret="ok")
    redacting = RedactingFormatter(formatter, secrets_of(settings))
    record = record_with_exception(
        "Uncaught exception GET /api/v1/ifta/filed?order=FO-1&token=tok-OOOO6666 (127.0.0.1) "
        f"secret={SECRETS['WEBHOOK_SECRET']} smtp=p@ss-GGGG7777 db=db-pass-NNNN5555 ok")

    text = redacting.format(record)
    for secret in (SECRETS["WEBHOOK_SECRET"], SECRETS["WORKFLOW_API_SECRET"], "tok-OOOO6666",
                   "GGGG7777", "db-pass-NNNN5555"):
        assert secret not in text
    assert "token=[redacted]" in text and "order=FO-1" in text
    assert text.count("[redacted]") == 5
    assert " ok" in text  # a value too short to be a real secret is not blanked out
    if isinstance(formatter, JsonLogFormatter):
        assert json.loads(text)["logger"] == "tornado.application"


@pytest.mark.parametrize("formatter", [JsonLogFormatter(), logging.Formatter()],
                         ids=["json", "text"])
def test_a_secret_json_would_escape_is_redacted_before_it_is_escaped(formatter):
    password = 'p"ss\\w0rd-é€'  # a quote, a backslash and non-ASCII: JSON escapes each
    settings = Settings(smtp_url="smtp://mailer:"
                        f"{urllib.parse.quote(password, safe='')}@127.0.0.1:25",
                        link_secret="ok")
    redacting = RedactingFormatter(formatter, secrets_of(settings))
    try:
        raise OSError(f"SMTP login refused for {password}")
    except OSError:
        record = logging.LogRecord("receiver.outbox", logging.ERROR, __file__, 1,
                                   "email failed with %s", (password,), sys.exc_info())
    text = redacting.format(record)
    shown = json.loads(text) if isinstance(formatter, JsonLogFormatter) else {
        "message": text, "exception": text}
    for field in ("message", "exception"):
        assert password not in shown[field] and "[redacted]" in shown[field], field
    for escaped in (password, json.dumps(password)[1:-1], "w0rd-\\u00e9"):
        assert escaped not in text
    # The record other handlers see is left as it was.
    assert record.getMessage() == f"email failed with {password}"


@pytest.mark.gen_test
async def test_the_access_log_names_the_referral_route_not_the_email(http_server, base_url,
                                                                    client, caplog):
    caplog.set_level(logging.INFO, logger="receiver.access")
    for path in ("/api/v1/referral/jane.doe%40example.com",
                 "/api/v1/referral/jane.doe@example.com/extra",
                 "/api/v1/referral/check?code=ABC"):
        await client.fetch(base_url + path, headers={"X-Webhook-Secret": WEBHOOK_SECRET})
    access = [r.getMessage() for r in caplog.records if r.name == "receiver.access"]
    assert len(access) == 3, access
    assert "jane" not in " ".join(access) and "example.com" not in " ".join(access)
    assert access[0].startswith("200 GET /api/v1/referral/<email> ")
    assert access[1].startswith("404 GET /api/v1/referral/<email> ")
    assert " GET /api/v1/referral/check " in access[2]
