"""A small closed-loop HTTP/1.1 load generator: N keep-alive connections, each sending
its next request as soon as the previous answer is read, for a fixed time.

With --until-eof the run also ends when its standard input does (the caller closes it):
each connection stops after its answer in flight, and the figures of the requests made
so far are printed as at the end of the time.

It runs in its own process (python bench/loadgen.py ...), so it never shares a core's
event loop with the server it measures. Requests come from a scenario in
bench/scenarios.py, which can make every request unique (fresh ids, fresh signatures).
"""
import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

from bench import scenarios


async def connection(host, port, scenario, window, latencies, failures, budget):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while window.is_open() and budget.take():
            request = scenario.next_request(host, port)
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            status = int(head.split(b" ", 2)[1])
            if status != scenario.expected_status:
                failures[status] = failures.get(status, 0) + 1
    finally:
        writer.close()


class Window:
    """The time requests are sent in: `duration` seconds, or until `close`."""

    def __init__(self, duration):
        self.deadline = time.monotonic() + duration

    def is_open(self):
        return time.monotonic() < self.deadline

    def close(self):
        self.deadline = 0.0


def close_at_eof(window):
    """Closes `window` on the loop once standard input ends (read in a thread of its
    own: the loop never waits on it)."""
    loop = asyncio.get_running_loop()

    def read():
        sys.stdin.buffer.read()
        loop.call_soon_threadsafe(window.close)
    threading.Thread(target=read, daemon=True).start()


class Budget:
    """How many requests may still be sent, over all connections (None: no limit)."""

    def __init__(self, limit):
        self.left = limit

    def take(self):
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def percentile(sorted_values, fraction):
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


async def run(host, port, scenario, connections, duration, requests=None, until_eof=False):
    latencies, failures = [], {}
    budget = Budget(requests)
    started = time.monotonic()
    window = Window(duration)
    if until_eof:
        close_at_eof(window)
    await asyncio.gather(*(connection(host, port, scenario, window, latencies, failures,
                                      budget)
                           for _ in range(connections)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "seconds": round(elapsed, 3),
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.50), 2),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "mean_ms": round(1000 * statistics.fmean(latencies), 2) if latencies else None,
        "unexpected_statuses": failures,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(scenarios.SCENARIOS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--requests", type=int, help="stop after this many requests")
    parser.add_argument("--until-eof", action="store_true",
                        help="also stop when standard input ends")
    parser.add_argument("--options", default="{}", help="JSON options for the scenario")
    args = parser.parse_args(argv)
    scenario = scenarios.SCENARIOS[args.scenario](**json.loads(args.options))
    result = asyncio.run(run(args.host, args.port, scenario, args.connections, args.duration,
                             args.requests, args.until_eof))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
