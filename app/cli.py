"""The command line: `serve`, `migrate`, `link` and the operator's commands.

Plain text on stdout, problems on stderr, an exit code: 0 done, 1 not done (not found,
refused, failed, database unavailable), 2 bad usage or settings.

Longer than most because the commands are many, one small function each."""
import argparse
import asyncio
import datetime
import functools
import getpass
import json
import os
import sys
from typing import Any, Awaitable, Callable, Coroutine, Iterable, Sequence, TextIO, TypeAlias

import stripe

import migrations
import scheduler
from app import VERSION
from app.context import Context
from app.logs import configure_logging
from app.progress import TerminalProgress
from app.server import CannotStart, Database, refused_database_settings, serve
from clients.stripe_api import NotConfigured
from domain import backfill, filings, holdback, intake, links, reconcile, reminders, settlement
from engine import inbox, spool
from engine.db import UNAVAILABLE, refused_settings
from engine.payload import read_json
from engine.connection import open_database, sqlite_file
from engine.transaction import Transaction
from models import Outbox, WebhookEvent
from ops import console, operator, passwords, sessions
from settings import ConfigurationError, Settings

# What argparse's add_subparsers gives: where commands (or a command's actions) are added.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
# An operator's command: run with the context and its parsed arguments; its exit status.
Command: TypeAlias = Callable[[Context, argparse.Namespace], Awaitable[int]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="receiver.py",
        description="Order-fulfilment webhook receiver. Settings come from the environment.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="apply migrations, then serve (the default)")
    commands.add_parser("migrate", help="apply pending database migrations and exit")
    link = commands.add_parser("link", help="print a signed 'I already filed' link")
    link.add_argument("kind", choices=links.KINDS)
    link.add_argument("order", help="order number (a compliance order of that kind)")
    link.add_argument("cycle", help="filing period: 2026-Q3 (IFTA) or 2027 (UCR)")
    link.set_defaults(run=sign_link)
    demo = commands.add_parser(
        "demo", help="serve sample orders with stand-ins for the worker, Frappe, Telegram and "
                     "SMTP, in a database of its own, and print commands to try")
    demo.add_argument("--folder", default="var/demo",
                      help="where the demo keeps its database, made afresh (var/demo)")
    add_operator_commands(commands)
    console = commands.add_parser("console", help="the operator console").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    console.add_parser(
        "hash-password", help="read a password (twice) and print the CONSOLE_PASSWORD_HASH "
                              "that lets it log in")
    console.add_parser("logout-all", help="end every console session (a copied cookie "
                                          "included); everyone logs in again").set_defaults(
        run=console_logout_all)
    parser.set_defaults(run=None)
    args = parser.parse_args(argv)
    if args.command == "demo":
        # Imported only here: its stand-ins need aiosmtpd, a development requirement. It
        # reads no setting but where to listen, so a bad one elsewhere does not stop it.
        from app import demo as demo_service
        return run_until_stopped(demo_service.run(os.environ, args.folder))

    if args.command == "console" and args.action == "hash-password":
        # Needs no settings: it is how one of them is made.
        return hash_password_command(sys.stdin, sys.stdout, sys.stderr)
    try:
        settings = Settings.from_env()
    except ConfigurationError as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)

    if args.command == "link":
        # A malformed link is bad usage, found before the database is opened.
        try:
            filings.check_link_parts(args.kind, args.order, args.cycle)
        except links.InvalidLinkPart as exc:
            print(f"receiver: {exc}", file=sys.stderr)
            return 2
    if args.command == "migrate":
        try:
            applied = migrations.migrate(open_database(settings.database_url))
        except UNAVAILABLE as exc:
            return database_unavailable(exc)
        print("applied: " + ", ".join(applied) if applied else "schema is up to date")
        return 0
    if args.run:
        return run_operator_command(args.run, settings, args)
    return run_until_stopped(serve(settings))


def run_until_stopped(serving: Coroutine[Any, Any, None]) -> int:
    """Run `serve` (or the demo) to its end; a start that fails is one line, not a
    traceback, and exit 1 or 2."""
    try:
        asyncio.run(serving)
    except UNAVAILABLE as exc:
        return database_unavailable(exc)
    except CannotStart as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return exc.status
    return 0


