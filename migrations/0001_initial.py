"""The tables other systems rely on: four order kinds, treasury, ledger, inbox and outbox."""
from models import ALL_MODELS


def apply(db, migrator):
    with db.bind_ctx(ALL_MODELS):
        db.create_tables(ALL_MODELS, safe=True)
