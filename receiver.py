#!/usr/bin/env python3
"""The order-fulfilment webhook receiver's entry point; the commands are in app/cli.py.

    .venv/bin/python receiver.py          # same as `serve`
    .venv/bin/python receiver.py serve    # apply migrations, listen on RECEIVER_HOST:RECEIVER_PORT
    .venv/bin/python receiver.py migrate  # apply migrations and exit
    .venv/bin/python receiver.py events list|show|replay, outbox list|retry, settle, backfill,
                                          # link: the operator's commands (each has --help)

Settings come from the environment (docs/SETTINGS.md). The operator's commands open the
database from DATABASE_URL and never start the HTTP server. Exit codes: 0 done, 1 not
done (not found, refused, failed, database unavailable), 2 bad usage or settings.
"""
import sys

try:
    from app.cli import main
except ModuleNotFoundError as missing:
    # Run by a Python without the service's packages (the system's, not .venv's).
    print(f"receiver: {missing}: run `make run` once (it installs them into .venv), then "
          "`.venv/bin/python receiver.py ...`", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
