"""One module per workflow-system webhook path (BEHAVIOUR.md 4.1). Each declares the path, the
fields it requires, the workflow action it applies, the job it dispatches and the action
it answers with; `WorkflowWebhook` does the rest."""
from plugins.registry import workflow_webhook
from domain.orders import remember_order_name
from engine.inbox import MAX_KEY_LENGTH

ORDER_FIELDS = ("order_name", "order_number")


class WorkflowWebhook:
    path = None
    fields = ORDER_FIELDS          # required, non-empty strings; also the job's payload
    workflow_action = None         # applied to the order in the workflow system, if any
    job = None                     # the worker job dispatched, if any
    job_constants = {}             # fixed payload fields added to the job
    answer = None                  # the `action` of the acknowledgement

    def field_error(self, body):
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

    def job_payload(self, ctx, body):
        return {**{name: body[name] for name in self.fields}, **self.job_constants}

    def __call__(self, ctx, body, effects):
        remember_order_name(ctx, body["order_number"], body["order_name"])
        if self.workflow_action:
            effects.workflow_action("workflow_doctype", body["order_name"],
                                    self.workflow_action, purpose=self.workflow_action,
                                    order_number=body["order_number"])
        if self.job:
            effects.job(self.job, self.job_payload(ctx, body), purpose=self.job)


__all__ = ["WorkflowWebhook", "workflow_webhook", "ORDER_FIELDS"]
