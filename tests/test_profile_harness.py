"""`make profile` runs end to end on a tiny load and sorts its samples: the categories
are checked on stacks as py-spy writes them. Speed is not asserted (a shared machine)."""
import json
import os
import subprocess
import sys

from bench.profile import category, summarise
from tests.service_process import ON_POSTGRES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_statement_made_by_a_plugin_counts_as_a_statement():
    stack = ("thread (7): database_0;_run_batch (engine/commits.py:194);"
             "formation_ready (plugins/workflow/formation_ready.py:20);"
             "Database.execute_sql (peewee.py:3300)")
    assert category(stack) == ("database thread", "statements")
    assert category("thread (1): MainThread;handle (plugins/workflow/x.py:3)") == (
        "loop", "plugin")
    assert category("thread (1): MainThread;run (asyncio/events.py:80)") == ("loop", "other")


def test_with_gil_each_share_is_of_every_threads_samples_together(tmp_path):
    raw = tmp_path / "stacks.txt"
    raw.write_text("thread (1): MainThread;handle (plugins/workflow/x.py:3) 3\n"
                   "thread (1): MainThread;run (asyncio/events.py:80) 1\n"
                   "thread (7): database_0;Database.execute_sql (peewee.py:3300) 4\n")
    apart = summarise(str(raw))
    assert apart["loop"]["share"] == {"plugin": 75.0, "other": 25.0}
    assert apart["database thread"]["share"] == {"statements": 100.0}
    together = summarise(str(raw), of_all=True)
    assert together["loop"]["share"] == {"plugin": 37.5, "other": 12.5}
    assert together["database thread"]["share"] == {"statements": 50.0}
    assert together["loop"]["samples"] == 4


def test_make_profile_runs_on_a_tiny_load(tmp_path):
    database = "postgres" if ON_POSTGRES else "sqlite"
    env = {**os.environ, "BENCH_POSTGRES_URL": os.environ.get("TEST_DATABASE_URL", "")}
    result = subprocess.run(
        [sys.executable, "-m", "bench.profile", "--databases", database,
         "--receivers", "workflow,card", "--duration", "2", "--warmup", "0.2",
         "--connections", "2", "--orders", "300", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "profile.json").read_text())
    for receiver in ("workflow", "card"):  # card: orders seeded, paid by the load
        threads = report[f"{receiver}/{database}"]["threads"]
        assert report[f"{receiver}/{database}"]["cpu_us_per_request"] > 0
        assert threads["loop"]["samples"] > 0 and threads["database thread"]["samples"] > 0
        assert (tmp_path / f"{receiver}-{database}.svg").read_text().startswith("<?xml")
