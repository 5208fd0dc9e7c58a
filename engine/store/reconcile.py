"""The reconciliation with the workflow system: its runs, and the changes it finds."""
import contextlib
import datetime
import functools
from typing import Iterator, Sequence

from models import ReconcileRun, WebhookEvent
from engine.commits import AllowanceSpent, allowance
from engine.prepared import Prepared, slot


class DatabaseTimeSpent(Exception):
    """The code run under `ReconcileStore.database_allowance` waited on the database for
    its allowance: it stopped at the wait that would have passed it."""


@functools.cache
def _events_of_order(source: str, count: int) -> Prepared:
    """An order's newest events of a source, of any type (the order_number index)."""
    return Prepared(lambda: WebhookEvent.select().where(
        WebhookEvent.order_number == slot(WebhookEvent.order_number),
        WebhookEvent.source == source)
        .order_by(WebhookEvent.id.desc()).limit(count))


@functools.cache
def _events_of_type(source: str, count: int) -> Prepared:
    """An order's newest events of a source and type (the order_number index)."""
    return Prepared(lambda: WebhookEvent.select().where(
        WebhookEvent.order_number == slot(WebhookEvent.order_number),
        WebhookEvent.source == source,
        WebhookEvent.event_type == slot(WebhookEvent.event_type))
        .order_by(WebhookEvent.id.desc()).limit(count))


class ReconcileStore:
    """The reconciliation with the workflow system, in the caller's transaction."""

    def newest_events_of_order(self, source: str, order_number: str,
                               count: int) -> list[WebhookEvent]:
        """The order's `count` newest events of `source`, of any type, newest first; one
        indexed statement, nothing locked."""
        return list(_events_of_order(source, count).all(order_number=order_number))

    def newest_events_of_type(self, source: str, order_number: str, event_type: str,
                              count: int) -> list[WebhookEvent]:
        """The order's `count` newest events of `source` and `event_type`, newest first;
        one indexed statement, nothing locked."""
        return list(_events_of_type(source, count).all(order_number=order_number,
                                                       event_type=event_type))

    def has_event_of_types(self, source: str, order_number: str,
                           event_types: Sequence[str]) -> bool:
        """Whether the order has an event of `source` of any of `event_types`, whatever
        its status; one indexed statement, nothing locked."""
        return WebhookEvent.select().where(
            WebhookEvent.order_number == order_number, WebhookEvent.source == source,
            WebhookEvent.event_type.in_(list(event_types))).exists()

    def reconcile_run(self, doctype: str) -> ReconcileRun | None:
        """Where the doctype's runs got to, or None before its first; not locked."""
        return ReconcileRun.get_or_none(ReconcileRun.doctype == doctype)

    def reconcile_runs(self) -> list[ReconcileRun]:
        """Every doctype's run record."""
        return list(ReconcileRun.select())

    def record_reconcile_success(self, doctype: str, cursor: str, problem: str | None,
                                 newest: str | None, at: datetime.datetime) -> None:
        """The doctype's run finished at `at`: its `cursor`, its `problem` (None: none)
        and the newest `modified` it saw, written over what its record held."""
        (ReconcileRun.insert(doctype=doctype, cursor=cursor, succeeded_at=at,
                             last_error=problem, newest_seen=newest, created_at=at,
                             updated_at=at)
         .on_conflict(conflict_target=[ReconcileRun.doctype],
                      update={ReconcileRun.cursor: cursor, ReconcileRun.succeeded_at: at,
                              ReconcileRun.last_error: problem,
                              ReconcileRun.newest_seen: newest, ReconcileRun.updated_at: at})
         .execute())

    def record_reconcile_failure(self, doctype: str, error: str,
                                 at: datetime.datetime) -> None:
        """The doctype's run failed at `at` for `error`; its cursor stays where it was."""
        (ReconcileRun.insert(doctype=doctype, last_error=error, created_at=at, updated_at=at)
         .on_conflict(conflict_target=[ReconcileRun.doctype],
                      update={ReconcileRun.last_error: error, ReconcileRun.updated_at: at})
         .execute())

    @contextlib.contextmanager
    def database_allowance(self, seconds: float) -> Iterator[None]:
        """The units the code inside runs may wait on the database for `seconds` in all;
        the wait that would pass that raises `DatabaseTimeSpent` (between two units: each
        is committed whole or not at all). Only those waits count, and running out says
        nothing of the database being down."""
        try:
            with allowance(seconds):
                yield
        except AllowanceSpent as spent:
            raise DatabaseTimeSpent(str(spent)) from spent