def hash_password_command(stdin: TextIO, out: TextIO, err: TextIO) -> int:
    """Ask twice without echo at a terminal; read two lines when piped, so it can be
    scripted (`printf '%s\\n%s\\n' "$pw" "$pw" | receiver.py console hash-password`)."""
    if stdin.isatty():
        try:
            first = getpass.getpass(f"Console password ({passwords.MIN_PASSWORD_LENGTH} "
                                    "characters or more): ")
            second = getpass.getpass("Again: ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C: the operator gave up
            print("\nreceiver: no password given; nothing printed", file=err)
            return 1
    else:
        first, second = (stdin.readline().rstrip("\r\n") for _ in range(2))
    if first != second:
        print("receiver: the two passwords differ; nothing printed", file=err)
        return 2
    try:
        print(passwords.hash_password(first), file=out)
    except passwords.WeakPassword as exc:
        print(f"receiver: {exc}", file=err)
        return 2
    return 0


def add_operator_commands(commands: Commands) -> None:
    _add_event_commands(commands)
    _add_outbox_commands(commands)
    _add_spool_commands(commands)
    _add_money_and_reminder_commands(commands)
    _add_order_intake_commands(commands)


def _add_event_commands(commands: Commands) -> None:
    events = commands.add_parser(
        "events", help="list, show and replay stored webhook events").add_subparsers(
            dest="action", metavar="ACTION", required=True)
    _add_event_listing(events)
    _add_event_replay(events)
    _add_event_give_up(events)


def _add_event_listing(events: Commands) -> None:
    listing = events.add_parser("list", help="the newest events first, filtered")
    listing.add_argument("--source", choices=operator.EVENT_SOURCES)
    listing.add_argument("--status", choices=operator.EVENT_STATUSES)
    listing.add_argument("--since", type=time_argument,
                         help="received at or after (ISO 8601; UTC when no offset)")
    listing.add_argument("--until", type=time_argument, help="received before (ISO 8601)")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    listing.set_defaults(run=events_list)
    show = events.add_parser("show", help="one event: its payload and its outbox rows")
    show.add_argument("id", type=int)
    show.set_defaults(run=events_show)


def _add_event_replay(events: Commands) -> None:
    replay = events.add_parser(
        "replay", help="handle an event again (see docs/COMMANDS.md: what replay can redo)")
    which = replay.add_mutually_exclusive_group(required=True)
    which.add_argument("id", type=int, nargs="?", help="the event's id")
    which.add_argument("--failed", action="store_true",
                       help="every failed event, and every dead one (given up on)")
    replay.add_argument("--force", action="store_true",
                        help="also an event already processed (its effects are not "
                             "sent twice); a fact waiting for its order needs none")
    replay.set_defaults(run=events_replay)


def _add_event_give_up(events: Commands) -> None:
    give_up = events.add_parser(
        "give-up", help="give up events whose handling failed, or a fact waiting for an "
                        "order that will never come: dead and final, with your reason "
                        "(kept with each, and who and when)")
    which = give_up.add_mutually_exclusive_group(required=True)
    which.add_argument("id", type=int, nargs="?", help="the event's id")
    which.add_argument("--failed", action="store_true",
                       help="every event that failed or that its retries gave up, of "
                            "--source, --since and --until when given")
    give_up.add_argument("--reason", required=True, type=reason_argument,
                         help="why (up to 200 characters), kept with each event")
    give_up.add_argument("--source", choices=operator.EVENT_SOURCES)
    give_up.add_argument("--since", type=time_argument,
                         help="received at or after (ISO 8601; UTC when no offset)")
    give_up.add_argument("--until", type=time_argument, help="received before (ISO 8601)")
    give_up.set_defaults(run=events_give_up)


def _add_outbox_commands(commands: Commands) -> None:
    outbox = commands.add_parser(
        "outbox", help="list effects on other systems; put dead, waiting or pending ones "
                       "back in line, due now"
    ).add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = outbox.add_parser("list", help="the newest rows first")
    listing.add_argument("--status", choices=operator.OUTBOX_STATUSES)
    listing.add_argument("--destination", choices=operator.DESTINATIONS)
    listing.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    listing.set_defaults(run=outbox_list)
    retry = outbox.add_parser(
        "retry", help="back to pending, due now, attempts reset; the scheduler sends it")
    which = retry.add_mutually_exclusive_group(required=True)
    which.add_argument("id", type=int, nargs="?", help="the outbox row's id")
    which.add_argument("--dead", dest="status", action="store_const", const="dead",
                       help="every dead row (given up on)")
    which.add_argument("--waiting", dest="status", action="store_const", const="waiting",
                       help="every waiting row (its destination was not configured)")
    which.add_argument("--pending", dest="status", action="store_const", const="pending",
                       help="every pending row (waiting for its next try)")
    retry.add_argument("--destination", choices=operator.DESTINATIONS,
                       help="with --dead, --waiting or --pending: only the rows going there")
    retry.set_defaults(run=outbox_retry)


def _add_spool_commands(commands: Commands) -> None:
    spooled = commands.add_parser(
        "spool", help="calls kept in SPOOL_DIR while the database was down"
    ).add_subparsers(dest="action", metavar="ACTION", required=True)
    spooled.add_parser(
        "quarantined", help="spooled calls the database refused to store, with the reason"
    ).set_defaults(run=spool_quarantined)


def _add_money_and_reminder_commands(commands: Commands) -> None:
    commands.add_parser(
        "settle", help="run the CRTC settlement (balance.available routine) once now"
    ).set_defaults(run=settle)
    add_command_group(commands, "holdback",
                      "the CRTC commission holdback: list it, release what is due", (
                          ("list", "orders in holdback, earliest release first",
                           holdback_list),
                          ("release", "release every commission whose holdback has ended, "
                                      "now (as the scheduler does hourly)", holdback_release)))
    add_command_group(commands, "reminders",
                      "customer reminders (intake, IFTA, UCR): list what is due, send it", (
                          ("list", "the reminders due today (BUSINESS_TZ), by customer",
                           reminders_list),
                          ("run", "send today's reminder e-mails now (as the scheduler does "
                                  "hourly); nothing is sent twice", reminders_run)))


def _add_order_intake_commands(commands: Commands) -> None:
    """The ways orders and their calls come in besides the webhooks: a file, Stripe's
    Events API, the reconciliation with Frappe."""
    orders = commands.add_parser(
        "orders", help="orders in from a file (docs/ORDERS.md)").add_subparsers(
            dest="action", metavar="ACTION", required=True)
    importing = orders.add_parser(
        "import", help="create or update the orders of a CSV file (header: kind,order_number,"
                       "<field>...) or a JSON-lines file; every row is checked, the good ones "
                       "stored, each bad one named by its line (exit 1)")
    importing.add_argument("file", help="the file; - for standard input")
    importing.add_argument("--amend-paid", action="store_true",
                           help="change a paid order's total_cents, amb_annual_price_cents "
                                "or currency as its row says (without it such a row is "
                                "refused, named by its line)")
    importing.add_argument("--dry-run", action="store_true",
                           help="check every row against the database as the import would, "
                                "say what it would do, and store nothing")
    importing.set_defaults(run=orders_import)
    fill = commands.add_parser(
        "backfill", help="fetch card events whose webhook delivery failed from Stripe's "
                         "Events API and handle them (idempotent)")
    fill.add_argument("--since", type=time_argument, required=True,
                      help="events created at or after (ISO 8601; Stripe keeps 30 days)")
    fill.set_defaults(run=backfill_events)
    reconciliation = commands.add_parser(
        "reconcile", help="find state changes whose webhook never came and handle them"
    ).add_subparsers(dest="action", metavar="ACTION", required=True)
    workflow = reconciliation.add_parser(
        "workflow", help="ask Frappe for documents in a state with a webhook path and "
                         "handle each change not stored yet (as the scheduler does)")
    workflow.add_argument("--since", type=time_argument,
                          help="documents modified at or after (ISO 8601; UTC when no "
                               "offset); default: where the last run got to")
    workflow.set_defaults(run=reconcile_workflow)


def add_command_group(commands: Commands, name: str, about: str,
                      actions: Iterable[tuple[str, str, Command]]) -> None:
    """A command whose actions take no arguments: (action, help, run) each."""
    group = commands.add_parser(name, help=about).add_subparsers(
        dest="action", metavar="ACTION", required=True)
    for action, about_action, run in actions:
        group.add_parser(action, help=about_action).set_defaults(run=run)


def reason_argument(text: str) -> str:
    reason = " ".join(text.split())
    if not reason or len(reason) > 200:
        raise argparse.ArgumentTypeError("give a reason of 1 to 200 characters")
    return reason


def time_argument(text: str) -> datetime.datetime:
    try:
        return operator.parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text!r} (e.g. 2026-11-20T08:00Z)") from None


