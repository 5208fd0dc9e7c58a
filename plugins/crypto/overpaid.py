"""OVERPAID: more than the invoice arrived; handled exactly like a full payment."""
from plugins.registry import crypto_status, with_orders
from domain import treasury


@crypto_status("OVERPAID")
@with_orders(treasury.orders_of)
def handle(ctx, callback, effects):
    treasury.receive_payment(ctx, callback, effects)
