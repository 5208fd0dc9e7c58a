"""One module per card-processor (Stripe) event type (BEHAVIOUR.md 4.2)."""
