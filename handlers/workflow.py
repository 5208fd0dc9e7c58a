"""POST /api/v1/webhooks/<group>/<event>: the workflow system's state-change webhooks, and
the worker's fulfilment reports (fulfillment/<status>), which share their secret and rules.
An event its plugin rejected (a fulfilment move the order cannot make) is answered 409
with the reason, also when it is delivered again."""
import base64
import functools
import hashlib
import hmac
import logging
from typing import Any, NoReturn

from handlers.base import ApiHandler, same_secret
from domain import reconcile
from engine import inbox
from models import WebhookEvent

log = logging.getLogger("receiver.workflow")

# A body with the document's `modified` is one state change (domain.reconcile.change_key):
# Frappe's re-sends of it, and the reconciliation that found it first, are that change.
# A body without one: Frappe re-sends a failed delivery byte for byte (v15: three tries
# within about 5 s), so the same body to the same path within WORKFLOW_DEDUP_HOURS is that
# same delivery. That key names the hour the body first came, and the hours of the window
# before it are looked up as well, so the window is WORKFLOW_DEDUP_HOURS to one hour more,
# whatever the hour boundaries.
DEDUP_BUCKET_SECONDS = 3600
REJECTED = "rejected"
RECORDED = "ignored"
# The answer's action for a change stored and not handled when it is answered: handled in
# its turn, or told as history then (BEHAVIOUR.md 4.1).
QUEUED = "queued"


def hourly_keys(prefix: str, first: int, last: int) -> inbox.CallFields:
    """The inbox's earlier keys of one body: its keys of the hours `first` to `last`. As
    one range (`also_known_between`) while both hours have as many digits (six, from 1981
    to 2084), its keys then sorting as their hours; one key per hour otherwise. No other
    call's key sorts among them, as none begins with this body's path and digest."""
    if first > last:
        return {}
    if len(str(first)) == len(str(last)):
        return {"also_known_between": (f"{prefix}:h{first}", f"{prefix}:h{last}")}
    return {"also_known_as": tuple(f"{prefix}:h{hour}" for hour in range(first, last + 1))}


class WorkflowWebhookHandler(ApiHandler):
    # Frappe's bodies are a few fields from a template: a few hundred bytes.
    body_limit = 64 * 1024

    def check_headers(self) -> bool:
        """The path exists, and the secret header is right; the log says which check
        failed, never what was sent."""
        if self.ctx.plugins["workflow"].get(self.path_args[0]) is None:
            self.fail(404, "not found")
        given = self.request.headers.get("X-Webhook-Secret")
        if not same_secret(given, self.ctx.settings.workflow_secret):
            self.refuse_credentials(401, "Unauthorized", "X-Webhook-Secret does not match "
                                    "WEBHOOK_SECRET" if given else "no X-Webhook-Secret")
        return True

    async def post(self, path: str) -> None:
        webhook = self.ctx.plugins["workflow"].get(path)
        signing_secret = self.ctx.settings.workflow_webhook_signing_secret
        if signing_secret and not self.frappe_signature_valid(signing_secret):
            self.refuse_credentials(
                401, "Unauthorized", "X-Frappe-Webhook-Signature does not sign the body with "
                "WORKFLOW_WEBHOOK_SIGNING_SECRET"
                if self.request.headers.get("X-Frappe-Webhook-Signature")
                else "no X-Frappe-Webhook-Signature (WORKFLOW_WEBHOOK_SIGNING_SECRET is set)")
        body = self.json_body()
        error = webhook.field_error(body)
        if error:
            self.fail(400, error)
        # A change placed after the document's earlier ones, whoever brings those.
        await reconcile.predecessors_first(self.ctx, path, body)
        event, outcome = await self.accept(path, body)
        # An outcome comes with its event; a spooled call has neither.
        if event is not None and REJECTED in (outcome, event.status):
            stored = await self.ctx.commits.run(
                functools.partial(inbox.find, self.ctx, "workflow", event.dedup_key))
            self.fail(409, (stored and stored.last_error) or REJECTED)
        if event is not None and RECORDED in (outcome, event.status):
            # A change older than one handled (BEHAVIOUR.md 4.1.1): kept, not acted on.
            self.answer(200, {"received": True, "action": "recorded_not_handled"})
            return
        if (outcome or (event and event.status)) != "processed":
            # Stored, not handled yet (spooled, waiting behind an earlier change of its
            # document, or to be tried again): what it causes is not promised.
            self.answer(200, {"received": True, "action": QUEUED})
            return
        self.answer(200, {"received": True, "action": webhook.answer})

    def fail(self, status: int, message: str) -> NoReturn:
        """As every handler fails, and a refused body (400) is logged with its reason, so
        that whoever set up the sender can tell what to fix (a refused credential is
        logged by refuse_credentials, with its reason)."""
        if status == 400:
            log.warning("workflow webhook %s refused from %s: %s", self.request.path,
                        self.request.remote_ip, message)
        super().fail(status, message)

    def frappe_signature_valid(self, secret: str) -> bool:
        expected = base64.b64encode(
            hmac.new(secret.encode(), self.raw_body, hashlib.sha256).digest()).decode()
        return same_secret(self.request.headers.get("X-Frappe-Webhook-Signature"), expected)

    async def accept(self, path: str,
                     body: dict[str, Any]) -> tuple[WebhookEvent | None, str | None]:
        explicit = self.request.headers.get("Idempotency-Key", "").strip()
        if len(explicit) > inbox.MAX_KEY_LENGTH:
            self.fail(400, f"Idempotency-Key too long (at most {inbox.MAX_KEY_LENGTH} "
                           "characters)")
        earlier: inbox.CallFields = {}
        # Its place in Frappe's record, as its plugin declares it: the change (the save
        # that made it) and the document whose changes it waits among.
        placed = self.ctx.plugins["workflow"].placed(path, body)
        change = placed.same
        if explicit:
            dedup_key = f"{path}:key:{explicit}"
        else:
            digest = hashlib.sha256(self.raw_body).hexdigest()
            hour = int(self.ctx.clock().timestamp()) // DEDUP_BUCKET_SECONDS
            dedup_key = f"{path}:{digest}:h{hour}"
            first, last = hour - self.ctx.settings.workflow_dedup_hours, hour - 1
            if change:
                # The body's own key too: a copy stored before state changes had keys.
                # (A run, or a later change's webhook reading the workflow log first, may
                # have found this change under that log entry's key: the inbox asks the
                # plugin's Placement.found_otherwise.)
                dedup_key, last = change, hour
            earlier = hourly_keys(f"{path}:{digest}", first, last)
        # The earlier hours are looked up by the inbox, or by the spool drain when the
        # database is down now.
        # Frappe gives up on an answer after 5 s (its webhook timeout) and re-sends later;
        # the calls to Frappe and the worker may take up to OUTBOUND_TIMEOUT_SECONDS. So
        # the answer waits for them only within the budget, once the call is stored.
        fields: inbox.CallFields = {"order_number": body["order_number"], **earlier,
                                    "stream": placed.stream, "version": placed.version}
        event, _created, outcome = await inbox.accept(
            self.ctx, "workflow", path, dedup_key, self.raw_body, **fields,
            send_within=self.ctx.settings.workflow_answer_budget_seconds,
            orders=self.ctx.plugins["workflow"].orders_of(path, body))
        return event, outcome
