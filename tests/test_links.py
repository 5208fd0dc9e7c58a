"""The IFTA/UCR "I already filed" links: tokens, recording once, the pages and the CLI."""
import asyncio
import dataclasses
import html as html_lib
import os
import re
import subprocess
import urllib.parse

import pytest

from models import SelfFiling
from tests.checked_service import CHECKED, refusals_file, refusals_to
from tests.door import through_the_door
from engine.transaction import Transaction
from app.server import make_app
from app.context import Context
from domain.links import (
    InvalidLinkPart, already_filed, link_token, record_self_filed, signed_link,
    survey_token, survey_token_valid, token_valid,
)
from tests.public_helpers import compliance_order, link_path, served, signed_path
from tests.service_process import database_down

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "link-secret-for-tests"


# --- tokens ---------------------------------------------------------------------------

def test_a_token_verifies_only_for_what_it_signed():
    token = link_token(SECRET, "ifta", "CO-1", "2026-Q3")
    assert token_valid(SECRET, "ifta", "CO-1", "2026-Q3", token)
    assert not token_valid(SECRET, "ifta", "CO-2", "2026-Q3", token)
    assert not token_valid(SECRET, "ifta", "CO-1", "2026-Q4", token)
    assert not token_valid(SECRET, "ucr", "CO-1", "2026-Q3", token)
    assert not token_valid("another-secret", "ifta", "CO-1", "2026-Q3", token)


def test_a_truncated_or_altered_token_is_refused():
    token = link_token(SECRET, "ucr", "CO-1", "2027")
    assert not token_valid(SECRET, "ucr", "CO-1", "2027", token[:-1])
    assert not token_valid(SECRET, "ucr", "CO-1", "2027", token[:10])
    assert not token_valid(SECRET, "ucr", "CO-1", "2027", "")
    assert not token_valid(SECRET, "ucr", "CO-1", "2027", None)
    flipped = ("A" if token[0] != "A" else "B") + token[1:]
    assert not token_valid(SECRET, "ucr", "CO-1", "2027", flipped)


def test_the_token_is_url_safe_base64_of_the_hmac():
    import base64
    import hashlib
    import hmac
    digest = hmac.new(SECRET.encode(), b"ifta|CO-1|2026-Q3", hashlib.sha256).digest()
    expected = base64.urlsafe_b64encode(digest).decode()
    assert link_token(SECRET, "ifta", "CO-1", "2026-Q3") == expected.rstrip("=")
    assert token_valid(SECRET, "ifta", "CO-1", "2026-Q3", expected)


def test_the_survey_token_signs_survey_and_the_order_alone():
    import base64
    import hashlib
    import hmac
    digest = hmac.new(SECRET.encode(), b"survey|CO-1|", hashlib.sha256).digest()
    token = survey_token(SECRET, "CO-1")
    assert token == base64.urlsafe_b64encode(digest).decode().rstrip("=")
    assert survey_token_valid(SECRET, "CO-1", token)
    assert not survey_token_valid(SECRET, "CO-2", token)
    assert not survey_token_valid("another-secret", "CO-1", token)
    assert not survey_token_valid(SECRET, "CO-1", link_token(SECRET, "ifta", "CO-1", "2026"))
    assert not survey_token_valid(SECRET, "CO|1", "anything")


@pytest.mark.parametrize("order,cycle", [("CO|1", "2026"), ("CO-1", "2026|Q3"), ("", "2026"),
                                         ("CO-1", ""), ("CO-1", "x" * 101),
                                         ("CO-1\x00", "2026"), ("CO-1", "2026\x00")])
def test_parts_that_cannot_be_signed_unambiguously_are_refused(order, cycle):
    with pytest.raises(InvalidLinkPart):
        link_token(SECRET, "ifta", order, cycle)
    assert not token_valid(SECRET, "ifta", order, cycle, "anything")


def test_moving_the_separator_between_order_and_cycle_gives_no_valid_link():
    # "ifta|CO|1|2026" would read as order "CO|1" or as cycle "1|2026": both are refused.
    token = link_token(SECRET, "ifta", "CO", "2026")
    assert not token_valid(SECRET, "ifta", "CO|", "2026", token)


def test_an_unknown_kind_is_refused():
    with pytest.raises(InvalidLinkPart):
        link_token(SECRET, "irp", "CO-1", "2026")


