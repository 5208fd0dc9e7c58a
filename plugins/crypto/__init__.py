"""One module per crypto-processor (SHKeeper) invoice status (BEHAVIOUR.md 4.3)."""
