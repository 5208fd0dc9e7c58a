"""PAID: the invoice is fully paid; record the receipt and complete the order's payment."""
from plugins.registry import crypto_status, reads_ahead
from domain import treasury


@crypto_status("PAID")
@reads_ahead(treasury.read_ahead)
def handle(ctx, callback, effects):
    treasury.receive_payment(ctx, callback, effects)
