"""The durable floor: a bare single-process Tornado app that stores each raw body in
SQLite (WAL, synchronous=FULL), one commit per turn of the loop for every body that came
in during it, before answering. No receiver that stores before it answers can beat this
on the same machine and disk."""
import asyncio
import json
import sqlite3
import sys

import tornado.ioloop
import tornado.web


class Store:
    def __init__(self, path):
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS calls (id INTEGER PRIMARY KEY, body BLOB)")
        self.waiting = []

    def keep(self, body):
        loop = asyncio.get_running_loop()
        if not self.waiting:
            loop.call_soon(self.commit)
        done = loop.create_future()
        self.waiting.append((body, done))
        return done

    def commit(self):
        batch, self.waiting = self.waiting, []
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO calls (body) VALUES (?)", [(body,) for body, _ in batch])
        self.db.execute("COMMIT")
        for _, done in batch:
            done.set_result(None)


class Keep(tornado.web.RequestHandler):
    def initialize(self, store):
        self.store = store

    async def post(self):
        body = json.loads(self.request.body)
        await self.store.keep(self.request.body)
        self.finish({"received": True, "order_name": body["order_name"]})


def main(port, path):
    app = tornado.web.Application([(r"/echo", Keep, {"store": Store(path)})],
                                  log_function=lambda handler: None)
    app.listen(port, "127.0.0.1")
    tornado.ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