def run_operator_command(command: Command, settings: Settings,
                         args: argparse.Namespace) -> int:
    try:
        db = open_migrated_database(settings.database_url)
    except CannotStart as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return exc.status
    except UNAVAILABLE as exc:
        return database_unavailable(exc)
    try:
        return asyncio.run(_with_context(command, settings, args))
    except (operator.NotFound, operator.Refused, filings.LinkRefused) as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return 1
    except NotConfigured as exc:
        print(f"receiver: {exc}", file=sys.stderr)
        return 2
    except UNAVAILABLE as exc:
        return database_unavailable(exc)
    finally:
        db.close()


def open_migrated_database(url: str) -> Database:
    """The database the operator's commands work on, made and brought up to date by
    `migrate`: a mistyped SQLite path is refused (exit 2), not created empty with its
    folders; a database behind the code's migrations is refused (exit 1)."""
    path = sqlite_file(url)
    if path is not None and not os.path.isfile(path):
        raise CannotStart(f"no database at {os.path.abspath(path)}: check DATABASE_URL "
                          "(`receiver.py migrate` creates one there)", 2)
    db = open_database(url)
    try:
        behind = migrations.pending(db)
    except UNAVAILABLE:
        db.close()
        raise
    if behind:
        db.close()
        raise CannotStart(f"the database is not up to date ({len(behind)} migration(s) not "
                          f"applied, from {behind[0]}): check DATABASE_URL, then run "
                          "`receiver.py migrate` (starting the service applies them too)", 1)
    return db


