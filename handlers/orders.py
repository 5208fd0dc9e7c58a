"""PUT and GET /api/v1/orders/<kind>/<order_number>: the shop's orders API (docs/ORDERS.md).

`Authorization: Bearer <ORDERS_API_KEY>`, compared in constant time; without the key
set, every call is refused (no sender is open by default). PUT creates the order (201)
or sets its shop fields (200, also when nothing changed: the same PUT again is the same
order, and its answer says it is unchanged); a field the service owns, an unknown one or
a wrong value is 400 naming it; an order number that is an order of another kind is 409,
and so is a change of a paid order's amounts without `?amend_paid=1`. GET answers the
order as the service sees it. Both answer the order's description
(domain.intake.describe); a PUT's also says what it did (`outcome`, `changed`)."""
import functools
from typing import NoReturn

import tornado.web

from domain import intake
from engine.transaction import Transaction
from handlers.addresses import peer_address
from handlers.base import ApiHandler, same_secret

# The query parameter by which a PUT says it means to change a paid order's amounts.
AMEND_PAID = "amend_paid"


class OrderHandler(ApiHandler):
    # An order is a dozen short fields; room for far more.
    body_limit = 16 * 1024

    def check_headers(self) -> bool:
        """The bearer token, before a byte of the body is read."""
        key = self.ctx.settings.orders_api_key
        scheme, _, given = self.request.headers.get("Authorization", "").partition(" ")
        if not key:
            self.refuse("ORDERS_API_KEY is not set: every call is refused")
        if scheme.lower() != "bearer" or not same_secret(given.strip(), key):
            self.refuse("the bearer token is not ORDERS_API_KEY" if given
                        else "no bearer token")
        return True

    def refuse(self, why: str) -> NoReturn:
        self.set_header("WWW-Authenticate", 'Bearer realm="orders"')
        self.refuse_credentials(401, "Unauthorized", f"orders API: {why}")

    def prepare(self) -> None:
        super().prepare()
        # Every method: a GET answers a customer's data too.
        self.authenticated = bool(self.check_headers())

    def fail_field(self, status: int, message: str, field: str) -> NoReturn:
        self.answer(status, {"error": message, "field": field})
        raise tornado.web.Finish()

    def checked(self, kind: str, order_number: str) -> intake.OrderInput:
        try:
            return intake.parse(kind, order_number, intake.read_body(self.raw_body))
        except intake.InvalidOrder as invalid:
            self.fail_field(400, str(invalid), invalid.field)
        except ValueError:
            self.fail(400, "invalid JSON body")

    def amend_paid(self) -> bool:
        """Whether the call says it means to change a paid order's amounts."""
        given = self.get_query_argument(AMEND_PAID, "")
        if given not in ("", "0", "1"):
            self.fail_field(400, f"{AMEND_PAID} must be 1 (or 0), got {given[:40]!r}",
                            AMEND_PAID)
        return given == "1"

    async def put(self, kind: str, order_number: str) -> None:
        self.known_kind(kind)
        amend_paid = self.amend_paid()
        order = self.checked(kind, order_number)
        try:
            stored = await intake.put(self.ctx, order,
                                      f"orders API from {peer_address(self.request)}",
                                      amend_paid)
        except intake.OtherKind as other:
            self.fail_field(409, str(other), "order_number")
        except intake.PaidOrder as paid:
            self.fail_field(409, f"{paid}; send the call with ?{AMEND_PAID}=1 to change a "
                                 f"paid order's {', '.join(intake.MONEY_FIELDS)}", paid.field)
        if stored.outcome == "created":
            self.set_header("Location", self.request.path)
        self.answer(201 if stored.outcome == "created" else 200,
                    {**intake.describe(stored.order), "outcome": stored.outcome,
                     "changed": intake.changes_shown(stored.changes)})

    async def get(self, kind: str, order_number: str) -> None:
        self.known_kind(kind)
        order = await self.ctx.db(functools.partial(intake.find, Transaction(self.ctx), kind,
                                                    order_number))
        if order is None:
            other = await self.ctx.db(functools.partial(intake.kind_of, Transaction(self.ctx),
                                                        order_number))
            self.fail(404, f"no {kind} order {order_number}" + (
                f" (it is a {other} order)" if other else ""))
        self.answer(200, intake.describe(order))

    def known_kind(self, kind: str) -> None:
        try:
            intake.model_of(kind)
        except intake.UnknownKind as unknown:
            self.fail(404, str(unknown))
