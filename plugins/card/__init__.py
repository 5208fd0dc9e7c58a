"""One module per card-processor (Stripe) event type (SPEC.md 4.2)."""
