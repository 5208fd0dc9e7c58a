"""Schema migrations, applied in name order by `receiver.py migrate` and at start-up.

Each module NNNN_name.py defines `apply(db, migrator)`. 0001 creates every table in its
current shape; every later migration must be a no-op where its change is already there
(use `add_column_if_missing`, `create_tables(..., safe=True)`), so a fresh database and
an old one end up the same. Applied names are recorded in `schema_migrations`.
"""
import importlib
import logging
import pkgutil
import zlib

from peewee import Model, TextField
from playhouse.migrate import PostgresqlMigrator, SqliteMigrator

from models import UTCDateTimeField, is_postgres, utcnow

log = logging.getLogger("receiver.migrate")

# Several processes may start at once on one PostgreSQL; one migrates, the others wait.
MIGRATION_LOCK_ID = zlib.crc32(b"receiver.migrations")


class SchemaMigration(Model):
    name = TextField(primary_key=True)
    applied_at = UTCDateTimeField(default=utcnow)

    class Meta:
        table_name = "schema_migrations"


def available():
    return sorted(
        info.name for info in pkgutil.iter_modules(__path__)
        if info.name[:4].isdigit())


def pending(db):
    """The migrations not applied to `db` yet, in order: all of them on an empty one."""
    with db.bind_ctx([SchemaMigration]):
        if not SchemaMigration.table_exists():
            return available()
        done = {row.name for row in SchemaMigration.select()}
    return [name for name in available() if name not in done]


def add_column_if_missing(db, migrator, table, name, field):
    from playhouse.migrate import migrate as run
    if name not in {column.name for column in db.get_columns(table)}:
        run(migrator.add_column(table, name, field))


def migrate(db):
    """Apply every migration not yet applied; return the names applied now."""
    migrator = PostgresqlMigrator(db) if is_postgres(db) else SqliteMigrator(db)
    applied_now = []
    with db.bind_ctx([SchemaMigration]):
        with db.atomic():
            if is_postgres(db):
                db.execute_sql("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_ID,))
            db.create_tables([SchemaMigration], safe=True)
            done = {row.name for row in SchemaMigration.select()}
            for name in available():
                if name in done:
                    continue
                module = importlib.import_module(f"{__name__}.{name}")
                module.apply(db, migrator)
                SchemaMigration.create(name=name)
                applied_now.append(name)
                log.info("applied migration %s", name)
    return applied_now
