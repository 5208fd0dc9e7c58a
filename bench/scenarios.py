"""What the load generator sends: one class per measured endpoint. Every request is
unique where the service deduplicates, so the benchmark measures real work."""
import itertools
import json
import os


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


SCENARIOS = {"ceiling": Ceiling, "workflow": Workflow}
