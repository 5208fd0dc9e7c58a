"""The reminders sent (IFTA, UCR and the consolidated reminder e-mail), keyed."""
from models import REMINDER_MODELS


def apply(db, migrator):
    with db.bind_ctx(REMINDER_MODELS):
        db.create_tables(REMINDER_MODELS, safe=True)
