"""Stand-ins for the worker, Frappe and Telegram (one HTTP port, answering at once or
after --delay seconds) and an SMTP server (aiosmtpd) that accepts and drops mail."""
import argparse
import asyncio

import tornado.web
from aiosmtpd.controller import Controller


class Answer(tornado.web.RequestHandler):
    def initialize(self, delay):
        self.delay = delay

    async def post(self, *args):
        if self.delay:
            await asyncio.sleep(self.delay)
        self.finish({"ok": True, "message": {"workflow_state": "ok"}, "result": {}})


class DropMail:
    async def handle_DATA(self, server, session, envelope):
        return "250 OK"


async def main(http_port, smtp_port, delay):
    app = tornado.web.Application([(r"/(.*)", Answer, {"delay": delay})],
                                  log_function=lambda handler: None)
    app.listen(http_port, "127.0.0.1")
    if smtp_port:
        Controller(DropMail(), hostname="127.0.0.1", port=smtp_port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--smtp-port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.http_port, args.smtp_port, args.delay))
