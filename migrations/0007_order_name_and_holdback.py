"""The workflow document name on every order, and the commission holdback of CRTC orders."""
from peewee import TextField

from migrations import add_column_if_missing
from models import UTCDateTimeField

ORDER_TABLES = ("formation_orders", "compliance_orders", "bundle_orders", "crtc_orders")
HOLDBACK_TIMES = ("delivered_at", "holdback_ends_at", "commission_released_at",
                  "commission_forfeited_at")


def apply(db, migrator):
    for table in ORDER_TABLES:
        add_column_if_missing(db, migrator, table, "order_name", TextField(null=True))
    for column in HOLDBACK_TIMES:
        add_column_if_missing(db, migrator, "crtc_orders", column, UTCDateTimeField(null=True))
    add_column_if_missing(db, migrator, "crtc_orders", "commission_forfeit_reason",
                          TextField(null=True))
