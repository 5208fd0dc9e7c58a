"""Filings: what a customer filed themselves, fulfilment, the commission holdback."""


class FilingStore:
    """Filings, in the caller's transaction."""
