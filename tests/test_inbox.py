"""The inbox stores what arrives, once, whatever text it carries."""
import pytest

from models import WebhookEvent
from services import inbox


def test_a_nul_in_stored_text_is_kept_as_a_replacement_character(ctx):
    event, created = inbox.record(ctx, "card", "charge.dispute.created", "k-nul",
                                  b'{"id": "evt_1"}\x00', external_id="evt\x00_1",
                                  order_number="FO-\x001")
    stored = WebhookEvent.get_by_id(event.id)
    assert created
    assert (stored.order_number, stored.external_id) == ("FO-\ufffd1", "evt\ufffd_1")
    assert stored.payload == '{"id": "evt_1"}\ufffd'


def test_a_second_record_of_the_same_key_returns_the_first(ctx):
    first, created = inbox.record(ctx, "card", "invoice.paid", "k-1", b"{}")
    again, created_again = inbox.record(ctx, "card", "invoice.paid", "k-1", b'{"x": 1}')
    assert created and not created_again and again.id == first.id
    assert WebhookEvent.select().count() == 1


@pytest.mark.gen_test
async def test_a_rejected_event_keeps_its_status_and_reason_when_processed(ctx):
    event, _ = inbox.record(ctx, "crypto", "malformed", "k-bad", b"not json",
                            status="rejected", last_error="body is not JSON")
    assert await inbox.process(ctx, event) == "rejected"
    stored = WebhookEvent.get_by_id(event.id)
    assert (stored.status, stored.last_error) == ("rejected", "body is not JSON")
