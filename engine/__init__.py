"""The durable delivery engine: what any webhook receiver needs, nothing about orders.

Here: the inbox (store an accepted call once, under its dedup key, and hand it to its
plugin), the outbox (effects on other systems, written with their cause and sent with
retries), group commit, prepared statements, claims and leases across processes, the
spool for a database that is down, database helpers and retention.

Imports: clients, models, settings. Never the domain, plugins, handlers, ops or app: a
plugin reaches the engine through the context it is given (`ctx.plugins`)."""
