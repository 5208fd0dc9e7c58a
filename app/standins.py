"""Stand-ins for the systems the service talks to, for `receiver.py demo`: the worker,
Frappe and Telegram on one loopback HTTP port (under /worker, /frappe and /telegram), and
a mail server (aiosmtpd). Each answers what the service asks as the real system would
(Frappe: who we are, its lists, a document, an action applied) and logs what it is sent
on one line, so the effects of a webhook can be watched in the demo's log."""
import email
import email.policy
import json
import logging
import socket
import typing

import tornado.httpserver
import tornado.netutil
import tornado.web

if typing.TYPE_CHECKING:  # a development requirement, imported only when a demo runs
    from aiosmtpd.smtp import SMTP, Envelope, Session

log = logging.getLogger("receiver.demo")
# Who Frappe's stand-in says our API key belongs to.
DEMO_API_USER = "receiver-demo@example.com"


class _Worker(tornado.web.RequestHandler):
    def post(self) -> None:
        job = json.loads(self.request.body)
        log.info("stand-in worker: job %s for %s", job.get("action"),
                 job.get("order_number") or job.get("order_id") or "-")
        self.finish({"ok": True})


# What Frappe's whitelisted methods the service reads answer, as a v15 site does: who we
# are, the site's time zone (System Settings), and a document's history, whose workflow
# log is empty here (the demo's changes come as webhooks).
_METHOD_ANSWERS: dict[str, dict] = {
    "frappe.auth.get_logged_user": {"message": DEMO_API_USER},
    "frappe.client.get_time_zone": {"message": {"time_zone": "UTC"}},
    "frappe.desk.form.load.get_docinfo": {"docinfo": {"workflow_logs": []}},
}


class _FrappeMethod(tornado.web.RequestHandler):
    """Frappe's whitelisted methods the service calls: what it reads (GET,
    `_METHOD_ANSWERS`) and apply_workflow (POST). The state an action leads to is kept,
    so that a document read back shows it."""

    def initialize(self, states: dict[tuple[str, str], str]) -> None:
        self.states = states

    def get(self, method: str) -> None:
        if method not in _METHOD_ANSWERS:
            self.send_error(404)
            return
        self.finish(_METHOD_ANSWERS[method])

    def post(self, method: str) -> None:
        call = json.loads(self.request.body)
        doc, action = json.loads(call.get("doc") or "{}"), call.get("action")
        log.info("stand-in Frappe: workflow action %r on %s %s", action, doc.get("doctype"),
                 doc.get("name"))
        self.states[doc.get("doctype"), doc.get("name")] = action
        self.finish({"message": {"name": doc.get("name"), "workflow_state": action}})


class _FrappeResource(tornado.web.RequestHandler):
    """Frappe's REST resources: a list (the service's check reads one row of each
    doctype and the doctypes' active Workflows, the reconciliation lists the documents
    changed lately: none here, the demo's changes come as webhooks), or one document with
    the state its last action led to."""

    def initialize(self, states: dict[tuple[str, str], str]) -> None:
        self.states = states

    def get(self, doctype: str, name: str | None = None) -> None:
        if name is None:
            # The active Workflow of a doctype (the service reads its transitions); no
            # other list has rows.
            self.finish({"data": [{"name": "Demo Workflow"}] if doctype == "Workflow" else []})
            return
        log.info("stand-in Frappe: read %s %s", doctype, name)
        self.finish({"data": {"name": name, "doctype": doctype,
                              "workflow_state": self.states.get((doctype, name), "Demo")}})


class _Telegram(tornado.web.RequestHandler):
    def post(self) -> None:
        message = json.loads(self.request.body)
        log.info("stand-in Telegram: %s", " ".join(str(message.get("text", "")).split()))
        self.finish({"ok": True, "result": {"message_id": 1}})


class _Mailbox:
    async def handle_DATA(self, server: "SMTP", session: "Session",
                          envelope: "Envelope") -> str:
        # Bytes: the controller does not decode what it receives (decode_data is off).
        message = email.message_from_bytes(typing.cast(bytes, envelope.content),
                                           policy=email.policy.default)
        log.info("stand-in SMTP: mail to %s: %s", ", ".join(envelope.rcpt_tos),
                 message["Subject"])
        return "250 OK"


class StandIns:
    """Started on free loopback ports; `urls` are the settings that point the service at
    them."""

    def __init__(self) -> None:
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        # Frappe's documents' workflow states, as the actions applied left them.
        frappe: dict[str, dict[tuple[str, str], str]] = {"states": {}}
        self.http_port = sockets[0].getsockname()[1]
        self.server = tornado.httpserver.HTTPServer(tornado.web.Application([
            (r"/worker/jobs", _Worker),
            (r"/frappe/api/method/([^/]+)", _FrappeMethod, frappe),
            (r"/frappe/api/resource/([^/]+)", _FrappeResource, frappe),
            (r"/frappe/api/resource/([^/]+)/([^/]+)", _FrappeResource, frappe),
            (r"/telegram/bot[^/]+/sendMessage", _Telegram),
        ], log_function=lambda handler: None))
        self.server.add_sockets(sockets)
        # aiosmtpd is a development requirement: imported only when a demo runs.
        from aiosmtpd.controller import Controller
        self.smtp_port = _free_port()
        self.smtp = Controller(_Mailbox(), hostname="127.0.0.1", port=self.smtp_port)
        self.smtp.start()
        # aiosmtpd logs every connection at INFO; the mail itself is what the demo shows.
        logging.getLogger("mail.log").setLevel(logging.WARNING)

    @property
    def settings(self) -> dict[str, str]:
        http = f"http://127.0.0.1:{self.http_port}"
        return {"WORKER_URL": f"{http}/worker", "WORKFLOW_URL": f"{http}/frappe",
                "TELEGRAM_API_URL": f"{http}/telegram", "TELEGRAM_BOT_TOKEN": "demo-bot",
                "TELEGRAM_CHAT_ID": "demo-chat", "SMTP_URL": f"smtp://127.0.0.1:{self.smtp_port}"}

    def stop(self) -> None:
        self.server.stop()
        self.smtp.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
