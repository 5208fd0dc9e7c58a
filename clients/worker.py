"""The worker service: POST {WORKER_URL}/jobs with the action and its payload."""
from clients.http import Request, Result, post_json


class WorkerClient:
    def __init__(self, http, settings):
        self.http = http
        self.settings = settings

    @property
    def configured(self):
        return bool(self.settings.worker_url)

    async def dispatch(self, action, payload, idempotency_key):
        if not self.configured:
            return Result.failed("WORKER_URL is not set", configured=False)
        request = self.request(action, payload, idempotency_key)
        return await post_json(self.http, request.url, request.body, request.headers,
                               timeout=self.settings.outbound_timeout_seconds, peer="worker")

    def request(self, action, payload, idempotency_key):
        return Request(f"{self.settings.worker_url}/jobs", {"action": action, **payload},
                       {"Idempotency-Key": idempotency_key})
