"""The console as an operator's browser meets it: a cookie jar, forms with their xsrf
token, redirects looked at rather than followed."""
import dataclasses
import html
import http.cookies
import re
import urllib.parse

import pytest

from ops.passwords import hash_password

PASSWORD = "correct horse battery staple"
# Made once: scrypt is slow on purpose.
PASSWORD_HASH = hash_password(PASSWORD)
COOKIE_SECRET = "test-cookie-secret-0123456789abcdef0123456789"
XSRF_FIELD = re.compile(r'name="_xsrf" value="([^"]+)"')


def console_settings(settings):
    return dataclasses.replace(settings, console_password_hash=PASSWORD_HASH,
                               cookie_secret=COOKIE_SECRET)


class Operator:
    """One browser: keeps the cookies the console sets, sends them back."""

    def __init__(self, client, base_url):
        self.client, self.base_url = client, base_url
        self.cookies = {}
        self.set_cookie_headers = []

    async def get(self, path, **headers):
        return await self.fetch(path, "GET", None, headers)

    async def post(self, path, form=None, xsrf=True, **headers):
        """POST a form; with `xsrf`, the token as the console's forms carry it."""
        form = dict(form or {})
        if xsrf:
            form["_xsrf"] = await self.xsrf_token()
        return await self.fetch(path, "POST", urllib.parse.urlencode(form), headers)

    async def act(self, path, form=None, **headers):
        """An action as a browser makes it: the form POSTed, answered with a redirect
        (303), which is followed; returns (the redirect, the page it led to)."""
        response = await self.post(path, form, **headers)
        assert response.code == 303, (response.code, text(response))
        return response, await self.get(response.headers["Location"])

    async def fetch(self, path, method, body, headers):
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        response = await self.client.fetch(self.base_url + path, method=method, body=body,
                                           headers=headers, follow_redirects=False)
        for header in response.headers.get_list("Set-Cookie"):
            self.set_cookie_headers.append(header)
            for name, morsel in http.cookies.SimpleCookie(header).items():
                if not morsel.value:  # cleared
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return response

    async def xsrf_token(self):
        if "_xsrf" not in self.cookies:
            await self.get("/console/login")
        page = await self.get("/console/login")
        return html.unescape(XSRF_FIELD.search(page.body.decode()).group(1))

    async def log_in(self, name="Dana", password=PASSWORD, **headers):
        return await self.post("/console/login", {"name": name, "password": password},
                               **headers)


def text(response):
    return response.body.decode("utf-8")


NOTICE = re.compile(r'<p class="notice( refused)?" role="status" id="notice">(.*?)(<br>|</p>)',
                    re.S)


def notice(page):
    """The notice a page shows (what the action before did), unescaped; None if none."""
    found = NOTICE.search(text(page))
    return html.unescape(found.group(2)) if found else None


def refused(page):
    """Whether the page's notice says the action was not done."""
    found = NOTICE.search(text(page))
    return bool(found and found.group(1))


@pytest.fixture
def operator(http_server, base_url, client):
    """An Operator without a session, for a test module whose settings have the console
    (import this fixture and `logged_in` into the module)."""
    return Operator(client, base_url)


@pytest.fixture
def logged_in(operator, io_loop):
    """`operator`, logged in."""
    response = io_loop.run_sync(operator.log_in)
    assert response.code == 302, text(response)
    return operator
