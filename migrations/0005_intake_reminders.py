"""Intake reminders: how many each compliance order has had, and when the last went out."""
from peewee import IntegerField

from models import UTCDateTimeField
from migrations import add_column_if_missing


def apply(db, migrator):
    add_column_if_missing(db, migrator, "compliance_orders", "intake_reminders_sent",
                          IntegerField(default=0))
    add_column_if_missing(db, migrator, "compliance_orders", "intake_reminded_at",
                          UTCDateTimeField(null=True))
