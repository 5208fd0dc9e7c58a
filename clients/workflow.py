"""The workflow system (Frappe): apply a named workflow action to a document, and read a
document back.

Frappe refuses an action the document's state does not allow with 417. That is also its
answer to an action sent a second time: after a crash, an action sent just before it is
sent again one lease later, and the first one had moved the document on. So a 417 is
not taken as final until the document is read back: one that is already past the action
had it applied, and the send is a success.

A refusal keeps Frappe's own reason (its exc_type and messages) in the Result's error, and
says what kind it is: our credentials refused (401, 403), which every call meets until
they are fixed, so the call waits rather than being given up; or our settings naming a
doctype Frappe does not have (its controller cannot be imported: a 500 with ImportError),
which no retry changes and which is no sign of a sick Frappe."""
import dataclasses
import html
import json
import logging
import re
import urllib.parse
import zoneinfo
from typing import Any

from clients.http import (HttpClient, READ_REPLY_BYTES, Request, Result, describe, post_json,
                          redirected)
from settings import Settings

log = logging.getLogger("receiver.workflow")

APPLY_WORKFLOW = "frappe.model.workflow.apply_workflow"
# Whitelisted for every signed-in user: the cheapest call that needs our credentials.
LOGGED_USER = "frappe.auth.get_logged_user"
# Our credentials refused: 401 (AuthenticationError: a key or secret Frappe does not
# know) or 403 (PermissionError: the API user may not do it; a call whose key Frappe
# could not match runs as Guest and is refused so).
CREDENTIALS_REFUSED = (401, 403)
# Frappe's exception types for a doctype it does not have: the controller of a
# misspelled doctype cannot be imported (500). Not DoesNotExistError: on an action that
# is the document missing (apply_workflow loads it), which says nothing of our settings;
# `check` takes a list call's 404 (the DocType not found) for what it is.
MISCONFIGURATION = ("ImportError", "ModuleNotFoundError")
# A document's timeline, as the form shows it: its workflow log among the rest (every
# Comment of type Workflow, one per workflow action, with the state it led to).
DOCINFO = "frappe.desk.form.load.get_docinfo"
# The site's time zone (System Settings), readable by any user (allow_guest): reading
# System Settings itself takes a System Manager.
TIME_ZONE = "frappe.client.get_time_zone"
# What Frappe v15 uses when System Settings name no time zone (frappe.utils.data.
# get_system_timezone): `modified` and every other time it writes is in it.
FRAPPE_DEFAULT_TIME_ZONE = "Asia/Kolkata"
# Frappe writes markup into its messages (<b>, <br>); the reason is kept as text.
_MARKUP = re.compile(r"<[^>]*>")


