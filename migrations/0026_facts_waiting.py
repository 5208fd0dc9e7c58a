"""A card fact whose order is not known yet waits (status `waiting`) with the ids that will
find it (models.WebhookEvent.waiting_for): one nullable column, one quick ALTER on a large
table, and the partial index of the waiting events, empty until one waits."""
from peewee import TextField

from migrations import add_column_if_missing
from models import WebhookEvent


def apply(db, migrator):
    add_column_if_missing(db, migrator, "webhook_events", "waiting_for", TextField(null=True))
    with db.bind_ctx([WebhookEvent]):
        db.create_tables([WebhookEvent], safe=True)
