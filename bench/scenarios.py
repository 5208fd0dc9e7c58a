"""What the load generator sends: one class per measured endpoint. Every request is
unique where the service deduplicates, so the benchmark measures real work."""
import hashlib
import hmac
import itertools
import json
import os
import time


def http_post(host, port, path, body, headers=()):
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
             "Content-Type: application/json", f"Content-Length: {len(body)}",
             *(f"{name}: {value}" for name, value in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Ceiling:
    """A bare Tornado app answering a JSON POST: the single-process ceiling."""
    expected_status = 200

    def __init__(self):
        self.counter = itertools.count()

    def next_request(self, host, port):
        body = json.dumps({"order_name": f"BENCH-{next(self.counter)}",
                           "order_number": "BENCH"}).encode()
        return http_post(host, port, "/echo", body)


class Workflow:
    """formation/ready: one inbox row, one outbox job sent to the worker, then the answer."""
    expected_status = 200

    def __init__(self, secret="bench-webhook-secret", prefix=None):
        self.secret = secret
        self.prefix = prefix or f"WF{os.getpid()}"
        self.counter = itertools.count()

    def next_request(self, host, port):
        n = next(self.counter)
        body = json.dumps({"order_name": f"{self.prefix}-{n}",
                           "order_number": f"{self.prefix}-{n}"}).encode()
        return http_post(host, port, "/api/v1/webhooks/formation/ready", body,
                         [("X-Webhook-Secret", self.secret)])


CARD_SECRET = "whsec_bench_0000000000000000"
CRYPTO_KEY = "bench-crypto-key"


def signed_card_event(host, port, event_type, obj, event_id):
    """A Stripe Event envelope signed the way Stripe signs it."""
    body = json.dumps({"id": event_id, "object": "event", "api_version": "2026-03-25.dahlia",
                       "created": int(time.time()), "type": event_type, "livemode": False,
                       "pending_webhooks": 1, "data": {"object": obj}}).encode()
    timestamp = int(time.time())
    mac = hmac.new(CARD_SECRET.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return http_post(host, port, "/api/v1/webhooks/card-processor", body,
                     [("Stripe-Signature", f"t={timestamp},v1={mac.hexdigest()}")])


class Card:
    """A signed checkout.session.completed, paid: completes one seeded formation order
    (status change, order alert to the Telegram stand-in)."""
    expected_status = 200
    orders = ("formation", "FOB-{}")

    def __init__(self, start=0):
        self.counter = itertools.count(start)

    def next_request(self, host, port):
        n = next(self.counter)
        session = {"id": f"cs_bench_{os.getpid()}_{n}", "object": "checkout.session",
                   "mode": "payment", "payment_status": "paid", "status": "complete",
                   "payment_intent": f"pi_bench_{os.getpid()}_{n}",
                   "payment_method_types": ["card"], "amount_total": 49900, "currency": "usd",
                   "metadata": {"order_id": self.orders[1].format(n),
                                "order_type": self.orders[0]}}
        return signed_card_event(host, port, "checkout.session.completed", session,
                                 f"evt_bench_{os.getpid()}_{n}")


class Crypto:
    """A PAID SHKeeper callback: treasury job, ledger entry and completion of one seeded
    compliance order."""
    expected_status = 202
    orders = ("compliance", "CO-B{}")

    def __init__(self, start=0):
        self.counter = itertools.count(start)

    def next_request(self, host, port):
        n = next(self.counter)
        txid = f"0xbench{os.getpid()}x{n}"
        body = json.dumps({
            "external_id": self.orders[1].format(n), "crypto": "BTC", "addr": "bc1qbench",
            "fiat": "USD",
            "balance_fiat": "49.90", "balance_crypto": "0.00081234", "paid": True,
            "status": "PAID", "fee_percent": "2", "overpaid_fiat": "0.00",
            "transactions": [{"txid": txid, "date": "2026-11-20 09:00:00",
                              "amount_crypto": "0.00081234", "amount_fiat": "49.90",
                              "trigger": True, "crypto": "BTC"}]}).encode()
        return http_post(host, port, "/api/v1/webhooks/crypto-processor", body,
                         [("X-Shkeeper-Api-Key", CRYPTO_KEY)])


SCENARIOS = {"ceiling": Ceiling, "workflow": Workflow, "card": Card, "crypto": Crypto}


class Dispute:
    """A signed charge.dispute.created for a seeded paid order, found by its payment
    intent: the lookup whose cost must not grow with the order tables. Handled after the
    answer, so its cost is read from the inbox, not from the answer's latency."""
    expected_status = 200
    orders = ("formation", "FOD-{}")

    def __init__(self, start=0):
        self.counter = itertools.count(start)

    @staticmethod
    def seeded(n):
        return {"payment_status": "paid", "stripe_payment_intent_id": f"pi_dispute_{n}",
                "stripe_session_id": f"cs_dispute_{n}"}

    def next_request(self, host, port):
        n = next(self.counter)
        dispute = {"id": f"dp_bench_{os.getpid()}_{n}", "object": "dispute", "amount": 4990,
                   "currency": "usd", "reason": "fraudulent", "status": "needs_response",
                   "payment_intent": f"pi_dispute_{n}", "charge": f"ch_dispute_{n}"}
        return signed_card_event(host, port, "charge.dispute.created", dispute,
                                 f"evt_dispute_{os.getpid()}_{n}")


SCENARIOS["dispute"] = Dispute
