"""One module per card-processor (Stripe) event type (BEHAVIOUR.md 4.2).

A Stripe event is a fact that folds in any order: its plugin declares no stream, and waits
for no other event. Two deliveries are one fact when they are one Stripe event (its id),
unless its type happens once per object and declares that object's key."""
from domain.card_events import dedup_key
from plugins.registry import Placement


def _no_stream(event: dict) -> None:
    return None


# Today's keys, one placement for every type; each type's own declaration replaces it.
CARD_FACT = Placement(same=dedup_key, stream=_no_stream, version=_no_stream)
