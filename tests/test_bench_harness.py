"""The benchmark harness runs end to end on a tiny load, on the database of the test run
(so the PostgreSQL-only `2 instances` is run too), and so does the held-backlog bench
(bench/drain.py, PostgreSQL only). Speed is not asserted here: this machine is shared;
figures belong in docs/PERFORMANCE.md, from `make bench`."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from bench.drain import Sample, Sampler
from bench.run import Bench, Processes, free_port
from tests.service_process import ON_POSTGRES, postgres_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DATABASE = "postgres" if ON_POSTGRES else "sqlite"


def test_make_bench_harness_runs_on_a_tiny_load(tmp_path):
    env = {**os.environ, "BENCH_POSTGRES_URL": os.environ.get("TEST_DATABASE_URL", "")}
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--databases", DATABASE, "--duration", "0.5",
         "--warmup", "0.2", "--alone-duration", "0.3", "--connections", "2", "--orders", "3000",
         "--scale", "--scale-rows", "2000", "--scale-events", "20", "--memory", "100",
         "--drain-outage", "1", "--drain-window", "60",
         "--console", "--console-rows", "3000", "--results", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "latest.json") as results:
        report = json.load(results)
    rows = report["rows"]
    scenarios = {row["scenario"]: row for row in rows}
    instances = {"1 instance", "2 instances"} if ON_POSTGRES else set()
    assert set(scenarios) == {"ceiling", "floor", "workflow", "card", "crypto", "isolation",
                              "drain"} | instances
    assert scenarios["isolation"]["slow_stream"]["requests"] > 0
    assert set(report["scale"][DATABASE]["ratio"]) == {
        "card_request_p50_ms", "card_handling_ms", "dispute_handling_ms"}
    assert report["memory"][DATABASE]["events"] == 100
    assert {"overview", "events, first page", "order timeline"} <= set(
        report["console"][DATABASE])
    for row in rows:
        assert row["requests"] > 0 and row["unexpected_statuses"] == {}, row
    for row in rows:
        if row["scenario"] in ("ceiling", "floor", "workflow", "card", "crypto"):
            # What each run cost: the process measured, the machine, the database server.
            assert row["cpu_share"] > 0 and row["cpu_us_per_request"] > 0, row
            assert 0 < row["machine_busy"] <= 1, row
            assert (row.get("database_cpu_us_per_request", 0) > 0) == (
                row["database"] == "postgres"), row
    drain = scenarios["drain"]
    assert drain["backlog"] > 0, "the worker was down: jobs must have waited"
    assert drain["jobs_arrived"] == drain["jobs_acknowledged"]
    assert drain["jobs_duplicated"] == 0 and drain["jobs_unsent"] == 0
    assert scenarios["workflow"]["ratio_to_floor"] > 0
    floors = {row["database"] for row in rows if row["scenario"] == "floor"}
    assert floors == ({"sqlite", "postgres"} if ON_POSTGRES else {"sqlite"})
    for receiver in ("workflow", "card", "crypto"):
        row = scenarios[receiver]
        assert row["statements_per_turn"] > 0 and row["webhooks_per_turn"] > 0, row
        assert row["spool_files"] == 0, row  # the database path was measured
        assert 0 < row["alone_p50_ms"] <= row["alone_p99_ms"], row
        assert 0 < row["round_trips_per_turn"] <= row["statements_per_turn"], row
        if ON_POSTGRES:  # the BEGINs at least go with another statement
            assert row["round_trips_per_turn"] < row["statements_per_turn"], row
        assert ("ratio_to_database_floor" in row) == ON_POSTGRES, row
    if ON_POSTGRES:
        both = scenarios["2 instances"]
        assert both["jobs_arrived"] == both["jobs_acknowledged"] > 0
        assert both["jobs_duplicated"] == 0
    for receiver in ("workflow", "card", "crypto"):
        # Every event the load sent was handled for real, none failed.
        assert set(scenarios[receiver]["inbox"]) == {"processed"}, scenarios[receiver]


def test_a_stand_in_that_dies_after_answering_stops_the_run_with_its_last_words():
    bench = Bench(None)
    port = free_port()
    # It listens (the run sees it up), then dies while the run goes on: time is the behaviour.
    script = (f"import socket, sys, time; server = socket.create_server(('127.0.0.1', {port}));"
              " time.sleep(2); sys.exit('the stand-in fell over')")
    try:
        bench.processes.start(["-c", script], port)
        bench.processes.running[0].wait(10)
        with pytest.raises(RuntimeError, match="exited with 1:\n.*the stand-in fell over"):
            bench.record({"scenario": "workflow"})
        assert bench.rows == []
    finally:
        bench.processes.stop_all()


def test_a_stand_in_that_cannot_start_is_reported_at_once_with_why():
    processes = Processes()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        smtp_port, http_port = taken.getsockname()[1], free_port()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)address already in use"):
            processes.start(["-m", "bench.peers", "--http-port", str(http_port),
                             "--smtp-port", str(smtp_port)], http_port)
        processes.stop_all()
    assert time.monotonic() - started < 20, "it waited for a port that would never answer"


@postgres_only
def test_the_drain_bench_runs_on_a_tiny_load_through_a_cut(tmp_path):
    env = {**os.environ, "BENCH_POSTGRES_URL": os.environ["TEST_DATABASE_URL"]}
    result = subprocess.run(
        [sys.executable, "-m", "bench.drain", "--tick", "1", "--lease", "3", "--rate", "30",
         "--duration", "4", "--cut-from", "1.5", "--cut-to", "2.5", "--window", "60",
         "--results", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    [path] = tmp_path.glob("drain-*.json")
    with open(path) as results:
        report = json.load(results)
    [run] = report["runs"]
    assert run["calls"] == run["acknowledged"] == 120, run["answers"]
    assert run["lost"] == 0 and run["refused_statements"] == []
    assert run["stall"] is None and "not_empty" not in run
    assert run["empty_after_cut_end_s"] is not None
    assert run["samples"] and report["settings"]["cut_mode"] == "cut"
    assert "backlog empty" in result.stdout


def sample(at, finished, due_heads):
    return Sample(at, held=0, unfinished=5, spooled=0, finished=finished,
                  due_heads=due_heads, oldest_due=at - 1 if due_heads else None)


def test_the_drain_bench_calls_it_a_stall_when_nothing_finishes_while_a_head_is_due():
    sampler = Sampler(spools=[])
    sampler.samples = [sample(0, 10, 1), *(sample(at, 11, 1) for at in range(10, 41))]
    assert sampler.stalled_since(30) == 10
    assert sampler.stalled_since(31) is None  # not that long yet
    sampler.samples.append(sample(41, 12, 1))
    assert sampler.stalled_since(30) is None  # one finished: it moves
    sampler.samples = [sample(at, 11, 0) for at in range(0, 60)]
    assert sampler.stalled_since(30) is None  # nothing due: nothing to take
