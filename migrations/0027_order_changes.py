"""An order's history: every change of an order, who made it, when, and the values before
and after (models.OrderChange), in a table of its own; nothing of the order tables
changes."""
from models import HISTORY_MODELS


def apply(db, migrator):
    with db.bind_ctx(HISTORY_MODELS):
        db.create_tables(HISTORY_MODELS, safe=True)
