#!/usr/bin/env python3
"""The order-fulfilment webhook receiver: entry point, application factory and CLI.

    python receiver.py            # same as `serve`
    python receiver.py serve      # apply migrations, then listen on RECEIVER_HOST:RECEIVER_PORT
    python receiver.py migrate    # apply migrations and exit

Settings come from the environment (see README.md).
"""
import argparse
import asyncio
import json
import logging
import signal
import sys

import tornado.httpserver
import tornado.web

import migrations
from handlers.base import NotFoundHandler, log_request
from handlers.routes import routes
from models import open_database
from plugins import registries
from services.context import Context
from settings import ConfigurationError, Settings

log = logging.getLogger("receiver")


def make_app(ctx):
    registries()
    return tornado.web.Application(
        routes(ctx),
        default_handler_class=NotFoundHandler,
        default_handler_args={"ctx": ctx},
        log_function=log_request,
        compress_response=False,
    )


def make_server(app, settings):
    return tornado.httpserver.HTTPServer(
        app,
        xheaders=True,
        # The handlers refuse oversize bodies with 413 from their Content-Length; this
        # cuts off a chunked body that keeps going.
        max_body_size=settings.max_body_bytes,
        idle_connection_timeout=60,
        body_timeout=30,
    )


class JsonLogFormatter(logging.Formatter):
    def format(self, record):
        entry = {"time": self.formatTime(record), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(settings):
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


async def serve(settings):
    db = open_database(settings.database_url)
    applied = migrations.migrate(db)
    if applied:
        log.info("migrations applied: %s", ", ".join(applied))
    settings.warn_about_placeholders()
    ctx = Context.create(settings)
    server = make_server(make_app(ctx), settings)
    server.listen(settings.port, settings.host)
    log.info("listening on http://%s:%d", settings.host, settings.port)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()

    log.info("stopping: no new connections; finishing requests in flight")
    server.stop()
    await server.close_all_connections()
    await ctx.drain_background()
    db.close()
    log.info("stopped")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="receiver.py",
        description="Order-fulfilment webhook receiver. Settings come from the environment.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="apply migrations, then serve (the default)")
    commands.add_parser("migrate", help="apply pending database migrations and exit")
    args = parser.parse_args(argv)

    try:
        settings = Settings.from_env()
    except ConfigurationError as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)

    if args.command == "migrate":
        applied = migrations.migrate(open_database(settings.database_url))
        print("applied: " + ", ".join(applied) if applied else "schema is up to date")
        return 0
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
