"""A stand-in Frappe v15 site on loopback: its REST list API and the workflow action, with
the answers a real v15.54.1 site gave (checked against one on 2026-11-25).

What the real site showed and this one does alike:
- `GET /api/resource/<doctype>?fields=[...]&filters=[[field, op, value], ...]&order_by=
  ...&limit_start=N&limit_page_length=M` answers `{"data": [{field: value, ...}, ...]}`,
  only the fields asked for, in order, M at most (20 when not given), from the N-th;
  past the end `{"data": []}`;
- `modified` is the site's local time as text, `str(datetime)`: microseconds, except
  when they are 0 (then none); an empty Data field is null;
- a wrong API key is 401 `AuthenticationError`, a doctype the user may not read 403
  `PermissionError`, a field the doctype lacks 417 `DataError` ("Field not permitted in
  query: <field>"), an unknown doctype 404; each a JSON body with `exception` and
  `exc_type`;
- `POST /api/method/frappe.model.workflow.apply_workflow` answers the document as
  `{"message": {...}}`.
"""
import datetime
import json
import urllib.parse

import tornado.httpserver
import tornado.testing
import tornado.web

API_KEY, API_SECRET = "wf-key", "wf-secret"


def frappe_text(moment):
    """A naive local time as Frappe's JSON shows it."""
    return str(moment.replace(tzinfo=None))


def _error(handler, status, exc_type, exception):
    handler.set_status(status)
    handler.finish({"exception": exception, "exc_type": exc_type,
                    "exc": json.dumps(["Traceback (most recent call last): ..."])})


class _List(tornado.web.RequestHandler):
    def initialize(self, site):
        self.site = site

    def prepare(self):
        self.site.requests.append(self.request)
        self.set_header("Content-Type", "application/json")
        if self.site.down_with is not None:
            status, exc_type = self.site.down_with
            _error(self, status, exc_type, f"frappe.exceptions.{exc_type}")
        elif self.request.headers.get("Authorization") != f"token {API_KEY}:{API_SECRET}":
            _error(self, 401, "AuthenticationError", "frappe.exceptions.AuthenticationError")

    def get(self, doctype):
        doctype = urllib.parse.unquote(doctype)
        if doctype not in self.site.documents:
            _error(self, 404, "DoesNotExistError", f"DocType {doctype} not found")
            return
        query = {key: values[-1] for key, values in
                 urllib.parse.parse_qs(self.request.query).items()}
        fields = json.loads(query.get("fields", '["name"]'))
        filters = json.loads(query.get("filters", "[]"))
        known = {"name", "modified", "workflow_state", *self.site.fields[doctype]}
        for field in [*fields, *(f[0] for f in filters)]:
            if field not in known:
                _error(self, 417, "DataError",
                       f"frappe.exceptions.DataError: Field not permitted in query: {field}")
                return
        rows = [d for d in self.site.documents[doctype]
                if all(_matches(d, *condition) for condition in filters)]
        assert query.get("order_by") == "modified asc, name asc", query.get("order_by")
        rows.sort(key=lambda d: (d["modified"], d["name"]))
        start = int(query.get("limit_start", 0))
        length = int(query.get("limit_page_length", 20))
        page = [{field: _shown(row.get(field)) for field in fields}
                for row in rows[start:start + length]]
        self.finish({"data": page})

    def post(self, doctype):
        self.site.actions.append(urllib.parse.parse_qs(self.request.body.decode()) or
                                 json.loads(self.request.body))
        self.finish({"message": {"name": "x", "workflow_state": "moved"}})


def _value(value):
    """Frappe compares `modified` as a time, whatever text it is given."""
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            return value
    return value


def _matches(document, field, operator, value):
    have = _value(document.get(field))
    if operator == ">=":
        return have >= _value(value)
    if operator == "<=":
        return have <= _value(value)
    if operator == "in":
        return have in value
    if operator == "=":
        return have == _value(value)
    raise AssertionError(f"operator {operator} not played by the stand-in")


def _shown(value):
    return frappe_text(value) if isinstance(value, datetime.datetime) else value


class FrappeSite:
    """`add(doctype, name, state, modified, **fields)` puts a document on the site
    (`modified` a naive local time); `down_with = (status, exc_type)` makes every list
    call fail so; `requests` and `actions` record what came."""

    def __init__(self, fields):
        self.fields = fields  # {doctype: the doctype's own fields}
        self.documents = {doctype: [] for doctype in fields}
        self.requests = []
        self.actions = []
        self.down_with = None
        sock, self.port = tornado.testing.bind_unused_port()
        self.server = tornado.httpserver.HTTPServer(tornado.web.Application([
            (r"/api/resource/([^/]+)", _List, {"site": self}),
            (r"/api/method/(frappe\.model\.workflow\.apply_workflow)", _List, {"site": self}),
        ]))
        self.server.add_sockets([sock])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def add(self, doctype, name, state, modified, **fields):
        document = {"name": name, "workflow_state": state, "modified": modified,
                    **{field: None for field in self.fields[doctype]}, **fields}
        self.documents[doctype] = [d for d in self.documents[doctype] if d["name"] != name]
        self.documents[doctype].append(document)
        return document

    def listings(self):
        """The query of each list call made, parsed."""
        return [{key: values[-1] for key, values in
                 urllib.parse.parse_qs(request.query).items()}
                for request in self.requests if request.method == "GET"]

    def stop(self):
        self.server.stop()
