"""The outbound HTTP client's classification of outcomes, and what its errors may say."""
import socket

import pytest

from clients.http import AddressResolver, new_http_client, post_json
from clients.telegram import TelegramClient
from settings import Settings


@pytest.mark.gen_test
async def test_a_refused_connection_is_retryable_and_says_so(telegram):
    telegram.stop()
    result = await post_json(new_http_client(), telegram.url + "/x", {}, timeout=2)
    assert not result.ok and result.retryable
    assert "ConnectionRefused" in result.error or "Stream" in result.error


@pytest.mark.gen_test
async def test_an_error_that_quotes_the_url_never_carries_the_bot_token():
    # An address without a scheme: the HTTP client's error text repeats the whole URL.
    settings = Settings(telegram_api_url="api.telegram.test", telegram_bot_token="123:SECRET",
                        telegram_chat_id="1")
    result = await TelegramClient(new_http_client(), settings).send("hello")
    assert not result.ok
    assert "SECRET" not in result.error and result.error == "ValueError"


@pytest.mark.parametrize("status,retryable", [(500, True), (503, True), (429, True),
                                              (408, True), (400, False), (404, False)])
@pytest.mark.gen_test
async def test_statuses_are_classified(telegram, status, retryable):
    telegram.fail_with(status)
    result = await post_json(new_http_client(), telegram.url + "/x", {}, timeout=2)
    assert (result.ok, result.retryable, result.status) == (False, retryable, status)


@pytest.mark.gen_test
async def test_an_ip_address_resolves_to_itself_without_a_lookup_and_a_name_is_looked_up():
    resolver = AddressResolver()
    assert await resolver.resolve("127.0.0.1", 8080) == [(socket.AF_INET, ("127.0.0.1", 8080))]
    assert await resolver.resolve("::1", 80) == [(socket.AF_INET6, ("::1", 80))]
    assert (socket.AF_INET, ("127.0.0.1", 80)) in [
        (family, address[:2]) for family, address in await resolver.resolve("localhost", 80)]
