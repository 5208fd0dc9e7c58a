"""CRTC orders name the currency of their amounts: `currency` (ISO 4217, default USD),
beside total_cents and amb_annual_price_cents, which the shop sets through the orders
API (docs/ORDERS.md). Orders from before were all priced in USD and get it."""
from peewee import TextField

from migrations import add_column_if_missing
from models import database_default


def apply(db, migrator):
    add_column_if_missing(db, migrator, "crtc_orders", "currency", TextField(
        default="USD", constraints=database_default("'USD'")))
