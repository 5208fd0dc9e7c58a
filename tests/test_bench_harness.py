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
         "--warmup", "0.2", "--connections", "2", "--orders", "3000",
         "--scale", "--scale-rows", "2000", "--scale-events", "20", "--memory", "100",
         "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "latest.json") as results:
        report = json.load(results)
    rows = report["rows"]
    scenarios = {row["scenario"]: row for row in rows}
    assert set(scenarios) == {"ceiling", "workflow", "card", "crypto", "isolation"}
    assert scenarios["isolation"]["slow_stream"]["requests"] > 0
    assert set(report["scale"]["sqlite"]["ratio"]) == {
        "card_request_p50_ms", "card_handling_ms", "dispute_handling_ms"}
    assert report["memory"]["sqlite"]["events"] == 100
    for row in rows:
        assert row["requests"] > 0 and row["unexpected_statuses"] == {}, row
    for receiver in ("workflow", "card", "crypto"):
        # Every event the load sent was handled for real, none failed.
        assert set(scenarios[receiver]["inbox"]) == {"processed"}, scenarios[receiver]
