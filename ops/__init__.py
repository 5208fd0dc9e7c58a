"""Operations: what the operator sees and does. Metrics, systemd's notifications and the
queries behind the operator's commands.

Imports: the domain, the engine, clients, models, settings. Never handlers or app; the
handlers and the command line call into it."""
