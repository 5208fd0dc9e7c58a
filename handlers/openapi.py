"""GET /api/v1/openapi.yaml: the description of every endpoint, as kept in the repository."""
import functools
import os

import tornado.web

OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "openapi.yaml")


@functools.cache
def openapi_document() -> bytes:
    with open(OPENAPI_PATH, "rb") as f:
        return f.read()


class OpenApiHandler(tornado.web.RequestHandler):
    def set_default_headers(self) -> None:
        self.clear_header("Server")
        self.set_header("Content-Type", "application/yaml; charset=utf-8")
        self.set_header("X-Content-Type-Options", "nosniff")

    def get(self) -> None:
        self.finish(openapi_document())
