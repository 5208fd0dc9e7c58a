"""Filings and what a customer tells us: intake, self-filings, reminders sent, links."""


class FilingStore:
    """Filings and what a customer tells us, in the caller's transaction."""