def test_signed_link_uses_the_public_base_url(settings):
    s = dataclasses.replace(settings, link_secret=SECRET,
                            public_base_url="https://orders.example.com")
    link = signed_link(s, "ucr", "CO 7&8", "2027")
    token = link_token(SECRET, "ucr", "CO 7&8", "2027")
    assert link == ("https://orders.example.com/api/v1/ucr/filed?order=CO+7%268"
                    f"&cycle=2027&token={token}")


# --- recording once -----------------------------------------------------------------------

def test_already_filed_answers_per_kind_order_and_cycle(ctx, clock):
    clock.set(2026, 10, 5, 8, 30)
    assert not through_the_door(already_filed, Transaction(ctx), "ifta", "CO-1", "2026-Q3")
    through_the_door(record_self_filed, Transaction(ctx), "ifta", "CO-1", "2026-Q3", clock())
    assert through_the_door(already_filed, Transaction(ctx), "ifta", "CO-1", "2026-Q3")
    assert not through_the_door(already_filed, Transaction(ctx), "ifta", "CO-1", "2026-Q4")
    assert not through_the_door(already_filed, Transaction(ctx), "ucr", "CO-1", "2026-Q3")
    assert not through_the_door(already_filed, Transaction(ctx), "ifta", "CO-2", "2026-Q3")


def test_recording_twice_keeps_the_first_time(ctx, clock):
    clock.set(2026, 10, 5, 8, 30)
    first = clock()
    tx = Transaction(ctx)
    assert through_the_door(record_self_filed, tx, "ucr", "CO-1", "2027", first) == (first, True)
    clock.advance(days=3)
    assert through_the_door(record_self_filed, tx, "ucr", "CO-1", "2027", clock()) == (
        first, False)
    assert SelfFiling.select().count() == 1


# --- the pages ------------------------------------------------------------------------------

@pytest.fixture
def get(http_server, base_url, client):
    async def fetch(path, **kwargs):
        return await client.fetch(base_url + path, **kwargs)
    return fetch


def html(response):
    return response.body.decode("utf-8")


FORM = re.compile(r'<form method="post" action="([^"]+)">(.*?)</form>', re.DOTALL)
HIDDEN = re.compile(r'<input type="hidden" name="(\w+)" value="([^"]*)">')


def button_of(page):
    """(the form's action, its fields, its one button's label) as the page shows them."""
    [(action, inside)] = FORM.findall(page)
    [label] = re.findall(r'<button type="submit">([^<]*)</button>', page)
    return action, {name: html_lib.unescape(value) for name, value in HIDDEN.findall(inside)}, \
        label


@pytest.fixture
def press(get):
    """Press the page's button as a browser would: POST its form's fields to its action."""
    async def post(page):
        action, fields, _ = button_of(page)
        return await get(action, method="POST", body=urllib.parse.urlencode(fields),
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
    return post


@pytest.mark.parametrize("kind,title,cycle", [("ifta", "IFTA fuel-tax return", "2026-Q3"),
                                              ("ucr", "UCR annual registration", "2027")])
@pytest.mark.gen_test
async def test_a_link_asks_first_and_its_button_records_and_confirms(
        get, press, ctx, clock, kind, title, cycle):
    compliance_order("CO-20001", "Dana", service_slug=kind)
    clock.set(2026, 10, 5, 8, 30)
    path = signed_path(ctx, kind, "CO-20001", cycle)
    asked = await get(path)
    assert asked.code == 200
    for response in (asked,):
        assert response.headers["Content-Type"] == "text/html; charset=utf-8"
        assert response.headers["Cache-Control"] == "no-store"
        assert response.headers["Referrer-Policy"] == "no-referrer"
        assert response.headers["X-Frame-Options"] == "DENY"
        assert "form-action 'self'" in response.headers["Content-Security-Policy"]
    question = html(asked)
    assert f"Did you file {cycle} yourself, Dana?" in question and title in question
    action, fields, label = button_of(question)
    assert label == f"Yes, I filed {cycle} myself"
    assert action == f"/api/v1/{kind}/filed"
    assert fields == dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query))
    assert not through_the_door(already_filed, Transaction(ctx), kind, "CO-20001", cycle)

    recorded = await press(question)
    assert recorded.code == 200 and recorded.headers["Cache-Control"] == "no-store"
    page = html(recorded)
    assert "Thank you, Dana: we have recorded that you filed" in page
    assert title in page and "5 October 2026 at 08:30 UTC" in page
    assert "<script" not in page and "<form" not in page
    assert through_the_door(already_filed, Transaction(ctx), kind, "CO-20001", cycle)


