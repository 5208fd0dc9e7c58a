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

And, recorded from the real v15.54.1 site on 2026-11-28 (receiver@erp.test, the Receiver
role: read on the doctypes, no System Manager):
- `GET /api/method/frappe.desk.form.load.get_docinfo?doctype=&name=` answers
  `{"docinfo": {...}}` whose `workflow_logs` is every Comment of type Workflow of the
  document, newest first: `{"name": "71d3lmta60", "creation": "2026-11-28
  19:15:45.402506", "content": "Name Check", "owner": "receiver@erp.test",
  "comment_type": "Workflow"}`, one per workflow action (apply_workflow writes it just
  after the save, so its `creation` is a few ms after the document's `modified`); a note
  edit adds none. `versions` (the Version log, with Track Changes on) lists only the 10
  newest. `/api/resource/Comment`, `/api/resource/Version` and `/api/resource/System
  Settings/System Settings` answer 403 PermissionError to this user.
- `GET /api/method/frappe.client.get_time_zone` (allowed to anyone) answers
  `{"message": {"time_zone": "Asia/Kolkata"}}`: the site's default time zone, which
  System Settings set when saved; a fresh site, whose System Settings name none, answers
  Asia/Kolkata already (and writes its times in it); null is read as Asia/Kolkata too.
"""
import asyncio
import itertools
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


class _Handler(tornado.web.RequestHandler):
    def initialize(self, site):
        self.site = site

    async def prepare(self):
        self.site.requests.append(self.request)
        if self.site.delay:
            await asyncio.sleep(self.site.delay)  # a site slow to answer, on purpose
        self.set_header("Content-Type", "application/json")
        if self.site.down_with is not None:
            status, exc_type = self.site.down_with
            _error(self, status, exc_type, f"frappe.exceptions.{exc_type}")


class _Method(_Handler):
    """The whitelisted methods the service reads: who we are, a document's timeline, the
    time zone."""

    def get(self, method):
        if method == "frappe.auth.get_logged_user":
            self.finish({"message": "receiver@erp.test"})
            return
        if method == "frappe.client.get_time_zone":
            self.finish({"message": {"time_zone": self.site.time_zone}})
            return
        doctype, name = self.get_query_argument("doctype"), self.get_query_argument("name")
        logs = [{**entry, "owner": "ops@erp.test", "comment_type": "Workflow"}
                for entry in reversed(self.site.logs.get((doctype, name), []))]
        self.finish({"docinfo": {"doctype": doctype, "name": name, "comments": [],
                                 "versions": [], "workflow_logs": logs}})


class _List(_Handler):
    async def prepare(self):
        await super().prepare()
        if (self.site.down_with is None and
                self.request.headers.get("Authorization") != f"token {API_KEY}:{API_SECRET}"):
            _error(self, 401, "AuthenticationError", "frappe.exceptions.AuthenticationError")

    def get(self, doctype):
        doctype = urllib.parse.unquote(doctype)
        if doctype == "Workflow":  # each doctype's active Workflow, by its list
            filters = json.loads(self.get_query_argument("filters", "[]"))
            of = [value for field, _, value in filters if field == "document_type"]
            self.finish({"data": [{"name": f"{of[0]} Flow"}] if of else []})
            return
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
        order = query.get("order_by") or "modified desc, name desc"  # Frappe's default
        assert order in ("modified asc, name asc", "modified desc, name desc"), order
        rows.sort(key=lambda d: (d["modified"], d["name"]), reverse=order.endswith("desc"))
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
    call fail so; `delay` holds every answer back that long; `requests` and `actions`
    record what came."""

    def __init__(self, fields):
        self.fields = fields  # {doctype: the doctype's own fields}
        self.documents = {doctype: [] for doctype in fields}
        # {(doctype, name): its workflow log, oldest first}: {name, creation, content}.
        self.logs = {}
        self._comments = itertools.count(1)
        # What System Settings say (None: no time zone set).
        self.time_zone = "Asia/Kolkata"
        self.requests = []
        self.actions = []
        self.down_with = None
        # Seconds every answer is held back: a site slow to answer.
        self.delay = 0
        sock, self.port = tornado.testing.bind_unused_port()
        self.server = tornado.httpserver.HTTPServer(tornado.web.Application([
            (r"/api/resource/([^/]+)", _List, {"site": self}),
            (r"/api/method/(frappe\.model\.workflow\.apply_workflow)", _List, {"site": self}),
            (r"/api/method/(frappe\.desk\.form\.load\.get_docinfo|"
             r"frappe\.client\.get_time_zone|frappe\.auth\.get_logged_user)", _Method,
             {"site": self}),
        ]))
        self.server.add_sockets([sock])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def add(self, doctype, name, state, modified, logged=True, **fields):
        """The document saved at `modified`; a workflow action to a new state writes its
        log entry 40 ms after (`logged=False`: the state set other than by an action,
        which leaves none)."""
        before = next((d for d in self.documents[doctype] if d["name"] == name), None)
        document = {"name": name, "workflow_state": state, "modified": modified,
                    **{field: None for field in self.fields[doctype]}, **fields}
        self.documents[doctype] = [d for d in self.documents[doctype] if d["name"] != name]
        self.documents[doctype].append(document)
        if logged and (before is None or before["workflow_state"] != state):
            self.logs.setdefault((doctype, name), []).append({
                "name": f"c{next(self._comments):09}",
                "creation": frappe_text(modified + datetime.timedelta(milliseconds=40)),
                "content": state})
        return document

    def edit(self, doctype, name, modified, **fields):
        """The document saved again in its state (a note edited): no log entry."""
        document = next(d for d in self.documents[doctype] if d["name"] == name)
        document.update(modified=modified, **fields)
        return document

    def listings(self):
        """The query of each list call made, parsed."""
        return [{key: values[-1] for key, values in
                 urllib.parse.parse_qs(request.query).items()}
                for request in self.requests
                if request.method == "GET" and request.path.startswith("/api/resource/")]

    def stop(self):
        self.server.stop()
