"""POST /api/v1/webhooks/<group>/<event>: the workflow system's state-change webhooks."""
import base64
import hashlib
import hmac

from handlers.base import ApiHandler, same_secret
from engine import inbox

# Frappe retries a failed webhook a few times within seconds, and may time out while we
# wait on the worker. The same body to the same path within this window is that same
# delivery. A sender that re-fires an identical body on purpose sends an Idempotency-Key.
DEDUP_WINDOW_SECONDS = 600


class WorkflowWebhookHandler(ApiHandler):
    async def post(self, path):
        webhook = self.ctx.plugins["workflow"].get(path)
        if webhook is None:
            self.fail(404, "not found")
        self.authenticate()
        body = self.json_body()
        error = webhook.field_error(body)
        if error:
            self.fail(400, error)
        await self.accept(path, body)
        self.answer(200, {"received": True, "action": webhook.answer})

    def authenticate(self):
        settings = self.ctx.settings
        if not same_secret(self.request.headers.get("X-Webhook-Secret"), settings.webhook_secret):
            self.fail(401, "Unauthorized")
        if settings.workflow_webhook_signing_secret and not self.frappe_signature_valid(
                settings.workflow_webhook_signing_secret):
            self.fail(401, "Unauthorized")

    def frappe_signature_valid(self, secret):
        expected = base64.b64encode(
            hmac.new(secret.encode(), self.raw_body, hashlib.sha256).digest()).decode()
        return same_secret(self.request.headers.get("X-Frappe-Webhook-Signature"), expected)

    async def accept(self, path, body):
        explicit = self.request.headers.get("Idempotency-Key", "").strip()
        previous = ()
        if explicit:
            dedup_key = f"{path}:key:{explicit}"
        else:
            digest = hashlib.sha256(self.raw_body).hexdigest()
            window = int(self.ctx.clock().timestamp()) // DEDUP_WINDOW_SECONDS
            dedup_key = f"{path}:{digest}:{window}"
            previous = (f"{path}:{digest}:{window - 1}",)
        # The previous window is looked up by the inbox, or by the spool drain when the
        # database is down now.
        await inbox.accept(self.ctx, "workflow", path, dedup_key, self.raw_body,
                           order_number=body["order_number"], also_known_as=previous)