@pytest.mark.gen_test
async def test_a_mail_scanner_fetching_the_link_records_nothing(get, ctx, clock):
    """Safe Links, Mimecast, Proofpoint and Gmail's prefetch GET every link of a mail,
    some of them several times: the customer's reminders must go on."""
    compliance_order("CO-20001", "Dana")
    path = signed_path(ctx, "ifta", "CO-20001", "2026-Q3")
    responses = await asyncio.gather(*(get(path) for _ in range(5)))
    assert {r.code for r in responses} == {200}
    assert all("Yes, I filed 2026-Q3 myself" in html(r) for r in responses)
    assert SelfFiling.select().count() == 0


@pytest.mark.gen_test
async def test_a_second_press_or_a_later_look_shows_the_first_date(get, press, ctx, clock):
    compliance_order("CO-20001", "Dana")
    path = signed_path(ctx, "ifta", "CO-20001", "2026-Q3")
    question = html(await get(path))
    clock.set(2026, 10, 5, 8, 30)
    assert (await press(question)).code == 200
    clock.advance(days=2)
    responses = await asyncio.gather(*(press(question) for _ in range(3)),
                                     *(get(path) for _ in range(3)))
    for response in responses:
        assert response.code == 200
        assert "Already recorded, Dana" in html(response)
        assert "5 October 2026 at 08:30 UTC" in html(response)
        assert "<form" not in html(response)
    assert SelfFiling.select().count() == 1


@pytest.mark.gen_test
async def test_a_link_checker_s_head_request_records_nothing(get, ctx):
    compliance_order("CO-20001")

    async def head(path):
        return (await get(path, method="HEAD")).code
    assert await head(signed_path(ctx, "ifta", "CO-20001", "2026-Q3")) == 200
    assert await head(signed_path(ctx, "ifta", "CO-404", "2026-Q3")) == 404
    assert await head(link_path("ifta", "CO-20001", "2026-Q3", "x")) == 403
    assert not through_the_door(already_filed, Transaction(ctx), "ifta", "CO-20001", "2026-Q3")


@pytest.mark.gen_test
async def test_concurrent_first_presses_record_one_row(get, press, ctx):
    compliance_order("CO-20001", service_slug="ucr")
    question = html(await get(signed_path(ctx, "ucr", "CO-20001", "2027")))
    responses = await asyncio.gather(*(press(question) for _ in range(8)))
    assert {r.code for r in responses} == {200}
    assert sum("we have recorded that you filed" in html(r) for r in responses) == 1
    assert SelfFiling.select().count() == 1


def tampered_links(ctx):
    good = link_token(ctx.settings.link_secret, "ifta", "CO-20001", "2026-Q3")
    return {
        "changed order": link_path("ifta", "CO-20002", "2026-Q3", good),
        "changed cycle": link_path("ifta", "CO-20001", "2026-Q4", good),
        "changed kind": link_path("ucr", "CO-20001", "2026-Q3", good),
        "truncated token": link_path("ifta", "CO-20001", "2026-Q3", good[:-3]),
        "empty token": link_path("ifta", "CO-20001", "2026-Q3", ""),
        "no query": "/api/v1/ifta/filed",
        "no cycle": f"/api/v1/ifta/filed?order=CO-20001&token={good}",
        "other secret": link_path("ifta", "CO-20001", "2026-Q3",
                                  link_token("other", "ifta", "CO-20001", "2026-Q3")),
    }


def posted(get, path):
    """`path`'s query POSTed as the button's form would be."""
    path, _, query = path.partition("?")
    return get(path, method="POST", body=query,
               headers={"Content-Type": "application/x-www-form-urlencoded"})


@pytest.mark.gen_test
async def test_a_tampered_link_gets_the_403_page_and_records_nothing(get, ctx):
    compliance_order("CO-20001")
    compliance_order("CO-20002")
    for name, path in tampered_links(ctx).items():
        for response in (await get(path), await posted(get, path)):
            assert response.code == 403, name
            assert response.headers["Content-Type"] == "text/html; charset=utf-8"
            assert "This link is not valid" in html(response), name
    assert SelfFiling.select().count() == 0


