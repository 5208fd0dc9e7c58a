"""Database-level defaults on the NOT NULL columns of the four order tables.

Other systems insert orders with plain SQL naming only some columns; peewee's
defaults exist only in Python, so such an insert failed on created_at (and on
intake_reminders_sent, which 0005 added without one). models.py now declares the defaults,
so 0001 gives them to a fresh database; this adds them where a table predates that. A
column that already has a default is left alone, so the migration is a no-op on a fresh
database.
"""
from playhouse.migrate import migrate as run

from models import is_postgres

COMMON = {"created_at": "CURRENT_TIMESTAMP", "updated_at": "CURRENT_TIMESTAMP",
          "payment_status": "'pending_payment'", "notes": "''"}
DEFAULTS = {
    "formation_orders": COMMON,
    "compliance_orders": {**COMMON, "intake_reminders_sent": "0"},
    "bundle_orders": COMMON,
    "crtc_orders": {**COMMON, "funds_available": "FALSE"},
}


def apply(db, migrator):
    for table, defaults in DEFAULTS.items():
        present = {column.name for column in db.get_columns(table)
                   if column.default is not None}
        for column, sql in defaults.items():
            if column in present:
                continue
            if is_postgres(db):
                db.execute_sql(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" SET DEFAULT {sql}')
            else:
                # SQLite cannot alter a column: peewee rebuilds the table, copying its rows
                # and indexes. Parenthesised, the default is taken as an expression, not
                # quoted as a string literal.
                run(migrator.add_column_default(table, column, f"({sql})"))
