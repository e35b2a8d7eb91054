"""benchmarks/many_leaves.py runs end to end in quick mode and reports every phase of both modes.

Tiny sizes, no timing asserts: this only keeps the benchmark from rotting. It runs
in its own process because the benchmark starts its own cluster.
"""

import json

import pytest


@pytest.mark.timeout(300)
def test_many_leaves_benchmark_quick_mode_reports_every_phase(background_run):
    # Run in the background from the session's start (conftest.py, BACKGROUND).
    script, tmp_path = background_run
    script.output()
    result = json.loads((tmp_path / "many_leaves.json").read_text())
    assert result["rounds"] == 2 and list(result["sizes"]) == ["20"]
    entry = result["sizes"]["20"]
    for mode in ("jax", "pw"):
        assert set(entry[mode]) == {"first", "second", "steady", "steady_nogc"}
        assert all(seconds > 0 for seconds in entry[mode].values()), mode
    assert all(ratio > 0 for ratio in entry["ratio"].values())
    assert (tmp_path / "many_leaves.png").stat().st_size > 0
