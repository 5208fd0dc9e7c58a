"""Shared mechanics: the context plugins receive, the inbox, the outbox, order operations."""
