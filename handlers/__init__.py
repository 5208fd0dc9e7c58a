"""HTTP: one handler per kind of endpoint. Authentication, parsing, answers and rate
limits; what an event means lives in plugins/ and domain/.

Imports: plugins, the domain, the engine, ops, clients, models, settings. Never app."""
