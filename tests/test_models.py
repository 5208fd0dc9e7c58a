"""The order tables as other systems see them: plain SQL inserts naming only some columns
get the documented defaults, and concurrent saves of different columns both survive."""
import datetime

import pytest

from models import UTC, BundleOrder, ComplianceOrder, CrtcOrder, FormationOrder, utcnow

ORDER_MODELS = [FormationOrder, ComplianceOrder, BundleOrder, CrtcOrder]


def insert_order_number_only(db, model, order_number):
    db.execute_sql(f"INSERT INTO {model._meta.table_name} (order_number) "
                   f"VALUES ('{order_number}')")


def assert_documented_defaults(order, before):
    assert order.payment_status == "pending_payment"
    assert order.notes == ""
    for stamp in (order.created_at, order.updated_at):
        assert stamp.tzinfo == UTC
        # SQLite's CURRENT_TIMESTAMP has whole seconds only.
        assert before.replace(microsecond=0) <= stamp <= utcnow() + datetime.timedelta(seconds=1)
    if isinstance(order, ComplianceOrder):
        assert order.intake_reminders_sent == 0
    if isinstance(order, CrtcOrder):
        assert order.funds_available is False
        assert order.currency == "USD"


@pytest.mark.parametrize("model", ORDER_MODELS, ids=lambda m: m._meta.table_name)
def test_an_sql_insert_with_only_the_order_number_gets_the_documented_defaults(db, model):
    before = utcnow()
    insert_order_number_only(db, model, "CA-0001")
    assert_documented_defaults(model.get(model.order_number == "CA-0001"), before)


def test_saves_of_different_columns_from_two_copies_of_an_order_both_survive():
    CrtcOrder.create(order_number="CA-0002")
    webhook = CrtcOrder.get(CrtcOrder.order_number == "CA-0002")
    settlement = CrtcOrder.get(CrtcOrder.order_number == "CA-0002")
    webhook.payment_status = "paid"
    webhook.save()
    settlement.funds_available = True
    settlement.save()
    order = CrtcOrder.get(CrtcOrder.order_number == "CA-0002")
    assert (order.payment_status, order.funds_available) == ("paid", True)
