"""The worker service: POST {WORKER_URL}/jobs with the action and its payload."""
from clients.http import Result, post_json


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
        return await post_json(
            self.http, f"{self.settings.worker_url}/jobs",
            {"action": action, **payload},
            headers={"Idempotency-Key": idempotency_key},
            timeout=self.settings.outbound_timeout_seconds, peer="worker")
