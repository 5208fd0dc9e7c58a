"""The operator console: its record of operator actions, and the indexes its event and
outbox lists page through (created where missing; 0001 creates them on a fresh database)."""
from models import CONSOLE_MODELS, Outbox, WebhookEvent

MODELS = [WebhookEvent, Outbox, *CONSOLE_MODELS]


def apply(db, migrator):
    # create_tables(safe=True) creates what is missing, tables and indexes alike
    # (CREATE ... IF NOT EXISTS), and leaves existing ones as they are.
    with db.bind_ctx(MODELS):
        db.create_tables(MODELS, safe=True)
