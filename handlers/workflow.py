"""POST /api/v1/webhooks/<group>/<event>: the workflow system's state-change webhooks."""
import base64
import hashlib
import hmac

from handlers.base import ApiHandler, same_secret
from engine import inbox

# Frappe re-sends a failed delivery byte for byte (current versions after 5 min, 30 min,
# 2 h, 5 h, 10 h and 10 h; older ones three times within seconds). The same body to the
# same path within WORKFLOW_DEDUP_HOURS is that same delivery. The key names the hour the
# body first came, and the hours of the window before it are looked up as well, so the
# window is WORKFLOW_DEDUP_HOURS to one hour more, whatever the hour boundaries.
DEDUP_BUCKET_SECONDS = 3600


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
            hour = int(self.ctx.clock().timestamp()) // DEDUP_BUCKET_SECONDS
            dedup_key = f"{path}:{digest}:h{hour}"
            previous = tuple(f"{path}:{digest}:h{earlier}" for earlier in range(
                hour - self.ctx.settings.workflow_dedup_hours, hour))
        # The earlier hours are looked up by the inbox, or by the spool drain when the
        # database is down now.
        # Frappe gives up on an answer after 5 s (its webhook timeout) and re-sends later;
        # the calls to Frappe and the worker may take up to OUTBOUND_TIMEOUT_SECONDS. So
        # the answer waits for them only within the budget, once the call is stored.
        await inbox.accept(self.ctx, "workflow", path, dedup_key, self.raw_body,
                           order_number=body["order_number"], also_known_as=previous,
                           send_within=self.ctx.settings.workflow_answer_budget_seconds)
