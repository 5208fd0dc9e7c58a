"""The commission holdback of CRTC orders: a commission is paid only once the delivered
order can no longer be disputed cheaply.

crtc/delivered starts it, once: delivered_at is the delivery's time and holdback_ends_at
is COMMISSION_HOLDBACK_DAYS whole days (of 24 hours) later. A repeated delivery webhook
changes neither. From holdback_ends_at on (at or after that instant) the release job sends
the worker `release_commission` for the order, once: the outbox key names the order, and
commission_released_at is set in the same transaction. A dispute before the release
forfeits the commission (commission_forfeited_at and the reason), whatever its outcome,
and so does a refund in full; after the release neither changes anything here (the
commission was paid: the administrator takes it up).

The release and a dispute lock the order's row, so one of them comes first and the other
sees what it did.
"""
import dataclasses
import datetime
import functools
import logging
from typing import Final

from models import CrtcOrder
from domain.orders import document_name
from domain.payment_state import DISPUTE_LOST, DISPUTED, REFUNDED
from engine import outbox
from engine.contracts import EngineContext
from engine.transaction import Transaction

log = logging.getLogger("receiver.holdback")

RELEASE_JOB = "release_commission"
ORDER_TYPE: Final = "canada_crtc"
# What a dispute e-mail says about the commission of the disputed order.
WITHHELD = "withheld"
ALREADY_RELEASED = "already released"


def start(ctx: EngineContext, tx: Transaction, order: CrtcOrder,
          delivered_at: datetime.datetime) -> bool:
    """Record the delivery and the end of the holdback, unless a delivery was recorded
    already; returns whether this call started it."""
    if order.delivered_at is not None:
        log.info("CRTC order %s: delivery already recorded at %s; holdback unchanged",
                 order.order_number, order.delivered_at.isoformat())
        return False
    order.delivered_at = delivered_at
    order.holdback_ends_at = delivered_at + datetime.timedelta(
        days=ctx.settings.commission_holdback_days)
    order.updated_at = ctx.clock()
    tx.save(order)
    log.info("CRTC order %s delivered; commission holdback until %s", order.order_number,
             order.holdback_ends_at.isoformat())
    return True


def forfeit(ctx: EngineContext, tx: Transaction, order: CrtcOrder, reason: str) -> str:
    """A dispute on a CRTC order (its row locked by the caller): the commission is
    withheld unless it was released already. Returns what the dispute e-mail says:
    WITHHELD or ALREADY_RELEASED."""
    if order.commission_released_at is not None:
        log.warning("CRTC order %s disputed after its commission was released",
                    order.order_number)
        return ALREADY_RELEASED
    if order.commission_forfeited_at is None:
        now = ctx.clock()
        order.commission_forfeited_at = now
        order.commission_forfeit_reason = reason
        order.updated_at = now
        tx.save(order)
        log.warning("CRTC order %s: commission forfeited (%s)", order.order_number, reason)
    return WITHHELD


# An order in these payment statuses never has its commission released, whether or not
# its forfeit was recorded (an order disputed before disputes forfeited it).
NEVER_RELEASED = (DISPUTED, DISPUTE_LOST, REFUNDED)


def holding(tx: Transaction) -> list[CrtcOrder]:
    """Orders whose holdback runs or has ended but whose commission is neither released
    nor forfeited, earliest release first."""
    return tx.orders_in_holdback(NEVER_RELEASED)


@dataclasses.dataclass
class Released:
    released: int = 0
    not_due: int = 0


async def release_due(ctx: EngineContext) -> Released:
    """Queue `release_commission` for every order whose holdback has ended, and send the
    jobs. Returns the counts."""
    now = ctx.clock()
    counts = Released()
    tx = Transaction(ctx, by="the holdback job")
    for order in await ctx.db(functools.partial(holding, tx)):
        if order.holdback_ends_at > now:
            counts.not_due += 1
            continue
        counts.released += await tx.transaction(
            functools.partial(_release, tx, order.id, now))
    await outbox.deliver(ctx, tx.rows)
    return counts


def _release(tx: Transaction, order_id: int, now: datetime.datetime) -> int:
    """Release the commission of the order of that id, if still in holdback (its row
    locked); returns how many were released (1 or 0)."""
    order = tx.lock_order_in_holdback(order_id, NEVER_RELEASED)
    if order is None:  # released, or disputed, since it was listed
        return 0
    tx.job(RELEASE_JOB, {"order_name": document_name(order),
                         "order_number": order.order_number, "order_type": ORDER_TYPE},
           key=f"job-release-commission-{order.order_number}")
    order.commission_released_at = now
    order.updated_at = now
    tx.save(order)
    log.info("CRTC order %s: holdback ended %s; commission released", order.order_number,
             order.holdback_ends_at.isoformat())
    return 1
