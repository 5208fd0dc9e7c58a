"""schemathesis against the running service, driven by openapi.yaml: no 5xx, and every
answer (status, content type, headers, body) as the document says.

The service runs as it does in production: `receiver.py serve` in a subprocess on a free
loopback port, on the suite's database (under the suite's thread check:
tests/checked_service.py). Bounded to finish in about a minute: a few
examples per operation, a fixed seed (the same cases every run), a per-request timeout."""
import os
import socket
import subprocess
import sys

import time
import urllib.request

import pytest

from models import ComplianceOrder, ReferralCode
from tests.checked_service import SERVE, refusals_to

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENAPI = os.path.join(ROOT, "openapi.yaml")
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")
SCHEMATHESIS = os.path.join(os.path.dirname(sys.executable), "st")
SECRETS = {"WEBHOOK_SECRET": "st-webhook-secret", "CRYPTO_PROCESSOR_API_KEY": "st-crypto-key",
           "ORDERS_API_KEY": "st-orders-api-key"}
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def known_data():
    """The order and the code of openapi.yaml's examples, so those cases reach the end."""
    ComplianceOrder.create(order_number="CO-20001", customer_name="Dana Trucking LLC")
    ReferralCode.create(code="FRIEND10", owner_email="pat@example.com", percent_off=10,
                        reward_cents=2500)


@pytest.fixture
def service(database_url, tmp_path, known_data):
    port = free_port()
    env = {**os.environ, **SECRETS, "DATABASE_URL": database_url, "RECEIVER_PORT": str(port),
           "STRIPE_SECRET_KEY": "sk_test_schemathesis", "STRIPE_WEBHOOK_SECRET": "whsec_st",
           "PUBLIC_RATE_LIMIT": "0", "SPOOL_DIR": str(tmp_path / "spool"),
           "WORKER_URL": "", "WORKFLOW_URL": "", "SMTP_URL": "", "TELEGRAM_BOT_TOKEN": "",
           **refusals_to(tmp_path / "service.log.refused")}
    log = open(tmp_path / "service.log", "w")
    process = subprocess.Popen(SERVE, cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base, process)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def wait_until_serving(base, process, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, "the service exited at start-up"
        try:
            with urllib.request.urlopen(f"{base}/api/v1/openapi.yaml", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the service did not answer within {seconds} s")


def test_the_service_answers_as_openapi_yaml_says(service):
    os.makedirs(ARTIFACTS, exist_ok=True)
    result = subprocess.run(
        [SCHEMATHESIS, "run", OPENAPI, "--url", service, "--checks", CHECKS,
         "--phases", "examples,coverage,fuzzing", "--max-examples", "12", "--seed", "20261122",
         "--request-timeout", "10", "--max-response-time", "5", "--workers", "1",
         "--suppress-health-check", "all",
         "-H", f"X-Webhook-Secret: {SECRETS['WEBHOOK_SECRET']}",
         "-H", f"X-Crypto-Processor-Api-Key: {SECRETS['CRYPTO_PROCESSOR_API_KEY']}",
         "-H", f"Authorization: Bearer {SECRETS['ORDERS_API_KEY']}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "100"})
    with open(os.path.join(ARTIFACTS, "schemathesis.txt"), "w") as out:
        out.write(result.stdout + result.stderr)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
