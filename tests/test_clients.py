"""The outbound HTTP client's classification of outcomes, and what its errors may say."""
import pytest

from clients.http import HttpClient, post_json
from clients.telegram import TelegramClient
from settings import Settings


@pytest.mark.gen_test
async def test_a_refused_connection_is_retryable_and_says_so(telegram):
    telegram.stop()
    result = await post_json(HttpClient(), telegram.url + "/x", {}, timeout=2)
    assert not result.ok and result.retryable
    assert "Cannot connect" in result.error and "Connect call failed" in result.error


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
async def test_a_timeout_is_retryable_and_never_quotes_the_url(telegram):
    # aiohttp's own text for a timeout names the whole URL, bot token included.
    telegram.delay = 2
    settings = Settings(telegram_api_url=telegram.url, telegram_bot_token="123:SECRET",
                        telegram_chat_id="1", outbound_timeout_seconds=0.3)
    result = await TelegramClient(HttpClient(), settings).send("hello")
    assert not result.ok and result.retryable
    assert "SECRET" not in result.error and "no answer in time" in result.error


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
