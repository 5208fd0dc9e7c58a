"""Crypto payments: the treasury job and its ledger entries."""


class TreasuryStore:
    """Crypto payments, in the caller's transaction."""
