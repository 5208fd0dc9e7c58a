"""One module per workflow-system webhook path (BEHAVIOUR.md 4.1). Each declares the path, the
fields it requires, the workflow action it applies, the job it dispatches and the action
it answers with; `WorkflowWebhook` does the rest.

Placed by Frappe's document (plugins.registry.Placement): the changes of one document are
one stream (`formation:FO-1`, `crtc:CA-1`: a path's group and the order), handled in the
order of the saves that made them, the document's `modified` (or, for a change found in
its workflow log, when the log entry was written); two deliveries of one save are one
change (`reconcile.change_key`)."""
import functools
from typing import Any

from plugins.registry import FoundOtherwise, Placement, workflow_webhook
from domain import reconcile
from domain.orders import remember_order_name
from engine.contracts import EngineContext
from engine.transaction import OrderRef, Transaction
from engine.inbox import MAX_KEY_LENGTH
from engine.outbox import stable_key, tell_admin

# What a path does with a state its document had already left when the change was found
# (reconciliation reads it in the document's workflow log): "handled" as its webhook would
# have been then, or "told": recorded, nothing sent, the administrator told (its action
# cannot apply from a state the document is no longer in, or its job is moot once the
# state is over). BEHAVIOUR.md 4.1.1 has the table.
HANDLED, TOLD = "handled", "told"

ORDER_FIELDS = ("order_name", "order_number")


class WorkflowWebhook:
    path: str = ""
    # Required, non-empty strings; also the job's payload.
    fields: tuple[str, ...] = ORDER_FIELDS
    # Applied to the order in the workflow system, if any.
    workflow_action: str | None = None
    # The worker job dispatched, if any, and the fixed payload fields added to it.
    job: str | None = None
    job_constants: dict[str, Any] = {}
    # The `action` of the acknowledgement.
    answer: str | None = None
    # HANDLED or TOLD; None: TOLD with an action, else HANDLED.
    when_left: str | None = None
    # The paths whose state comes just before this one in its workflow: a change of a
    # document none of whose changes on them is stored has its workflow log read first
    # (domain.reconcile.predecessors_first), so that a webhook that comes late, or never,
    # is placed before this one.
    after: tuple[str, ...] = ()

    @property
    def placement(self) -> Placement:
        group = self.path.split("/")[0]
        return Placement(
            same=lambda body: reconcile.change_key(self.path, body["order_name"],
                                                   body.get("modified")),
            stream=lambda body: f"{group}:{body['order_number']}",
            version=reconcile.document_version, found_otherwise=self._found_otherwise)

    def _found_otherwise(self, body: dict[str, Any]) -> FoundOtherwise | None:
        """A change naming its save (a webhook's `modified`, a log entry's time) is the
        same whether its webhook or its document's workflow log found it first
        (`reconcile.same_stay`): each finder has its own key."""
        if reconcile.document_version(body) is None:
            return None
        return functools.partial(reconcile.same_stay, path=self.path,
                                 order_name=body["order_name"],
                                 order_number=body["order_number"], body=body)

    @property
    def left_rule(self) -> str:
        return self.when_left or (TOLD if self.workflow_action else HANDLED)

    def effects_named(self) -> str:
        """What the path sends, in words, for a notice that it was not sent."""
        named = [f"the action {self.workflow_action!r}"] if self.workflow_action else []
        return " and ".join(named + ([f"the job {self.job!r}"] if self.job else [])) or \
            "nothing"

    def field_error(self, body: dict[str, Any]) -> str | None:
        """What is wrong with the first unusable required field, or None. Control
        characters (a NUL, say) are no part of an order's name or number."""
        for name in self.fields:
            value = body.get(name)
            if value is not None and not isinstance(value, str):
                # A number where a name is expected is a template mistake, not a gap.
                return f"{name} must be a string"
            if value is None or not value.strip():
                return f"missing field: {name}"
            if not value.isprintable():
                return f"invalid field: {name}"
            if len(value) > MAX_KEY_LENGTH:
                return f"field too long: {name} (at most {MAX_KEY_LENGTH} characters)"
        return None

    def orders_of(self, body: dict[str, Any]) -> tuple[OrderRef, ...]:
        """The order it names, of whichever kind: its name is read (and may be kept)."""
        return (OrderRef(None, body["order_number"]),)

    def job_payload(self, ctx: EngineContext, tx: Transaction,
                    body: dict[str, Any]) -> dict[str, Any]:
        """The job's payload: the required fields and the fixed ones."""
        return {**{name: body[name] for name in self.fields}, **self.job_constants}

    def __call__(self, ctx: EngineContext, body: dict[str, Any], tx: Transaction) -> None:
        """Handle the call: history when a later change of its document was handled first
        (recorded and told: handled now, it would send its effects after the later
        change's); when its workflow log says the document has left the state, as
        `left_rule` says; else keep the order's name, ask for the workflow action and the
        job."""
        newer = tx.overtaken_by
        if newer is not None:
            self.record_only(ctx, body, tx, f"older than the state change handled as event "
                             f"#{newer.id} ({newer.event_type})")
            return
        if body.get("left_for") and self.left_rule == TOLD:
            self.record_only(ctx, body, tx, f"the document had left for "
                             f"{body['left_for']!r} when it was found")
            return
        remember_order_name(ctx, tx, body["order_number"], body["order_name"])
        if self.workflow_action:
            tx.workflow_action("workflow_doctype", body["order_name"],
                               self.workflow_action, purpose=self.workflow_action,
                               order_number=body["order_number"])
        if self.job:
            tx.job(self.job, self.job_payload(ctx, tx, body), purpose=self.job)

    def record_only(self, ctx: EngineContext, body: dict[str, Any], tx: Transaction,
                    why: str) -> None:
        """Kept, not acted on: handling a change the document is past would send what no
        longer applies, or re-order what went out. The administrator hears of a path
        that sends something, once per change."""
        reason = f"{why}: recorded, {self.effects_named()} not sent"
        tx.record_only(reason)
        if self.workflow_action or self.job:
            event = tx.event
            assert event is not None, "a workflow webhook is handled as a stored event"
            tell_admin(ctx, f"workflow-not-handled-{stable_key(event.source, event.dedup_key)}",
                       f"{self.path} of {body['order_name']} not handled",
                       "workflow_not_handled", path=self.path, body=body, reason=reason)


__all__ = ["WorkflowWebhook", "workflow_webhook", "ORDER_FIELDS"]
