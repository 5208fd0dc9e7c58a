"""`unconfirmed`: SHKeeper saw a transaction that is not confirmed yet; kept and logged."""
from plugins.registry import crypto_status
from domain import treasury


@crypto_status("unconfirmed")
def handle(ctx, callback, effects):
    treasury.log_notice(ctx, callback, effects)
