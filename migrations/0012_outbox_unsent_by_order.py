"""The outbox's unsent rows by order and kind: a partial index that answers "is an
earlier effect of this order still unsent?" in one probe (models.Outbox)."""
from models import Outbox


def apply(db, migrator):
    with db.bind_ctx([Outbox]):
        db.create_tables([Outbox], safe=True)
