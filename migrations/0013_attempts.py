"""Every send attempt of an outbox row kept (models.Attempt): the outbox's last_* columns,
the attempts table, and the trigger that copies each attempt into it from the UPDATE that
records its outcome. A no-op where all three are there already."""
from peewee import IntegerField, TextField

from migrations import add_column_if_missing
from models import ATTEMPT_MODELS, ATTEMPT_TRIGGER, UTCDateTimeField, is_postgres

COLUMNS = (("last_attempt_at", UTCDateTimeField(null=True)),
           ("last_status_code", IntegerField(null=True)),
           ("last_duration_ms", IntegerField(null=True)),
           ("last_reply", TextField(null=True)))

def apply(db, migrator):
    for name, field in COLUMNS:
        add_column_if_missing(db, migrator, "outbox", name, field)
    with db.bind_ctx(ATTEMPT_MODELS):
        db.create_tables(ATTEMPT_MODELS, safe=True)
    for statement in ATTEMPT_TRIGGER["postgres" if is_postgres(db) else "sqlite"]:
        db.execute_sql(statement)
