"""Card payments: the facts Stripe tells of an order's payment, disputes and refunds, settlement."""
import datetime
from typing import Iterable

import peewee

from models import ComplianceOrder, CrtcOrder
from engine.db import locked


def _awaiting_funds(methods: Iterable[str]) -> "peewee.ModelSelect[CrtcOrder]":
    """CRTC orders paid with one of `methods` whose funds are not available yet: orders
    never refused first, oldest paid first; then the refused ones, the one refused longest
    ago first (so that orders Frappe refuses for good do not hold every newer order out of
    a batch)."""
    return (CrtcOrder.select()
            .where(CrtcOrder.payment_status == "paid",
                   CrtcOrder.funds_available == False,  # noqa: E712 (SQL, not Python)
                   CrtcOrder.payment_method.in_(list(methods)),
                   CrtcOrder.paid_at.is_null(False))
            .order_by(CrtcOrder.funds_refused_at.asc(nulls="first"), CrtcOrder.paid_at,
                      CrtcOrder.id))


def _with_subscription(subscription_id: str) -> "peewee.ModelSelect[ComplianceOrder]":
    return (ComplianceOrder.select()
            .where(ComplianceOrder.stripe_subscription_id == subscription_id))


class PaymentStore:
    """Card payments, in the caller's transaction."""

    def order_with_subscription(self, subscription_id: str | None) -> ComplianceOrder | None:
        """The compliance order with that Stripe subscription, or None (also for no
        subscription id). Not locked."""
        if not subscription_id:
            return None
        return _with_subscription(subscription_id).first()

    def lock_order_with_subscription(self, subscription_id: str | None
                                     ) -> ComplianceOrder | None:
        """`order_with_subscription`, locked until the transaction ends: for a caller that
        saves it while another process (a dispute) may be changing the same row."""
        if not subscription_id:
            return None
        return locked(_with_subscription(subscription_id)).first()

    def orders_awaiting_funds(self, methods: Iterable[str],
                              limit: int | None = None) -> list[CrtcOrder]:
        """The CRTC orders paid with one of `methods` (payment method words) whose funds
        are not available yet, in the order settlement tries them (`_awaiting_funds`), at
        most `limit` of them. Not locked."""
        query = _awaiting_funds(methods)
        if limit is not None:
            query = query.limit(limit)
        return list(query)

    def count_orders_awaiting_funds(self, methods: Iterable[str]) -> int:
        """How many orders `orders_awaiting_funds` gives, without a limit."""
        return _awaiting_funds(methods).count()

    def awaits_funds(self, order_id: int, methods: Iterable[str]) -> bool:
        """Whether the CRTC order of that id is still one of `orders_awaiting_funds`."""
        return _awaiting_funds(methods).where(CrtcOrder.id == order_id).exists()

    def lock_funds_available(self, order_id: int) -> bool:
        """Whether the CRTC order of that id has its funds available; its row is locked
        until the transaction ends (so that two runs set them once). Raises
        CrtcOrder.DoesNotExist for an id no order has."""
        current = locked(CrtcOrder.select(CrtcOrder.funds_available)
                         .where(CrtcOrder.id == order_id)).get()
        return bool(current.funds_available)

    def set_funds_available(self, order_id: int, at: datetime.datetime) -> None:
        """Mark the CRTC order of that id's funds available since `at`."""
        (CrtcOrder.update(funds_available=True, funds_available_at=at, updated_at=at)
         .where(CrtcOrder.id == order_id).execute())

    def lock_crtc_order_by_id(self, order_id: int) -> CrtcOrder:
        """The CRTC order of that id (its row id, not its number), locked until the
        transaction ends. Raises CrtcOrder.DoesNotExist for an id no order has."""
        return locked(CrtcOrder.select().where(CrtcOrder.id == order_id)).get()
