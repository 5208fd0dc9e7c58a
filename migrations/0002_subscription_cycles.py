"""The numbering of paid subscription renewals (card processor, invoice.paid)."""
from models import CARD_MODELS


def apply(db, migrator):
    with db.bind_ctx(CARD_MODELS):
        db.create_tables(CARD_MODELS, safe=True)