def database_unavailable(exc: Exception) -> int:
    """One line an operator can act on, not a traceback; exit 1 (not done)."""
    refused = refused_settings(exc)
    if refused is not None:
        print(f"receiver: {refused_database_settings(refused)}", file=sys.stderr)
        return 1
    print(f"receiver: database unavailable: {str(exc).strip().splitlines()[0]}; check "
          "DATABASE_URL and that the database server runs and accepts connections",
          file=sys.stderr)
    return 1


async def _with_context(command: Command, settings: Settings, args: argparse.Namespace) -> int:
    ctx = Context.create(settings)
    try:
        return await command(ctx, args)
    finally:
        await ctx.close()


EVENT_COLUMNS = ("ID", "RECEIVED (UTC)", "SOURCE", "TYPE", "STATUS", "TRIES", "ORDER",
                 "EXTERNAL ID", "LAST ERROR")
OUTBOX_COLUMNS = ("ID", "EVENT", "DESTINATION", "ORDER", "STATUS", "TRIES", "NEXT TRY (UTC)",
                  "LAST ERROR")


def event_row(event: WebhookEvent) -> tuple[object, ...]:
    status = f"{event.status} (given up)" if event.given_up_at else event.status
    return (event.id, operator.format_time(event.received_at), operator.source_of(event),
            event.event_type, "held" if event.held else status, event.attempts,
            event.order_number, event.external_id,
            operator.clip(event.held or event.last_error))


def outbox_row(row: Outbox) -> tuple[object, ...]:
    next_try = operator.format_time(row.next_attempt_at) if row.status == "pending" else ""
    return (row.id, row.event_id, operator.destination_of(row), row.order_number, row.status,
            row.attempts, next_try, operator.clip(row.last_error))


