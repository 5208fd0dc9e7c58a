#!/usr/bin/env python3
"""The order-fulfilment webhook receiver's entry point; the commands are in app/cli.py.

    python receiver.py            # same as `serve`
    python receiver.py serve      # apply migrations, then listen on RECEIVER_HOST:RECEIVER_PORT
    python receiver.py migrate    # apply migrations and exit
    python receiver.py events list|show|replay, outbox list|retry, settle, backfill
                                  # the operator's commands (each has --help)

Settings come from the environment (see README.md). The operator's commands open the
database from DATABASE_URL and never start the HTTP server. Exit codes: 0 done, 1 not
done (not found, refused, failed, database unavailable), 2 bad usage or settings.
"""
import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
