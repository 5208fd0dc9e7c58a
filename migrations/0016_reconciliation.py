"""Reconciliation with the workflow system: the inbox's `reconciled` flag, and where each
doctype's reconciliation got to."""
from peewee import BooleanField

from migrations import add_column_if_missing
from models import RECONCILE_MODELS, database_default


def apply(db, migrator):
    add_column_if_missing(db, migrator, "webhook_events", "reconciled", BooleanField(
        default=False, null=True, constraints=database_default("FALSE")))
    with db.bind_ctx(RECONCILE_MODELS):
        db.create_tables(RECONCILE_MODELS, safe=True)