async def console_logout_all(ctx: Context, args: argparse.Namespace) -> int:
    ended = await ctx.db(functools.partial(sessions.end_all, ctx.clock()))
    print(f"{ended} console session(s) ended")
    return 0


async def events_list(ctx: Context, args: argparse.Namespace) -> int:
    events = await ctx.db(functools.partial(
        operator.list_events, args.source, args.status, args.since, args.until, args.limit))
    print(operator.table(EVENT_COLUMNS, [event_row(event) for event in events]))
    return 0


async def events_show(ctx: Context, args: argparse.Namespace) -> int:
    event, effects = await ctx.db(functools.partial(operator.event_with_effects, args.id))
    for label, value in (
            ("event", f"#{event.id}"), ("source", operator.source_of(event)),
            ("type", event.event_type),
            ("status", event.status), ("order", event.order_number or "-"),
            ("external id", event.external_id or "-"), ("attempts", event.attempts),
            ("received", operator.format_time(event.received_at)),
            ("processed", operator.format_time(event.processed_at)),
            ("next attempt", operator.format_time(event.next_attempt_at)),
            ("held", event.held or "-"),
            *([("waiting for", event.waiting_for or "-")]
              if event.status == inbox.WAITING else []),
            ("last error", event.last_error or "-")):
        print(f"{label + ':':<14}{value}")
    if event.given_up_at:
        print(f"{'given up:':<14}by {event.given_up_by} at "
              f"{operator.format_time(event.given_up_at)}: {event.given_up_reason}")
    print("payload:")
    try:
        print(json.dumps(read_json(event.payload), indent=2, sort_keys=True))
    except ValueError:
        print(event.payload)
    print("outbox:")
    print(operator.table(OUTBOX_COLUMNS, [outbox_row(row) for row in effects]))
    return 0


async def events_replay(ctx: Context, args: argparse.Namespace) -> int:
    if args.failed:
        with TerminalProgress("replaying", "event") as progress:
            replayed = await operator.replay_failed(ctx, progress)
        # One line per event not done (what needs looking at), then the summary.
        for item in replayed:
            if item.outcome in NOT_DONE:
                print(f"event #{item.event.id} {item.event.source} {item.event.event_type}: "
                      f"{item.outcome}")
        still_failing = sum(item.outcome == "failed" for item in replayed)
        held = sum(item.outcome == inbox.HELD for item in replayed)
        print(f"replayed {len(replayed)} failed event(s); {still_failing} still failing"
              + (f", {held} held behind an earlier call of their stream" if held else ""))
        return 1 if still_failing or held else 0
    outcome = await operator.replay(ctx, args.id, force=args.force)
    if outcome == inbox.WAITING:
        event = await ctx.db(functools.partial(operator.get_event, args.id))
        print(f"event #{args.id}: waiting (its order is still not known: it waits again for "
              f"{event.waiting_for or 'nothing to find it by'}, and is handled as soon as "
              "one of them is linked to an order)")
    else:
        print(f"event #{args.id}: {outcome}")
    return 1 if outcome in NOT_DONE else 0


# A replay's outcomes that leave the event to be handled still.
NOT_DONE = ("failed", inbox.HELD, inbox.WAITING)


async def events_give_up(ctx: Context, args: argparse.Namespace) -> int:
    if args.failed:
        # The console's filter of the events page: one meaning for both.
        conditions = console.EventFilter(source=args.source or "", since=args.since,
                                         until=args.until).conditions()
        count = await ctx.db(functools.partial(
            operator.give_up_events, ctx, conditions, args.reason, command_line_operator()))
        print(f"{count} event(s) given up: dead and final (events being handled right now "
              "are left as they are)")
        return 0
    if args.source or args.since or args.until:
        print("receiver: --source, --since and --until go with --failed", file=sys.stderr)
        return 2
    event = await ctx.db(functools.partial(operator.give_up_event, ctx, args.id, args.reason,
                                           command_line_operator()))
    print(f"event #{event.id} given up: dead and final")
    return 0


async def outbox_list(ctx: Context, args: argparse.Namespace) -> int:
    rows = await ctx.db(functools.partial(operator.list_outbox, args.status, args.limit,
                                          args.destination))
    print(operator.table(OUTBOX_COLUMNS, [outbox_row(row) for row in rows]))
    return 0


