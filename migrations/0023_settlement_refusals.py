"""How often Frappe refused a CRTC order's funds action, and when it last did: a refused
order goes to the back of the settlement batch."""
from peewee import IntegerField

from migrations import add_column_if_missing
from models import UTCDateTimeField, database_default


def apply(db, migrator):
    add_column_if_missing(db, migrator, "crtc_orders", "funds_refusals",
                          IntegerField(default=0, constraints=database_default("0")))
    add_column_if_missing(db, migrator, "crtc_orders", "funds_refused_at",
                          UTCDateTimeField(null=True))
