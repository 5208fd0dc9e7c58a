"""The worker service: POST {WORKER_URL}/jobs with the action and its payload."""
from typing import Any

from clients.http import HttpClient, Request, Result, post_json
from settings import Settings


class WorkerClient:
    def __init__(self, http: HttpClient, settings: Settings) -> None:
        self.http = http
        self.settings = settings

    @property
    def configured(self) -> bool:
        return bool(self.settings.worker_url)

    async def dispatch(self, action: str, payload: dict[str, Any],
                       idempotency_key: str) -> Result:
        if not self.configured:
            return Result.failed("WORKER_URL is not set", configured=False)
        request = self.request(action, payload, idempotency_key)
        return await post_json(self.http, request.url, request.body, request.headers,
                               timeout=self.settings.outbound_timeout_seconds, peer="worker")

    def request(self, action: str, payload: dict[str, Any], idempotency_key: str) -> Request:
        return Request(f"{self.settings.worker_url}/jobs", {"action": action, **payload},
                       {"Idempotency-Key": idempotency_key})
