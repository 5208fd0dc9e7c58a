"""An order's unfinished events in arrival order: a partial index for the inbox's rule that
an event is handled only once every earlier event of its order is finished
(models.WebhookEvent)."""
from models import WebhookEvent


def apply(db, migrator):
    with db.bind_ctx([WebhookEvent]):
        db.create_tables([WebhookEvent], safe=True)
