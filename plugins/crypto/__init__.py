"""One module per crypto-processor (SHKeeper) invoice status (SPEC.md 4.3)."""
