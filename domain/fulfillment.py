"""The fulfilment states of compliance orders (`fulfillment_status`), and which moves
between them are allowed. The worker moves them as it works and reports each move
(POST /api/v1/webhooks/fulfillment/<status>); this module says whether a move is one.

An order starts with no status. It may wait for the customer's intake form, pause at one
gate after another (an authorization to sign, a delegation, credentials, a government
fee to approve, an insurance filing), be signed, be queued for filing (`ready_to_file`,
which waits for the administrator's approval), be filed and wait for the state, and be
completed. `completed` is final. Reporting the status an order already has is accepted
and changes nothing (the worker may report twice).
"""
import logging

from models import ComplianceOrder
from engine.contracts import EngineContext
from engine.transaction import Transaction
from domain.orders import OrderNotFound, find_any_kind

log = logging.getLogger("receiver.fulfillment")

AWAITING_INTAKE = "awaiting_intake"
AUTHORIZATION_REQUIRED = "authorization_required"
AUTHORIZATION_SIGNED = "authorization_signed"
READY_TO_FILE = "ready_to_file"
FILED_WAITING_STATE = "filed_waiting_state"
COMPLETED = "completed"
# The gates a filing may pause at, other than the authorization (which only a signature
# resolves).
GATES = ("awaiting_customer_delegation", "awaiting_secure_credentials",
         "awaiting_government_fee_approval", "awaiting_insurance_filing")
STATES = (AUTHORIZATION_REQUIRED, AUTHORIZATION_SIGNED, *GATES, READY_TO_FILE,
          FILED_WAITING_STATE, COMPLETED, AWAITING_INTAKE)

# Where a filing may pause or go ahead from: not started, intake in, signed, or another gate.
_UNDER_WAY = (None, AWAITING_INTAKE, AUTHORIZATION_SIGNED, *GATES)
ALLOWED_FROM = {
    AWAITING_INTAKE: (None,),
    AUTHORIZATION_REQUIRED: _UNDER_WAY,
    AUTHORIZATION_SIGNED: (AUTHORIZATION_REQUIRED,),
    **{gate: _UNDER_WAY for gate in GATES},
    READY_TO_FILE: _UNDER_WAY,
    FILED_WAITING_STATE: (READY_TO_FILE,),
    COMPLETED: (READY_TO_FILE, FILED_WAITING_STATE),
}


class InvalidTransition(ValueError):
    """The order cannot move to that status from the one it has."""


def move(ctx: EngineContext, tx: Transaction, order_number: str,
         status: str) -> ComplianceOrder | None:
    """Move a compliance order to `status`; returns the order, or None when it already had
    that status. Raises InvalidTransition (also for an order of another kind: it has no
    fulfilment status, and never will), or OrderNotFound (the event is retried: the
    order may not be written yet)."""
    order = tx.lock_order("compliance", order_number)
    if order is None:
        other = find_any_kind(tx, order_number)
        if other is not None:
            raise InvalidTransition(f"order {order_number} is a {other.kind} order, not a "
                                    "compliance order: it has no fulfilment status")
        raise OrderNotFound(f"no compliance order {order_number}")
    current = order.fulfillment_status
    if current == status:
        log.info("order %s is already %s", order_number, status)
        return None
    if current not in ALLOWED_FROM[status]:
        raise InvalidTransition(
            f"order {order_number} cannot move from {current or 'no status'} to {status}")
    now = ctx.clock()
    order.fulfillment_status = status
    order.updated_at = now
    tx.save(order)
    log.info("order %s: fulfillment %s -> %s", order_number, current or "none", status)
    return order
