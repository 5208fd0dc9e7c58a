"""The one object a plugin and a domain rule are given: `Transaction`.

It is the handling of one thing (a call, a scheduled job, a customer's click): what it
reads and writes in the database, as named, typed methods (engine.store), and what it
asks of other systems (engine.outbox.Effects: jobs, workflow actions, e-mails, alerts),
which are written in the same transaction as the changes that cause them and sent once
it is committed.

Its contract, for whoever writes a plugin or a domain rule:

- Its database methods run inside a unit of work (`ctx.db(unit)`, or
  `await tx.transaction(step)` for an async plugin's step, or the plugin's own call by
  the engine): plain synchronous code in the database thread, never on the IOLoop.
- A unit may be run again from its start (a conflict with another process, or a part of
  the turn that failed): it must only read and write through this object and build
  values, so running it twice does what running it once does. Effects are named
  (`purpose` or `key`), so asking again adds nothing.
- A write may reach the database with the next statement or the COMMIT; its failure then
  undoes the unit, which is run again alone. Nothing needs to know when.
- `apart(what)`: a part that may fail without spoiling the rest (a lookup whose failure
  is logged); `undone_on_failure()`: a part whose failure the caller handles (a refusal
  raised as `Refused`). A conflict is never swallowed by either."""
import contextlib
import logging
from typing import Iterator

from peewee import PeeweeException

from models import WebhookEvent

from engine.commits import raise_if_conflict
from engine.contracts import EngineContext
from engine.outbox import Effects
from engine.store.filings import FilingStore
from engine.store.intake import CallsWaiting, FactsWaiting, IntakeStore, wait_key
from engine.store.orders import OrderRef, OrderStore
from engine.store.payments import PaymentStore
from engine.store.reconcile import DatabaseTimeSpent, ReconcileStore
from engine.store.treasury import LedgerFields, TreasuryStore

__all__ = ["CallsWaiting", "DatabaseTimeSpent", "FactsWaiting", "LedgerFields", "OrderRef",
           "Part", "Refused", "Transaction", "wait_key"]

log = logging.getLogger("receiver.transaction")


class Refused(Exception):
    """The database refused a statement of a block run under `Transaction.undone_on_failure`
    (a conflict is not a refusal: its unit is run again); the message is the refusal's
    kind and the database's words."""


class Part:
    """What `Transaction.apart` tells of its part: `failed` once it failed and was
    undone."""
    failed = False


class Transaction(Effects, OrderStore, PaymentStore, TreasuryStore, ReconcileStore,
                  FilingStore, IntakeStore):
    """One handling's reads, writes and effects (above)."""

    def __init__(self, ctx: EngineContext, event: WebhookEvent | None = None,
                 first_handling: bool = False, for_scheduler: bool = False, *,
                 by: str | None = None) -> None:
        super().__init__(ctx, event, first_handling, for_scheduler)
        # Who the changes of orders this handling makes are by when no event is (a
        # scheduled job's name): an order's history names them so.
        self.by = by
        self.now = lambda: ctx.clock()

    @contextlib.contextmanager
    def apart(self, what: str) -> Iterator[Part]:
        """Run the block as a part that may fail alone: should the database refuse one of
        its statements, its changes and the effects it asked for are undone, the failure
        is logged with `what`, `part.failed` is set and the handling goes on after the
        block. A conflict (the unit must run again) and any other exception propagate."""
        part = Part()
        try:
            with self.savepoint():
                yield part
        except PeeweeException as failure:
            raise_if_conflict(failure)
            log.exception("%s", what)
            part.failed = True

    @contextlib.contextmanager
    def undone_on_failure(self) -> Iterator[None]:
        """Run the block as a part whose failure the caller handles: should it raise, its
        changes and the effects it asked for are undone and the exception propagates, a
        statement the database refused raised as `Refused`. A conflict propagates as it
        is: the unit is run again."""
        try:
            with self.savepoint():
                yield
        except PeeweeException as failure:
            raise_if_conflict(failure)
            raise Refused(f"{type(failure).__name__}: {failure}") from failure
