"""PAID: the invoice is fully paid; record the receipt and complete the order's payment."""
from plugins.registry import crypto_status
from domain import treasury


@crypto_status("PAID")
def handle(ctx, callback, effects):
    treasury.receive_payment(ctx, callback, effects)
