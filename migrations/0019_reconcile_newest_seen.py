"""Reconciliation reads each document's workflow log: per doctype, the newest `modified`
a run saw in Frappe, so a run that lists nothing while Frappe's documents change says so
(its window and Frappe's times do not meet)."""
from peewee import TextField

from migrations import add_column_if_missing


def apply(db, migrator):
    add_column_if_missing(db, migrator, "reconcile_runs", "newest_seen", TextField(null=True))
