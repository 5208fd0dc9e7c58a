"""A local stand-in for Stripe's API (STRIPE_API_BASE points the stripe library here),
answering the reads the service makes, in API version 2026-03-25.dahlia's shapes:

GET /v1/payment_intents/<id> (the charge expanded when asked), /v1/disputes/<id>,
/v1/charges/<id>, /v1/invoices/<id>, and /v1/invoice_payments?payment[type]=
payment_intent&payment[payment_intent]=<id> (the invoice expanded when asked: from
2025-03-31.basil on the only way from a payment to its invoice). An object it does not
know is Stripe's 404 (`resource_missing`); a wrong key, its 401. `failing` makes every
answer a 500, as Stripe unwell; `hold` keeps them back, as Stripe slow."""
import dataclasses
import json
import urllib.parse

import pytest
import tornado.httpserver
import tornado.testing
import tornado.web

from tests.stripe_events import SECRET_KEY


class _Objects(tornado.web.RequestHandler):
    def initialize(self, stripe, kind):
        self.stripe, self.kind = stripe, kind

    async def get(self, object_id=None):
        self.stripe.requests.append(self.request)
        if self.stripe.hold is not None:
            await self.stripe.hold.wait()
        self.set_header("Content-Type", "application/json")
        if self.stripe.failing:
            self.set_status(500)
            self.finish({"error": {"type": "api_error", "message": "Something went wrong"}})
            return
        if self.request.headers.get("Authorization") != f"Bearer {SECRET_KEY}":
            self.set_status(401)
            self.finish({"error": {"type": "invalid_request_error", "message": "bad key"}})
            return
        query = urllib.parse.parse_qs(self.request.query)
        expand = {value for name, values in query.items() if name.startswith("expand")
                  for value in values}
        if self.kind == "invoice_payments":
            self.finish(json.dumps(self.stripe.invoice_payments_of(
                query.get("payment[payment_intent]", [""])[0], "data.invoice" in expand)))
            return
        known = getattr(self.stripe, self.kind)
        if object_id not in known:
            self.set_status(404)
            self.finish({"error": {
                "code": "resource_missing", "type": "invalid_request_error",
                "param": "id", "message": f"No such {self.kind[:-1]}: '{object_id}'"}})
            return
        found = dict(known[object_id])
        if self.kind == "payment_intents" and "latest_charge" in expand:
            found["latest_charge"] = self.stripe.charges[found["latest_charge"]]
        self.finish(json.dumps(found))


class StripeApi:
    def __init__(self):
        self.payment_intents, self.charges, self.disputes, self.invoices = {}, {}, {}, {}
        # payment intent id -> invoice id: the InvoicePayment objects
        self.paid_invoices = {}
        self.requests = []
        self.failing = False
        # An asyncio.Event: every answer is kept back until the test sets it.
        self.hold = None
        sock, port = tornado.testing.bind_unused_port()
        self.url = f"http://127.0.0.1:{port}"
        routes = [(rf"/v1/{kind}/([^/]+)", _Objects, {"stripe": self, "kind": kind})
                  for kind in ("payment_intents", "charges", "disputes", "invoices")]
        routes.append((r"/v1/invoice_payments", _Objects,
                       {"stripe": self, "kind": "invoice_payments"}))
        self.server = tornado.httpserver.HTTPServer(tornado.web.Application(routes))
        self.server.add_sockets([sock])

    def charged(self, intent, method_type):
        """Stripe knows `intent`, paid by a charge with that payment method type."""
        self.payment_intents[intent["id"]] = intent
        self.charges[intent["latest_charge"]] = {
            "id": intent["latest_charge"], "object": "charge", "status": "succeeded",
            "payment_method_details": {"type": method_type, method_type: {}}}

    def invoice_paid_by(self, invoice, intent_id):
        """Stripe knows `invoice`, paid by the payment intent `intent_id` (an invoice's
        intent carries no order metadata: the subscription's order is found through
        the invoice)."""
        self.invoices[invoice["id"]] = invoice
        self.paid_invoices[intent_id] = invoice["id"]
        self.payment_intents.setdefault(intent_id, {
            "id": intent_id, "object": "payment_intent", "amount": invoice["amount_due"],
            "currency": invoice["currency"], "metadata": {}, "status": "succeeded"})

    def invoice_payments_of(self, intent_id, expand_invoice):
        data = []
        if intent_id in self.paid_invoices:
            invoice_id = self.paid_invoices[intent_id]
            invoice = self.invoices[invoice_id]
            data.append({
                "id": f"inpay_{invoice_id}", "object": "invoice_payment",
                "amount_paid": invoice["amount_paid"],
                "amount_requested": invoice["amount_due"], "created": 1795683600,
                "currency": invoice["currency"],
                "invoice": invoice if expand_invoice else invoice_id, "is_default": True,
                "livemode": False,
                "payment": {"type": "payment_intent", "payment_intent": intent_id},
                "status": "paid",
                "status_transitions": {"canceled_at": None, "paid_at": 1795683600}})
        return {"object": "list", "data": data, "has_more": False,
                "url": "/v1/invoice_payments"}

    def asked(self, kind):
        """The paths of the requests made for one kind of object."""
        return [request.path for request in self.requests if f"/v1/{kind}" in request.path]


@pytest.fixture
def stripe_api(io_loop, ctx):
    api = StripeApi()
    ctx.settings = dataclasses.replace(ctx.settings, stripe_api_base=api.url)
    yield api
    api.server.stop()