def command_line_operator() -> tuple[str, str]:
    """(operator, address) of a retry made from the command line, as the effect's
    timeline shows it."""
    return f"{getpass.getuser()} (command line)", "local"


async def outbox_retry(ctx: Context, args: argparse.Namespace) -> int:
    if args.status:
        count = await ctx.db(functools.partial(operator.retry_all, ctx, args.status,
                                               command_line_operator(), args.destination))
        to = f" {args.destination}" if args.destination else ""
        print(f"{count} {args.status}{to} row(s) back to pending, due now; the scheduler "
              "sends them at its next run (rows on their way out are left as they are)")
        return 0
    if args.destination:
        print("receiver: --destination goes with --dead, --waiting or --pending",
              file=sys.stderr)
        return 2
    row = await ctx.db(functools.partial(operator.retry_outbox, ctx, args.id))
    # Kept with the console's actions, so the effect's timeline shows who retried it.
    await ctx.db(functools.partial(console.record_action, ctx, *command_line_operator(),
                                   "retry effect", row.id, "back in line"))
    print(f"outbox row #{row.id} ({operator.destination_of(row)}) back to pending, due now; "
          "the scheduler sends it at its next run")
    return 0


QUARANTINE_COLUMNS = ("RECEIVED (UTC)", "SOURCE", "TYPE", "ORDER", "DEDUP KEY", "REASON")


async def spool_quarantined(ctx: Context, args: argparse.Namespace) -> int:
    calls = spool.quarantined(ctx.settings.spool_dir)
    print(operator.table(QUARANTINE_COLUMNS, [
        (call.get("received_at"), call.get("source"), operator.clip(call.get("event_type")),
         operator.clip(call.get("order_number")), operator.clip(call.get("dedup_key")),
         operator.clip(call.get("unstorable"))) for call in calls]))
    print(f"{len(calls)} quarantined call(s) in "
          f"{os.path.join(ctx.settings.spool_dir, spool.UNSTORABLE_NAME)}")
    return 0


async def settle(ctx: Context, args: argparse.Namespace) -> int:
    counts = await settlement.settle_crtc_orders(ctx,
                                                 Transaction(ctx, by="receiver.py settle"))
    print(", ".join(f"{name.replace('_', ' ')}: {count}" for name, count in counts.items()))
    return 1 if counts["failed"] else 0


HOLDBACK_COLUMNS = ("ORDER", "DELIVERED (UTC)", "RELEASE AT (UTC)", "STATUS")


async def holdback_list(ctx: Context, args: argparse.Namespace) -> int:
    now = ctx.clock()
    rows = [(order.order_number, operator.format_time(order.delivered_at),
             operator.format_time(order.holdback_ends_at),
             "due" if order.holdback_ends_at <= now else "holding")
            for order in await ctx.db(functools.partial(holdback.holding, Transaction(ctx)))]
    print(operator.table(HOLDBACK_COLUMNS, rows))
    return 0


async def holdback_release(ctx: Context, args: argparse.Namespace) -> int:
    counts = await holdback.release_due(ctx)
    print(f"released: {counts.released}, not due: {counts.not_due}")
    return 0


REMINDER_COLUMNS = ("CUSTOMER", "KIND", "ORDER", "PERIOD", "DUE", "GOES OUT")


async def reminders_list(ctx: Context, args: argparse.Namespace) -> int:
    rows = []
    for entry in await ctx.db(functools.partial(reminders.plan, ctx, Transaction(ctx),
                                                reminders.today(ctx))):
        when = "tomorrow (mailed today)" if entry.mailed_today else "next run"
        rows += [(entry.email, "intake", order.order_number, "", "", when)
                 for order in entry.intake]
        rows += [(entry.email, due.cycle.kind, due.order.order_number, due.cycle.label,
                  due.cycle.due.isoformat(), when) for due in entry.filings]
    print(operator.table(REMINDER_COLUMNS, rows))
    return 0


async def reminders_run(ctx: Context, args: argparse.Namespace) -> int:
    ctx.settings.warn_about_link_secret()
    print(f"queued {await reminders.send_reminders(ctx)} reminder e-mail(s)")
    return 0


