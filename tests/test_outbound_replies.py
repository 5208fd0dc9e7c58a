"""What a peer answers to our POSTs, taken for what it is: a redirect is never followed
(aiohttp followed a 302 as a GET without the body, and the job was recorded `sent`), and a
reply is read only up to what the attempt log keeps (16 replies of 50 MB at once took the
process from 58 to 853 MB)."""
import asyncio
import tracemalloc

import pytest
import tornado.httpserver
import tornado.testing
import tornado.web

from clients.http import POST_REPLY_BYTES, HttpClient, post_json
from models import Attempt, Outbox
from tests.conftest import WEBHOOK_SECRET

AUTH = {"X-Webhook-Secret": WEBHOOK_SECRET}
SUBMITTED = {"order_name": "FORM-00016", "order_number": "FO-16", "state_code": "DE",
             "entity_name": "Acme LLC"}
MEGABYTE = b"x" * (1024 * 1024)


class _Redirecting(tornado.web.RequestHandler):
    """A worker behind a proxy that sends its POSTs elsewhere; what comes to the landing
    page is recorded."""

    def initialize(self, landed):
        self.landed = landed

    def post(self):
        self.redirect("/worker/landing", status=302)

    def get(self):
        self.landed.append(self.request.method)
        self.finish({"ok": True})


class _Huge(tornado.web.RequestHandler):
    """A 2xx whose body is `megabytes` MB, written as it goes (the peer holds 1 MB)."""

    def initialize(self, megabytes, written):
        self.megabytes, self.written = megabytes, written

    async def post(self):
        self.set_header("Content-Type", "application/json")
        self.set_header("Content-Length", str(self.megabytes * len(MEGABYTE)))
        try:
            for _ in range(self.megabytes):
                self.write(MEGABYTE)
                await self.flush()
                self.written.append(len(MEGABYTE))
        except tornado.iostream.StreamClosedError:
            return  # the client closed the connection: the rest is not read


def _serve(handlers):
    sock, port = tornado.testing.bind_unused_port()
    server = tornado.httpserver.HTTPServer(tornado.web.Application(handlers))
    server.add_sockets([sock])
    return server, f"http://127.0.0.1:{port}"


class _RedirectingWorker:
    def __init__(self):
        self.landed = []
        self.server, self.url = _serve([
            (r"/jobs", _Redirecting, {"landed": self.landed}),
            (r"/worker/landing", _Redirecting, {"landed": self.landed})])


@pytest.fixture
def worker(io_loop):
    """The service's worker, here one whose POSTs are redirected."""
    peer = _RedirectingWorker()
    yield peer
    peer.server.stop()


@pytest.mark.gen_test
async def test_a_redirected_job_is_a_failed_attempt_naming_the_location(post, worker):
    status, _, _ = await post("/api/v1/webhooks/formation/submitted", SUBMITTED, AUTH)
    assert status == 200
    job = Outbox.get(Outbox.kind == "job")
    assert job.status == "dead"
    assert job.last_error == ("HTTP 302: redirected to /worker/landing, not followed")
    assert worker.landed == []  # nothing went to where it pointed
    attempt = Attempt.get(Attempt.outbox_id == job.id)
    assert (attempt.status_code, attempt.outcome) == (302, "dead")


@pytest.mark.gen_test
async def test_a_redirected_post_is_not_followed_by_the_client(worker):
    result = await post_json(HttpClient(), worker.url + "/jobs", {"action": "deliver"},
                             timeout=5)
    assert (result.ok, result.retryable, result.status) == (False, False, 302)
    assert "/worker/landing" in result.error and worker.landed == []


@pytest.fixture
def huge_peer(io_loop):
    written = []
    server, url = _serve([(r"/jobs", _Huge, {"megabytes": 50, "written": written})])
    yield url, written
    server.stop()


@pytest.mark.gen_test(timeout=60)
async def test_a_huge_reply_is_read_up_to_the_bound_and_the_rest_not_at_all(huge_peer):
    url, written = huge_peer
    http = HttpClient()
    reply = await http.call("POST", url + "/jobs", b"{}", timeout=30)
    assert reply.status == 200 and reply.cut
    assert len(reply.body) == POST_REPLY_BYTES
    await http.close()
    assert sum(written) < 50 * len(MEGABYTE)  # the peer could not write it all


@pytest.mark.gen_test(timeout=120)
async def test_sixteen_huge_replies_at_once_cost_what_sixteen_small_ones_do(huge_peer):
    url, _ = huge_peer
    http = HttpClient()
    tracemalloc.start()
    try:
        results = await asyncio.gather(*(
            post_json(http, url + "/jobs", {"n": n}, timeout=30, peer="worker")
            for n in range(16)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    await http.close()
    # A 2xx is delivered whatever follows it; its start is kept as the reply excerpt.
    assert all(result.ok and result.reply.startswith("xxxx") for result in results)
    # 16 x 50 MB read whole would be 800 MB; read to the bound, a few MB (the peer's 1 MB
    # chunk and the client's buffers included).
    assert peak < 16 * POST_REPLY_BYTES + 8 * len(MEGABYTE), peak
