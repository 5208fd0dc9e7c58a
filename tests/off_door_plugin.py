"""A path added to a service started by tests/checked_service.py (DOOR_TEST_PLUGIN):
GET /test/off-door counts the stored webhooks with a statement on the loop, outside the door,
as a careless new handler would. The thread check must refuse it."""
import tornado.web

import app.server
from models import WebhookEvent


class OffDoorHandler(tornado.web.RequestHandler):
    def get(self):
        self.write(str(WebhookEvent.select().count()))


_routes = app.server.routes
app.server.routes = lambda ctx: [(r"/test/off-door", OffDoorHandler), *_routes(ctx)]
