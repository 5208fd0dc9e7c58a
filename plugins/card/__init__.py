"""One module per card-processor (Stripe) event type (BEHAVIOUR.md 4.2).

A Stripe event is a fact that folds in any order: its plugin declares no stream, and waits
for no other event. Each type says which deliveries are one fact (`Placement.same`):

- EACH_EVENT: one Stripe event, by its id (Stripe redelivers an event under its id);
  the default, for a type that may happen again to one object (a dispute updated, a
  payment intent failing at each attempt).
- ONCE_PER_OBJECT: a type that happens once in an object's life (a session completed, an
  intent succeeded): a second Event object Stripe sends for it is the same fact.
- `once_per_object_and(field)`: one fact per value of the object's `field` (a charge
  refunded once per amount refunded so far, an invoice failing once per attempt)."""
from typing import Any, Callable

from plugins.registry import Placement, undeclared


def _event_id(event: dict[str, Any]) -> str:
    return str(event["id"])


def _object_key(event: dict[str, Any], *more: object) -> str:
    """`type:object id` (and `more`), or the event's id for an object without one (an
    upcoming invoice, a balance)."""
    object_id = event["data"]["object"].get("id")
    if not object_id:
        return _event_id(event)
    return ":".join(str(part) for part in (event["type"], object_id, *more))


def fact(same: Callable[[Any], str]) -> Placement:
    """The placement of a card fact whose deliveries are one under `same(event)`."""
    return Placement(same=same, stream=undeclared, version=undeclared)


EACH_EVENT = fact(_event_id)
ONCE_PER_OBJECT = fact(_object_key)


def once_per_object_and(field: str) -> Placement:
    """One fact per object and value of the object's `field`."""
    return fact(lambda event: _object_key(event, event["data"]["object"].get(field)))
