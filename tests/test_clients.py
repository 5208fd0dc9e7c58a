"""The outbound HTTP client's classification of outcomes, and what its errors may say."""
import contextlib
import socket

import pytest

from clients.http import HttpClient, post_json
from clients.telegram import TelegramClient
from settings import Settings


@pytest.mark.gen_test
async def test_a_refused_connection_is_retryable_and_says_so(telegram):
    telegram.stop()
    result = await post_json(HttpClient(), telegram.url + "/x", {}, timeout=2)
    assert not result.ok and result.retryable
    host, port = telegram.url.removeprefix("http://").split(":")
    assert result.error == f"ClientConnectorError: connection refused by {host}:{port}"


@pytest.mark.gen_test
async def test_an_error_that_quotes_the_url_never_carries_the_bot_token():
    # An address without a scheme: the HTTP client's error text is the whole URL.
    settings = Settings(telegram_api_url="api.telegram.test", telegram_bot_token="123:SECRET",
                        telegram_chat_id="1")
    result = await TelegramClient(HttpClient(), settings).send("hello")
    assert not result.ok
    assert "SECRET" not in result.error and result.error == "InvalidUrlClientError"


@pytest.mark.parametrize("status,retryable", [(500, True), (503, True), (429, True),
                                              (408, True), (400, False), (404, False)])
@pytest.mark.gen_test
async def test_statuses_are_classified(telegram, status, retryable):
    telegram.fail_with(status)
    result = await post_json(HttpClient(), telegram.url + "/x", {}, timeout=2)
    assert (result.ok, result.retryable, result.status) == (False, retryable, status)


@pytest.mark.gen_test
async def test_a_slow_answer_is_a_retryable_timeout(telegram):
    telegram.delay = 2
    result = await post_json(HttpClient(), telegram.url + "/x", {}, timeout=0.3)
    assert not result.ok and result.retryable and "no answer in time" in result.error


@pytest.fixture
def unanswered_port():
    """A port whose listener never accepts, with its queue full: a connection to it hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(4):
        sock = socket.socket()
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect(("127.0.0.1", port))
        queued.append(sock)
    yield port
    for sock in (*queued, listener):
        sock.close()


@pytest.mark.gen_test(timeout=10)
async def test_a_connection_timeout_is_retryable_and_never_quotes_the_url(unanswered_port):
    # aiohttp's text for a connection timeout is the whole URL, bot token included.
    settings = Settings(telegram_api_url=f"http://127.0.0.1:{unanswered_port}",
                        telegram_bot_token="123:SECRET", telegram_chat_id="1",
                        outbound_timeout_seconds=1)
    result = await TelegramClient(HttpClient(), settings).send("hello")
    assert not result.ok and result.retryable
    assert result.error == "ConnectionTimeoutError: no answer in time"


@pytest.mark.gen_test
async def test_connections_are_kept_alive_and_a_peer_gone_down_is_noticed(telegram):
    http = HttpClient()
    for _ in range(3):
        assert (await post_json(http, telegram.url + "/x", {}, timeout=2)).ok
    assert len({request.client_port for request in telegram.requests}) == 1
    telegram.stop()
    result = await post_json(http, telegram.url + "/x", {}, timeout=2)
    assert not result.ok and result.retryable
    await http.close()
