"""The business's rules: what this company does with orders, payments and filings.

Here: completing a payment and marking one failed or disputed, the treasury and ledger of
crypto payments, CRTC settlement, card-event lookups, signed "I already filed" links,
reminders and the Stripe backfill.

Imports: the engine, clients, models, settings. Never plugins, handlers, ops or app."""
