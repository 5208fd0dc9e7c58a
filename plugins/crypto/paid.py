"""PAID: the invoice is fully paid; record the receipt and complete the order's payment."""
from plugins.registry import crypto_status, with_orders
from domain import treasury


@crypto_status("PAID")
@with_orders(treasury.orders_of)
def handle(ctx, callback, effects):
    treasury.receive_payment(ctx, callback, effects)
