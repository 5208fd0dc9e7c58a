"""Filings: what a customer filed themselves, the orders filing reminders go to, the
commission holdback."""
import datetime
from typing import Collection

import peewee

from models import ComplianceOrder, CrtcOrder, SelfFiling
from engine.db import locked
from engine.prepared import InsertOnce

NEW_FILING = InsertOnce(SelfFiling)


def _filing_key(kind: str, order_number: str, cycle: str) -> peewee.Expression:
    return ((SelfFiling.kind == kind) & (SelfFiling.order_number == order_number)
            & (SelfFiling.cycle == cycle))


def _holding(never_released: Collection[str]) -> "peewee.ModelSelect[CrtcOrder]":
    """CRTC orders whose holdback runs or has ended, their commission neither released
    nor forfeited nor in a payment status of `never_released`, earliest release first."""
    return (CrtcOrder.select()
            .where(CrtcOrder.holdback_ends_at.is_null(False),
                   CrtcOrder.commission_released_at.is_null(),
                   CrtcOrder.commission_forfeited_at.is_null(),
                   CrtcOrder.payment_status.not_in(never_released))
            .order_by(CrtcOrder.holdback_ends_at, CrtcOrder.id))


class FilingStore:
    """Filings, in the caller's transaction."""

    def record_self_filing(self, kind: str, number: str, cycle: str,
                           at: datetime.datetime) -> tuple[datetime.datetime, bool]:
        """Record, once, that the customer filed that cycle themselves at `at`: (when the
        first record says they did, whether this call wrote it)."""
        created = NEW_FILING.run(kind=kind, order_number=number, cycle=cycle,
                                 self_filed_at=at, created_at=at, updated_at=at)
        row = SelfFiling.get(_filing_key(kind, number, cycle))
        return row.self_filed_at, created is not None

    def self_filed_at(self, kind: str, number: str, cycle: str) -> datetime.datetime | None:
        """When the customer first said they filed that cycle, or None."""
        row = SelfFiling.get_or_none(_filing_key(kind, number, cycle))
        return None if row is None else row.self_filed_at

    def filed_already(self, kind: str, number: str, cycle: str) -> bool:
        """Whether the customer said they filed that cycle."""
        return bool(SelfFiling.select().where(_filing_key(kind, number, cycle)).exists())

    def orders_reminded_of_filings(self, slugs: Collection[str]) -> list[ComplianceOrder]:
        """The compliance orders filing reminders may go to: of a service whose slug
        (lower-cased) is one of `slugs` (lower case), paid, with a customer e-mail, not
        cancelled, their subscription not cancelled; oldest first. Not locked."""
        return list(ComplianceOrder.select()
                    .where(peewee.fn.LOWER(ComplianceOrder.service_slug).in_(sorted(slugs)),
                           ComplianceOrder.payment_status == "paid",
                           ComplianceOrder.customer_email.is_null(False),
                           ComplianceOrder.cancelled_at.is_null(),
                           ComplianceOrder.subscription_status.is_null()
                           | (ComplianceOrder.subscription_status != "cancelled"))
                    .order_by(ComplianceOrder.created_at, ComplianceOrder.id))

    def orders_in_holdback(self, never_released: Collection[str]) -> list[CrtcOrder]:
        """The CRTC orders whose commission holdback runs or has ended, the commission
        neither released nor forfeited, their payment status none of `never_released`;
        earliest release first. Not locked."""
        return list(_holding(never_released))

    def lock_order_in_holdback(self, order_id: int,
                               never_released: Collection[str]) -> CrtcOrder | None:
        """The CRTC order of that id, locked, if it is still in holdback as
        `orders_in_holdback` says; else None."""
        return locked(_holding(never_released).where(CrtcOrder.id == order_id)).first()
