"""Every send attempt of an outbox row kept (models.Attempt): the outbox's last_* columns,
the attempts table, and the trigger that copies each attempt into it from the UPDATE that
records its outcome. A no-op where all three are there already."""
from peewee import IntegerField, TextField

from migrations import add_column_if_missing
from models import ATTEMPT_MODELS, UTCDateTimeField, is_postgres

COLUMNS = (("last_attempt_at", UTCDateTimeField(null=True)),
           ("last_status_code", IntegerField(null=True)),
           ("last_duration_ms", IntegerField(null=True)),
           ("last_reply", TextField(null=True)))
# An UPDATE that counts one more attempt is one attempt made (a retry put back in line
# sets the count to 0; a row waiting for its destination's configuration keeps it).
COPIED = ("(outbox_id, destination, attempted_at, outcome, status_code, duration_ms, "
          "error, reply, created_at, updated_at) VALUES (NEW.id, NEW.kind, "
          "COALESCE(NEW.last_attempt_at, NEW.updated_at), NEW.status, NEW.last_status_code, "
          "NEW.last_duration_ms, NEW.last_error, NEW.last_reply, NEW.updated_at, "
          "NEW.updated_at)")
POSTGRES_TRIGGER = (
    "CREATE OR REPLACE FUNCTION outbox_attempt() RETURNS trigger LANGUAGE plpgsql AS $$ "
    f"BEGIN INSERT INTO attempts {COPIED}; RETURN NULL; END $$",
    "DROP TRIGGER IF EXISTS outbox_attempt ON outbox",
    "CREATE TRIGGER outbox_attempt AFTER UPDATE ON outbox FOR EACH ROW "
    "WHEN (NEW.attempts > OLD.attempts) EXECUTE FUNCTION outbox_attempt()",
)
SQLITE_TRIGGER = (
    "CREATE TRIGGER IF NOT EXISTS outbox_attempt AFTER UPDATE OF attempts ON outbox "
    f"FOR EACH ROW WHEN NEW.attempts > OLD.attempts BEGIN INSERT INTO attempts {COPIED}; END",
)


def apply(db, migrator):
    for name, field in COLUMNS:
        add_column_if_missing(db, migrator, "outbox", name, field)
    with db.bind_ctx(ATTEMPT_MODELS):
        db.create_tables(ATTEMPT_MODELS, safe=True)
    for statement in POSTGRES_TRIGGER if is_postgres(db) else SQLITE_TRIGGER:
        db.execute_sql(statement)