@pytest.mark.gen_test
async def test_an_unknown_order_with_a_valid_token_gets_the_404_page(get, ctx):
    path = signed_path(ctx, "ifta", "CO-404", "2026-Q3")
    for response in (await get(path), await posted(get, path)):
        assert response.code == 404
        assert "We could not find this order" in html(response)
    assert SelfFiling.select().count() == 0


@pytest.mark.gen_test
async def test_html_in_a_customer_name_is_shown_escaped(get, ctx):
    compliance_order("CO-20001", customer_name="<script>alert('name')</script>")
    response = await get(signed_path(ctx, "ifta", "CO-20001", "2026-Q3"))
    page = html(response)
    assert response.code == 200
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#39;name&#39;)&lt;/script&gt;" in page


def links_no_reminder_is_about(ctx):
    """Links signed before `receiver.py link` refused them: each token is valid."""
    compliance_order("CO-20001")
    compliance_order("CO-20002", service_slug="ucr")
    compliance_order("CO-20003", service_slug="boi-report")
    return {
        "period written another way": signed_path(ctx, "ifta", "CO-20001", "2026Q3"),
        "no such quarter": signed_path(ctx, "ifta", "CO-20001", "2026-Q5"),
        "a quarter for UCR": signed_path(ctx, "ucr", "CO-20002", "2026-Q3"),
        "HTML as the period": signed_path(ctx, "ifta", "CO-20001", '<img src=x>2026-Q3'),
        "UCR link to an IFTA order": signed_path(ctx, "ucr", "CO-20001", "2027"),
        "IFTA link to a UCR order": signed_path(ctx, "ifta", "CO-20002", "2026-Q3"),
        "order of neither kind": signed_path(ctx, "ifta", "CO-20003", "2026-Q3"),
    }


@pytest.mark.gen_test
async def test_a_signed_link_no_reminder_is_about_records_nothing(get, ctx):
    """The page refuses what the command line refuses to sign: it must not tell the
    customer that reminders stop while recording a filing no reminder looks at."""
    for name, path in links_no_reminder_is_about(ctx).items():
        for response in (await get(path), await posted(get, path)):
            assert response.code == 404, name
            page = html(response)
            assert "We do not remind you of this filing" in page and "<img" not in page, name
            assert "Nothing was recorded." in page, name
    assert SelfFiling.select().count() == 0


@pytest.mark.parametrize("kind", ["ifta", "ucr"])
def test_openapi_yaml_documents_every_method_the_link_serves(kind):
    import yaml
    from handlers.links import FiledLinkHandler
    from handlers.openapi import OPENAPI_PATH
    with open(OPENAPI_PATH, encoding="utf-8") as document:
        described = set(yaml.safe_load(document)["paths"][f"/api/v1/{kind}/filed"])
    served_methods = {method.lower() for method in FiledLinkHandler.SUPPORTED_METHODS
                      if method.lower() in vars(FiledLinkHandler)}
    assert served_methods == {"get", "head", "post"}
    assert described == served_methods


def test_the_rate_limit_mixin_lives_with_the_limiter_not_in_another_handler_module():
    import handlers.links
    import handlers.public
    from handlers.ratelimit import RateLimited
    assert handlers.links.FiledLinkHandler.__mro__[1] is RateLimited
    assert handlers.public.PublicApiHandler.__mro__[1] is RateLimited
    assert RateLimited.__module__ == "handlers.ratelimit"


@pytest.mark.gen_test
async def test_other_methods_get_a_405_page(get, ctx):
    compliance_order("CO-20001")
    response = await get(signed_path(ctx, "ifta", "CO-20001", "2026-Q3"), method="PUT",
                         body=b"")
    assert response.code == 405
    assert response.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "Something went wrong" in html(response)
    assert SelfFiling.select().count() == 0


@pytest.mark.gen_test
async def test_database_down_gives_a_503_page_with_retry_after(get, ctx, db):
    path = signed_path(ctx, "ifta", "CO-20001", "2026-Q3")
    with database_down(db):
        response = await get(path)
    assert response.code == 503 and response.headers["Retry-After"] == "30"
    assert "Temporarily unavailable" in html(response)


