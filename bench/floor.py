"""The durable floor: a bare single-process Tornado app that stores each raw body before
answering, one commit per turn for every body that came in during it. No receiver that
stores before it answers can beat this on the same machine and database.

    python -m bench.floor PORT PATH              SQLite (WAL, synchronous=FULL), the
                                                 turn's INSERTs and COMMIT on the loop
    python -m bench.floor PORT postgresql://...  PostgreSQL: one multi-row INSERT and a
                                                 COMMIT per turn, in a thread of their
                                                 own (psycopg2 blocks), bodies arriving
                                                 meanwhile making the next turn
"""
import asyncio
import concurrent.futures
import json
import sqlite3
import sys

import tornado.ioloop
import tornado.web


class SqliteStore:
    def __init__(self, path: str):
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS calls (id INTEGER PRIMARY KEY, body BLOB)")
        self.waiting = []

    def keep(self, body: bytes) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self.waiting:
            loop.call_soon(self.commit)
        done = loop.create_future()
        self.waiting.append((body, done))
        return done

    def commit(self) -> None:
        batch, self.waiting = self.waiting, []
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO calls (body) VALUES (?)", [(body,) for body, _ in batch])
        self.db.execute("COMMIT")
        for _, done in batch:
            done.set_result(None)


class PostgresStore:
    def __init__(self, url: str):
        import psycopg2
        self.db = psycopg2.connect(url)
        with self.db, self.db.cursor() as cursor:
            cursor.execute("CREATE TABLE IF NOT EXISTS calls (id BIGSERIAL PRIMARY KEY, body BYTEA)")
        self.thread = concurrent.futures.ThreadPoolExecutor(1)
        self.waiting = []
        self.running = False

    def keep(self, body: bytes) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((body, done))
        if not self.running:
            asyncio.ensure_future(self.turns())
        return done

    async def turns(self) -> None:
        self.running = True
        try:
            while self.waiting:
                batch, self.waiting = self.waiting, []
                await asyncio.get_running_loop().run_in_executor(
                    self.thread, self.commit, [body for body, _ in batch])
                for _, done in batch:
                    done.set_result(None)
        finally:
            self.running = False

    def commit(self, bodies: list) -> None:
        import psycopg2
        with self.db.cursor() as cursor:
            values = ",".join(["(%s)"] * len(bodies))
            cursor.execute(f"INSERT INTO calls (body) VALUES {values}",
                           [psycopg2.Binary(body) for body in bodies])
        self.db.commit()


class Keep(tornado.web.RequestHandler):
    def initialize(self, store):
        self.store = store

    async def post(self):
        body = json.loads(self.request.body)
        await self.store.keep(self.request.body)
        self.finish({"received": True, "order_name": body["order_name"]})


def main(port: int, where: str) -> None:
    store = PostgresStore(where) if where.startswith("postgres") else SqliteStore(where)
    app = tornado.web.Application([(r"/echo", Keep, {"store": store})],
                                  log_function=lambda handler: None)
    app.listen(port, "127.0.0.1")
    tornado.ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
