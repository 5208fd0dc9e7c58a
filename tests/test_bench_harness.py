"""The benchmark harness runs end to end on a tiny load. Speed is not asserted here:
this machine is shared; figures belong in docs/PERFORMANCE.md, from `make bench`."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_bench_harness_runs_on_a_tiny_load(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--sqlite-only", "--duration", "0.5",
         "--warmup", "0.2", "--connections", "2", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "latest.json") as results:
        rows = json.load(results)["rows"]
    scenarios = {row["scenario"]: row for row in rows}
    assert {"ceiling", "workflow"} <= set(scenarios)
    for row in rows:
        assert row["requests"] > 0 and row["unexpected_statuses"] == {}, row