@pytest.mark.gen_test
async def test_too_many_clicks_from_one_address_get_a_429_page(settings, clock, client):
    limited = dataclasses.replace(settings, public_rate_limit=2)
    ctx = Context.create(limited, clock=clock)
    compliance_order("CO-20001", service_slug="ucr")
    path = signed_path(ctx, "ucr", "CO-20001", "2027")
    with served(make_app(ctx), limited) as base:
        codes = [(await client.fetch(base + path)).code for _ in range(3)]
        refused = await client.fetch(base + path)
    assert codes == [200, 200, 429]
    assert int(refused.headers["Retry-After"]) >= 1
    assert "Too many requests" in html(refused)


# --- the command line -----------------------------------------------------------------------

def run_cli(*args, env):
    return subprocess.run([*CHECKED, *args], cwd=ROOT, text=True, capture_output=True,
                          timeout=60, env={**os.environ, **env,
                                           **refusals_to(refusals_file())})


@pytest.mark.gen_test(timeout=60)
async def test_the_cli_prints_a_link_that_works(get, ctx, base_url, database_url):
    compliance_order("CO-20001")
    env = {"LINK_SECRET": ctx.settings.link_secret, "PUBLIC_BASE_URL": base_url,
           "DATABASE_URL": database_url}
    result = await asyncio.to_thread(run_cli, "link", "ifta", "CO-20001", "2026-Q3", env=env)
    assert result.returncode == 0, result.stderr
    link = result.stdout.strip()
    assert link == signed_link(dataclasses.replace(ctx.settings, public_base_url=base_url),
                               "ifta", "CO-20001", "2026-Q3")
    response = await get(link[len(base_url):])
    assert response.code == 200 and "Yes, I filed 2026-Q3 myself" in html(response)


def test_the_cli_refuses_what_it_cannot_sign():
    env = {"LINK_SECRET": SECRET}
    bad_cycle = run_cli("link", "ucr", "CO-1", "2027|2028", env=env)
    assert bad_cycle.returncode == 2 and "cycle" in bad_cycle.stderr
    assert bad_cycle.stdout == ""
    bad_kind = run_cli("link", "irp", "CO-1", "2027", env=env)
    assert bad_kind.returncode == 2 and "invalid choice" in bad_kind.stderr


@pytest.mark.parametrize("kind,order,cycle,problem", [
    ("ifta", "CO-20001", "2026Q3", "the ifta period must be a quarter such as 2026-Q3, not '2026Q3'"),
    ("ifta", "CO-20001", "2026-Q5", "the ifta period must be a quarter such as 2026-Q3"),
    ("ucr", "CO-20002", "2026-Q3", "the ucr period must be a registration year such as 2027"),
])
def test_the_cli_refuses_a_period_its_kind_never_has(database_url, kind, order, cycle, problem):
    result = run_cli("link", kind, order, cycle,
                     env={"LINK_SECRET": SECRET, "DATABASE_URL": database_url})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"receiver: {problem}")


@pytest.mark.parametrize("kind,order,problem", [
    ("ifta", "CO-404", "no compliance order CO-404"),
    ("ucr", "CO-20001", "order CO-20001 gets no UCR reminders: its service, ifta, is not in "
                        "UCR_SERVICE_SLUGS"),
    ("ifta", "CO-20003", "order CO-20003 gets no IFTA reminders: its service, boi-report, "
                         "is not in IFTA_SERVICE_SLUGS"),
])
def test_the_cli_refuses_a_link_no_reminder_is_about(ctx, database_url, kind, order, problem):
    links_no_reminder_is_about(ctx)
    cycle = "2026-Q3" if kind == "ifta" else "2027"
    result = run_cli("link", kind, order, cycle,
                     env={"LINK_SECRET": SECRET, "DATABASE_URL": database_url})
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"receiver: {problem}\n"


def test_the_cli_warns_when_it_signs_with_the_placeholder_secret(database_url):
    compliance_order("CO-20001")
    result = run_cli("link", "ifta", "CO-20001", "2026-Q3",
                     env={"LINK_SECRET": "", "DATABASE_URL": database_url})
    assert result.returncode == 0 and result.stdout.startswith("http")
    assert "LINK_SECRET is not set: 'already filed' links are signed with a placeholder" in (
        result.stderr)
