"""OVERPAID: more than the invoice arrived; handled exactly like a full payment."""
from plugins.registry import crypto_status, reads_ahead
from domain import treasury


@crypto_status("OVERPAID")
@reads_ahead(treasury.read_ahead)
def handle(ctx, callback, effects):
    treasury.receive_payment(ctx, callback, effects)
