"""benchmarks/demo.py runs end to end in quick mode and reports every mode.

Tiny sizes, no timing asserts: this only keeps the benchmark from rotting. It
runs in its own process because the benchmark sets its own device count.
"""

import json

import pytest


@pytest.mark.timeout(300)
def test_demo_benchmark_quick_mode_reports_every_mode(background_run):
    # Run in the background from the session's start (conftest.py, BACKGROUND).
    script, tmp_path = background_run
    script.output()
    result = json.loads((tmp_path / "demo.json").read_text())
    assert set(result["modes"]) == {"jax", "pw", "pw-nofuse"}
    for name, entry in result["modes"].items():
        assert entry["steps_per_s"] > 0, name
        assert len(entry["ratios"]) == result["rounds"], name
    assert result["modes"]["jax"]["ratio_vs_jax"] == 1.0
    # The default program compiles the whole step into one node; fuse=False keeps several.
    assert result["graph_nodes"]["pw"] == 1
    assert result["graph_nodes"]["pw-nofuse"] > 1
    assert (tmp_path / "demo.png").stat().st_size > 0
