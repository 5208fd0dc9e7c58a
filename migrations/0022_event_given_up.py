"""Who gave an event up, when and why (an operator's give-up: ops.operator.give_up_events):
three nullable columns on webhook_events, each one quick ALTER on a large table, and the
partial index of the events given up (models.WebhookEvent), empty until one is."""
from peewee import TextField

from migrations import add_column_if_missing
from models import UTCDateTimeField, WebhookEvent


def apply(db, migrator):
    for name, field in (("given_up_by", TextField(null=True)),
                        ("given_up_at", UTCDateTimeField(null=True)),
                        ("given_up_reason", TextField(null=True))):
        add_column_if_missing(db, migrator, "webhook_events", name, field)
    with db.bind_ctx([WebhookEvent]):
        db.create_tables([WebhookEvent], safe=True)
