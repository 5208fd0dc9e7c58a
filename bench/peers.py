"""Stand-ins for the worker, Frappe and Telegram (one HTTP port, answering at once or
after --delay seconds) and an SMTP server (aiosmtpd) that accepts and drops mail.

The HTTP stand-in counts the Idempotency-Keys it is sent: GET /stats answers how many
calls carried one and how many distinct keys there were, so a run can prove that every
job arrived exactly once."""
import argparse
import asyncio

import tornado.web
from aiosmtpd.smtp import SMTP


class Keys:
    def __init__(self):
        self.calls = 0
        self.distinct = set()

    def count(self, key):
        if key:
            self.calls += 1
            self.distinct.add(key)


class Answer(tornado.web.RequestHandler):
    def initialize(self, delay, keys):
        self.delay, self.keys = delay, keys

    async def post(self, *args):
        if self.delay:
            await asyncio.sleep(self.delay)
        self.keys.count(self.request.headers.get("Idempotency-Key"))
        self.finish({"ok": True, "message": {"workflow_state": "ok"}, "result": {}})

    def get(self, *args):
        self.finish({"calls": self.keys.calls, "distinct": len(self.keys.distinct)})


class DropMail:
    async def handle_DATA(self, server, session, envelope):
        return "250 OK"


async def main(http_port, smtp_port, delay):
    app = tornado.web.Application([(r"/(.*)", Answer, {"delay": delay, "keys": Keys()})],
                                  log_function=lambda handler: None)
    # SMTP on this loop and first: the bench takes the HTTP port answering for every
    # stand-in being up. aiosmtpd's Controller would start it on a thread of its own
    # after the HTTP port, and fail, on a busy machine, after its ready timeout.
    if smtp_port:
        await asyncio.get_running_loop().create_server(
            lambda: SMTP(DropMail()), "127.0.0.1", smtp_port)
    app.listen(http_port, "127.0.0.1")
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--smtp-port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.http_port, args.smtp_port, args.delay))
