"""OVERPAID: more than the invoice arrived; handled exactly like a full payment."""
from plugins.registry import crypto_status
from domain import treasury


@crypto_status("OVERPAID")
def handle(ctx, callback, effects):
    treasury.receive_payment(ctx, callback, effects)
