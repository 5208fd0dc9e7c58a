"""Helpers shared by the tests of the public endpoints and pages."""
import contextlib
import json
import urllib.parse

import tornado.netutil

from models import ComplianceOrder
from app.server import make_server
from domain.links import link_token


def compliance_order(order_number="CO-20001", customer_name="Dana Trucking LLC",
                     service_slug="ifta"):
    """An order of an IFTA service by default (IFTA_SERVICE_SLUGS); "ucr" for UCR."""
    return ComplianceOrder.create(order_number=order_number, customer_name=customer_name,
                                  service_slug=service_slug)


def link_path(kind, order_number, cycle, token):
    query = urllib.parse.urlencode({"order": order_number, "cycle": cycle, "token": token})
    return f"/api/v1/{kind}/filed?{query}"


def signed_path(ctx, kind, order_number, cycle):
    return link_path(kind, order_number, cycle,
                     link_token(ctx.settings.link_secret, kind, order_number, cycle))


@contextlib.contextmanager
def served(app, settings):
    """The app behind the service's own HTTPServer (as in production) on a
    free loopback port; yields its base URL."""
    [sock] = tornado.netutil.bind_sockets(0, "127.0.0.1")
    server = make_server(app, settings)
    server.add_sockets([sock])
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.stop()


def parsed(response):
    return json.loads(response.body) if response.body else None
