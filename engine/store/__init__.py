"""What a transaction reads and writes, one mixin of `engine.transaction.Transaction` per
part of the business: each method is one thing the business asks of the database, named
for it, typed, and run in the caller's unit of work (engine.commits) in the database
thread. How it is done (statements prepared once, rows read ahead for the turn, writes
held for the next statement, several statements in one round trip) stays here: the
domain and the plugins see the method, not the machinery."""
