"""PARTIAL: part of the invoice arrived; kept and logged, the order waits for the rest."""
from plugins.registry import crypto_status
from domain import treasury


@crypto_status("PARTIAL")
def handle(ctx, callback, effects):
    treasury.log_notice(ctx, callback, effects)