async def sign_link(ctx: Context, args: argparse.Namespace) -> int:
    await ctx.db(functools.partial(filings.check_link, Transaction(ctx), ctx.settings,
                                   args.kind, args.order, args.cycle))
    ctx.settings.warn_about_link_secret()
    print(links.signed_link(ctx.settings, args.kind, args.order, args.cycle))
    return 0


async def orders_import(ctx: Context, args: argparse.Namespace) -> int:
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as given:
                data = given.read()
    except OSError as exc:
        print(f"receiver: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        rows = intake.read_rows(data)
    except intake.UnreadableFile as exc:
        print(f"receiver: {args.file}: {exc}; nothing stored", file=sys.stderr)
        return 1
    with TerminalProgress("importing", "order") as progress:
        counts = await intake.import_rows(
            ctx, rows, progress, "stdin" if args.file == "-" else args.file,
            args.amend_paid, args.dry_run)
    for line, why in counts.bad:
        print(f"line {line}: {why}", file=sys.stderr)
    for line, what in counts.amended:
        print(f"line {line}: {what}")
    waiting = (f"; {counts.due} waiting call(s) due now (the running service handles them "
               "within SCHEDULER_TICK_SECONDS)" if counts.due and not args.dry_run else "")
    would = " would be" if args.dry_run else ""
    print(f"{len(rows)} row(s): {counts.created}{would} created, {counts.updated}{would} "
          f"updated, {counts.unchanged} unchanged, {len(counts.bad)} bad{waiting}"
          f"{' (dry run: nothing stored)' if args.dry_run else ''}")
    return 1 if counts.bad else 0


async def backfill_events(ctx: Context, args: argparse.Namespace) -> int:
    try:
        with TerminalProgress("listing from Stripe", "event") as listing, \
                TerminalProgress("handling", "event") as handling:
            counts = await backfill.backfill(ctx, args.since, listing=listing,
                                             handling=handling)
    except stripe.StripeError as exc:
        reason = exc.user_message or type(exc).__name__
        print(f"receiver: Stripe refused or could not be reached: {reason}", file=sys.stderr)
        return 1
    print(f"listed {counts.listed} undelivered event(s) since "
          f"{operator.format_time(args.since)} UTC: {counts.stored} stored and handled, "
          f"{counts.already} already in the inbox, {counts.unreadable} unreadable")
    return 1 if counts.unreadable else 0


async def reconcile_workflow(ctx: Context, args: argparse.Namespace) -> int:
    if not ctx.settings.workflow_url:
        print("receiver: WORKFLOW_URL is not set: no Frappe to ask", file=sys.stderr)
        return 2
    # One run at a time, with the scheduler's job of any process (PostgreSQL).
    lock = scheduler.AdvisoryLock(scheduler.JOBS_BY_NAME["reconcile"].lock_id)
    if not await lock.acquire():
        print("receiver: a reconciliation is running in another process; try again "
              "later", file=sys.stderr)
        return 1
    try:
        with TerminalProgress("looking at Frappe's documents", "document") as progress:
            counts = await reconcile.reconcile_workflow(ctx, args.since, progress)
    finally:
        await lock.release()
    print(f"looked at {counts.listed} document(s): {counts.handled} change(s) handled, "
          f"{counts.held} held behind an earlier call of their stream, "
          f"{counts.already} already stored, {counts.recorded} recorded and not handled, "
          f"{counts.unusable} not usable")
    for doctype in counts.failed:
        print(f"receiver: Frappe did not list {doctype} (see the log)", file=sys.stderr)
    for doctype in counts.quiet:
        print(f"receiver: {doctype}: Frappe's times and this run's window do not meet, "
              f"changes go unseen (see the log and /readyz)", file=sys.stderr)
    if counts.stopped:
        print("receiver: stopped before the end: the run waited on the database for "
              "WORKFLOW_RECONCILE_DATABASE_SECONDS in all; run it again to go on",
              file=sys.stderr)
    return 1 if counts.failed or counts.unusable or counts.stopped or counts.quiet else 0