class WorkflowClient:
    def __init__(self, http: HttpClient, settings: Settings) -> None:
        self.http = http
        self.settings = settings
        # The site's time zone, as Frappe last said it (None: not asked, or no answer).
        self.time_zone: str | None = None
        # What the last `check` found wrong that does not take Frappe out of use, by
        # what: "workflow_read" (the API user may not read Workflow, or a doctype has no
        # active Workflow), "time_zone" (WORKFLOW_TIME_ZONE is not the site's).
        self.findings: dict[str, str] = {}

    @property
    def configured(self) -> bool:
        return bool(self.settings.workflow_url)

    def _headers(self) -> dict[str, str]:
        s = self.settings
        return {
            "Authorization": f"token {s.workflow_api_key}:{s.workflow_api_secret}",
            "X-Frappe-Site-Name": s.workflow_site_name,
            "X-Workflow-Site-Name": s.workflow_site_name,
        }

    async def apply_action(self, doctype: str, name: str, action: str) -> Result:
        """POST the apply-workflow call. Frappe answers 417 for an invalid transition,
        which no retry will change; if the document is already past the action (see
        `already_past`), the action had been applied and the result is ok."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        request = self.apply_request(doctype, name, action)
        result = await post_json(self.http, request.url, request.body, request.headers,
                                 timeout=s.outbound_timeout_seconds, peer="workflow system",
                                 refusal=refusal)
        if result.status == 417:
            past, found = await self.already_past(doctype, name, action)
            if past:
                return Result(ok=True, status=417, body={"already_applied": True},
                              reply=result.reply)
            # Unreadable for want of our user's permission, the refusal says nothing of
            # the document: the action may have been applied. Our setting to fix.
            return dataclasses.replace(result, retryable=False,
                                       misconfigured=NEEDS_WORKFLOW_READ in found,
                                       error=f"{result.error}; read back: {found}")
        return result

    def apply_request(self, doctype: str, name: str, action: str) -> Request:
        return Request(f"{self.settings.workflow_url}/api/method/{APPLY_WORKFLOW}",
                       {"cmd": APPLY_WORKFLOW,
                        "doc": json.dumps({"doctype": doctype, "name": name}),
                        "action": action},
                       self._headers())

    async def already_past(self, doctype: str, name: str, action: str) -> tuple[bool, str]:
        """After a 417: (is the document past `action`?, what the read-back found).
        Frappe's workflow for the doctype says: the document's state is one the action
        leads to, directly or by later transitions. A document still before the action
        (one that has not reached the state it applies from) is not past it, and neither
        is a document or workflow Frappe cannot show us (the refusal stands, and what was
        missing is the reason)."""
        document = await self.document(doctype, name)
        state = document.body.get("workflow_state") if document.ok else None
        if not state:
            found = f"the document's state could not be read ({document.error or 'no state'})"
            log.warning("%s %s: Frappe refused %r and %s", doctype, name, action, found)
            return False, found
        transitions = await self.transitions(doctype)
        if not transitions.ok:
            return False, f"the document is in {state!r}; {transitions.error}"
        past = state in states_after(action, transitions.body)
        if past:
            log.warning("%s %s: %r was already applied in Frappe (now %s)",
                        doctype, name, action, state)
            return True, f"already applied (now {state!r})"
        return False, f"the document is in {state!r}, not past {action!r}"

    async def transitions(self, doctype: str) -> Result:
        """The transitions ({state, action, next_state}) of the doctype's active workflow
        as an ok Result's body; a failed one says why Frappe does not show them: no
        active Workflow for the doctype, or the API user may not read Workflow."""
        found = await self._active_workflow(doctype)
        if not found.ok:
            failed = found
        else:
            workflow = await self._get("Workflow", found.body)
            transitions = workflow.body.get("transitions") if (
                workflow.ok and isinstance(workflow.body, dict)) else None
            if isinstance(transitions, list):
                return Result(ok=True, status=200,
                              body=[t for t in transitions if isinstance(t, dict)])
            failed = workflow_unreadable(workflow) if not workflow.ok else Result.failed(
                f"no transitions in the {doctype} Workflow Frappe shows", status=200)
        # Without them a repeated action stays refused (dead), with this as its reason.
        log.warning("the %s workflow could not be read from Frappe: %s", doctype,
                    failed.error)
        return failed

    async def document(self, doctype: str, name: str) -> Result:
        """GET the document (Frappe's REST resource). An ok Result's body is the
        document's fields (Frappe's `data`), workflow_state among them."""
        result = await self._get(doctype, name)
        if result.ok and not isinstance(result.body, dict):
            return Result.failed(f"no document in the reply for {doctype} {name}", status=200)
        return result

    async def list_documents(self, doctype: str, fields: list, filters: list, order_by: str,
                             start: int, page_length: int) -> Result:
        """One page of Frappe's list API (`GET /api/resource/<doctype>`): the documents
        matching `filters`, each a dict of `fields`, in `order_by` order, from the
        `start`-th. An ok Result's body is that list."""
        result = await self._get(doctype, params={
            "fields": json.dumps(fields), "filters": json.dumps(filters),
            "order_by": order_by, "limit_start": start, "limit_page_length": page_length})
        if result.ok and not isinstance(result.body, list):
            return Result.failed(f"no list in the reply listing {doctype}", status=200)
        return result

    async def workflow_log(self, doctype: str, name: str) -> Result:
        """The document's workflow log, oldest first, as an ok Result's body: one
        {name, creation, content} per workflow action applied to it (a Comment of type
        Workflow: `content` is the state it led to, `creation` Frappe's local time of it,
        `name` the comment's). Read through the form's own call, which needs no more than
        the read permission on the document (Comment itself is a System Manager's)."""
        said = await self._read(
            f"api/method/{DOCINFO}?" + urllib.parse.urlencode({"doctype": doctype,
                                                               "name": name}),
            f"the history of {doctype} {name}", "docinfo")
        if not said.ok:
            return said
        logs = said.body.get("workflow_logs") if isinstance(said.body, dict) else None
        if not isinstance(logs, list):
            return Result.failed(f"no workflow log in the history of {doctype} {name}",
                                 status=200)
        entries = [{"name": str(entry.get("name")), "creation": entry.get("creation"),
                    "content": entry.get("content")}
                   for entry in logs if isinstance(entry, dict)
                   and isinstance(entry.get("creation"), str)]
        return Result(ok=True, status=200,
                      body=sorted(entries, key=lambda entry: str(entry["creation"])))

    async def check(self) -> Result:
        """Whether Frappe takes our credentials and shows us the doctypes our settings
        name (WORKFLOW_DOCTYPE, CRTC_DOCTYPE): who we are (one authenticated GET), then
        one row of each doctype's list. A failed Result says what is wrong:
        `credentials_refused`, or `misconfigured` naming the doctype Frappe does not have
        or does not let us read; or Frappe is unwell."""
        if not self.settings.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        who = await self._read(f"api/method/{LOGGED_USER}", "who we are", "message")
        if who.ok and who.body in (None, "", "Guest"):
            return dataclasses.replace(
                Result.failed("Frappe takes our calls as Guest: the API key is not known",
                              status=200), credentials_refused=True)
        if not who.ok:
            return who
        doctypes = (self.settings.workflow_doctype, self.settings.crtc_doctype)
        for doctype in doctypes:
            listed = await self._get(doctype, params={"fields": json.dumps(["name"]),
                                                      "limit_page_length": 1})
            if listed.status in (403, 404) or listed.misconfigured:
                # Our user may call Frappe, but this doctype is not there or not ours to
                # read: a setting (or the user's roles) to fix. What else is to fix is
                # said all the same.
                await self._find(doctypes)
                return dataclasses.replace(listed, error=f"{doctype}: {listed.error}",
                                           misconfigured=True, credentials_refused=False,
                                           retryable=False)
            if not listed.ok:
                return listed
        await self._find(doctypes)
        return Result(ok=True, status=200, body=who.body)

    async def _find(self, doctypes: tuple[str, ...]) -> None:
        """What leaves Frappe in use but is to fix (`findings`): each doctype's active
        Workflow unreadable, the time zone not the one WORKFLOW_TIME_ZONE says."""
        findings: dict[str, str] = {}
        for doctype in doctypes:
            workflow = await self._active_workflow(doctype)
            if not workflow.ok and workflow.status != 0 and workflow.status < 500:
                findings.setdefault("workflow_read", workflow.error)
        zone = await self.read_time_zone()
        if zone.ok and self.settings.workflow_time_zone and (
                self.settings.workflow_time_zone != zone.body):
            findings["time_zone"] = (
                f"WORKFLOW_TIME_ZONE is {self.settings.workflow_time_zone}, but Frappe's "
                f"System Settings say {zone.body}: Frappe's is used; set it right or unset it")
        for what in sorted(findings.keys() - self.findings.keys()):
            log.error("Frappe: %s", findings[what])
        self.findings = findings

    async def read_time_zone(self) -> Result:
        """The site's time zone (its System Settings, v15's default when they name none),
        as an ok Result's body; learnt (`time_zone`) when Frappe says it."""
        said = await self._read(f"api/method/{TIME_ZONE}", "the time zone", "message")
        if not said.ok:
            return said
        zone = said.body.get("time_zone") if isinstance(said.body, dict) else None
        zone = zone or FRAPPE_DEFAULT_TIME_ZONE
        try:
            zoneinfo.ZoneInfo(zone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            return Result.failed(f"Frappe's time zone {zone!r} is not one we know",
                                 retryable=False, status=200)
        self.time_zone = zone
        return Result(ok=True, status=200, body=zone)

    async def _active_workflow(self, doctype: str) -> Result:
        """The name of the doctype's active Workflow as an ok Result's body; a failed one
        says why there is none to read (see `transitions`)."""
        found = await self._get("Workflow", params={
            "filters": json.dumps([["document_type", "=", doctype], ["is_active", "=", 1]]),
            "fields": json.dumps(["name"])})
        if not found.ok:
            return workflow_unreadable(found)
        if not found.body or not isinstance(found.body[0], dict):
            return Result.failed(f"Frappe has no active Workflow for {doctype}",
                                 retryable=False, status=200)
        return Result(ok=True, status=200, body=str(found.body[0].get("name", "")))

    async def _get(self, doctype: str, name: str | None = None,
                   params: dict[str, Any] | None = None) -> Result:
        """GET Frappe's REST resource: one document, or (no `name`) a list; an ok
        Result's body is the reply's `data`."""
        what = doctype if name is None else f"{doctype} {name}"
        parts = (doctype,) if name is None else (doctype, name)
        path = "api/resource/" + "/".join(urllib.parse.quote(part, safe="") for part in parts)
        if params:
            path += "?" + urllib.parse.urlencode(params)
        return await self._read(path, what, "data")

    async def _read(self, path: str, what: str, field: str) -> Result:
        """GET `path` of Frappe's API; an ok Result's body is the reply's `field`."""
        s = self.settings
        if not s.workflow_url:
            return Result.failed("WORKFLOW_URL is not set", configured=False)
        try:
            reply = await self.http.call(
                "GET", f"{s.workflow_url}/{path}",
                headers={"Accept": "application/json", **self._headers()},
                timeout=s.outbound_timeout_seconds, limit=READ_REPLY_BYTES)
        except Exception as exc:  # network errors of every kind
            return Result.failed(describe(exc))
        if 300 <= reply.status < 400:
            return Result.failed(f"{redirected(reply)} reading {what}", retryable=False,
                                 status=reply.status)
        if reply.cut:
            return Result.failed(f"reply over {READ_REPLY_BYTES} bytes reading {what}",
                                 status=reply.status)
        if reply.status != 200:
            return refusal(Result.failed(f"HTTP {reply.status} reading {what}",
                                         retryable=reply.status >= 500, status=reply.status),
                           reply.body)
        try:
            data = json.loads(reply.body)[field]
        except (ValueError, TypeError, KeyError):
            return Result.failed(f"unreadable reply reading {what}", status=200)
        return Result(ok=True, status=200, body=data)


NEEDS_WORKFLOW_READ = "the API user may not read Workflow"


def workflow_unreadable(failed: Result) -> Result:
    """A failed read of Workflow, said as what to fix when it is our user's permission."""
    if failed.status == 403:
        return dataclasses.replace(
            failed, error=f"{NEEDS_WORKFLOW_READ} (it needs read permission on Workflow): "
                          f"{failed.error}")
    return failed


def refusal(failed: Result, body: bytes) -> Result:
    """`failed` (a refusal or error Frappe answered) with Frappe's reason, and what kind of
    refusal it is (see the module's docstring)."""
    exc_type, reason = frappe_reason(body)
    said = reason if not exc_type or reason.startswith(exc_type) else (
        f"{exc_type}: {reason}" if reason else exc_type)
    heading = failed.error.split(":", 1)[0] if failed.error.startswith("HTTP") else failed.error
    error = f"{heading}: {said or exc_type}" if said or exc_type else failed.error
    if failed.status in CREDENTIALS_REFUSED:
        return dataclasses.replace(failed, error=error, retryable=True,
                                   credentials_refused=True)
    if exc_type in MISCONFIGURATION:
        return dataclasses.replace(failed, error=error, retryable=False, misconfigured=True)
    return dataclasses.replace(failed, error=error)


def frappe_reason(body: bytes | None) -> tuple[str, str]:
    """(exc_type, what Frappe says) from an error reply: its `_server_messages` (a JSON
    list of JSON objects, each with a message), else its `exception` line; markup
    removed. Empty strings for what the reply does not say."""
    try:
        reply = json.loads(body or b"null")
    except ValueError:
        return "", ""
    if not isinstance(reply, dict):
        return "", ""
    said_type = reply.get("exc_type")
    exc_type = said_type if isinstance(said_type, str) else ""
    messages = []
    try:
        for item in json.loads(reply.get("_server_messages") or "[]"):
            message = json.loads(item).get("message") if isinstance(item, str) else None
            if isinstance(message, str):
                messages.append(message)
    except (ValueError, TypeError, AttributeError):
        pass  # a reply without messages, or not in Frappe's shape: the exception line
    exception = reply.get("exception")
    exception = exception.removeprefix("frappe.exceptions.") if isinstance(exception, str) else ""
    text = "; ".join(messages) or exception
    return exc_type, " ".join(html.unescape(_MARKUP.sub(" ", text)).split())


def states_after(action: str, transitions: list[dict[str, Any]]) -> set[str]:
    """The states a document can be in once `action` was applied: where the action leads,
    and onwards along the transitions, short of a state the action applies from again."""
    before = {t.get("state") for t in transitions if t.get("action") == action}
    todo = [t.get("next_state") for t in transitions if t.get("action") == action]
    after = set()
    while todo:
        state = todo.pop()
        if state in after or state in before or not state:
            continue
        after.add(state)
        todo += [t.get("next_state") for t in transitions if t.get("state") == state]
    return after
