"""Schema migrations, applied in name order by `receiver.py migrate` and at start-up.

Each module NNNN_name.py defines `apply(db, migrator)`. 0001 creates every table in its
current shape; every later migration must be a no-op where its change is already there
(use `add_column_if_missing`, `create_tables(..., safe=True)`), so a fresh database and
an old one end up the same. Applied names are recorded in `schema_migrations`.

A migration keeps its name once released, except through RENAMED: a database that recorded
an old name has that migration applied under its new one, and records the new name the
next time it is migrated.
"""
import importlib
import logging
import pkgutil
import zlib

from peewee import Database, Field, Model, TextField
from playhouse.migrate import PostgresqlMigrator, SchemaMigrator, SqliteMigrator

from models import UTCDateTimeField, is_postgres, utcnow

log = logging.getLogger("receiver.migrate")

# Several processes may start at once on one PostgreSQL; one migrates, the others wait.
MIGRATION_LOCK_ID = zlib.crc32(b"receiver.migrations")

# Old name -> new name. Three migrations were numbered 0014; two took numbers of their own
# after the last. Each of the two is independent of the migrations it now follows (it adds
# columns of crtc_orders, or rewrites ledger keys no later migration reads), so a database
# from before them ends up the same in the new order.
RENAMED = {
    "0014_ledger_keys_per_order": "0021_ledger_keys_per_order",
    "0014_settlement_refusals": "0023_settlement_refusals",
}


class SchemaMigration(Model):
    name = TextField(primary_key=True)
    applied_at = UTCDateTimeField(default=utcnow)

    class Meta:
        table_name = "schema_migrations"


def available() -> list[str]:
    return sorted(
        info.name for info in pkgutil.iter_modules(__path__)
        if info.name[:4].isdigit())


def applied(db: Database) -> set[str]:
    """The names of the migrations applied to `db`, a renamed one under its new name."""
    with db.bind_ctx([SchemaMigration]):
        if not SchemaMigration.table_exists():
            return set()
        return {RENAMED.get(row.name, row.name) for row in SchemaMigration.select()}


def pending(db: Database) -> list[str]:
    """The migrations not applied to `db` yet, in order: all of them on an empty one."""
    done = applied(db)
    return [name for name in available() if name not in done]


def add_column_if_missing(db: Database, migrator: SchemaMigrator, table: str, name: str,
                          field: Field) -> None:
    from playhouse.migrate import migrate as run
    if name not in {column.name for column in db.get_columns(table)}:
        run(migrator.add_column(table, name, field))


def migrate(db: Database) -> list[str]:
    """Apply every migration not yet applied; return the names applied now. A migration
    recorded under its old name (RENAMED) is not applied again: its record takes the new
    name."""
    migrator = PostgresqlMigrator(db) if is_postgres(db) else SqliteMigrator(db)
    applied_now = []
    with db.bind_ctx([SchemaMigration]):
        with db.atomic():
            if is_postgres(db):
                db.execute_sql("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_ID,))
            db.create_tables([SchemaMigration], safe=True)
            _record_new_names()
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


def _record_new_names() -> None:
    recorded = {row.name for row in SchemaMigration.select()}
    for old, new in RENAMED.items():
        if old not in recorded:
            continue
        if new in recorded:
            SchemaMigration.delete().where(SchemaMigration.name == old).execute()
        else:
            SchemaMigration.update(name=new).where(SchemaMigration.name == old).execute()
