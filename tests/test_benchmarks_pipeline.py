"""benchmarks/pipeline.py runs end to end in quick mode and reports every mode.

Tiny sizes, no timing asserts: this only keeps the benchmark from rotting. It
runs in its own process because the benchmark sets its own device count.
"""

import json

import pytest


@pytest.mark.timeout(300)
def test_pipeline_benchmark_quick_mode_reports_every_mode(background_run):
    # Run in the background from the session's start (conftest.py, BACKGROUND).
    script, tmp_path = background_run
    script.output()
    result = json.loads((tmp_path / "pipeline.json").read_text())
    assert set(result["modes"]) == {"spmd", "jax-dp2", "pipe2-gpipe", "pipe2-1f1b", "dp2"}
    for name, entry in result["modes"].items():
        assert entry["tokens_per_s"] > 0, name
        assert entry["ratio_vs_spmd"] > 0, name
    for schedule in ("gpipe", "1f1b"):
        entry = result["modes"][f"pipe2-{schedule}"]
        assert entry["schedule"] == schedule and entry["stages"] == 2
        assert entry["bubble_fraction"] == pytest.approx(1 / 2)  # 2 stages, 1 microbatch in quick mode
        assert entry["bubble_corrected_ratio"] == pytest.approx(entry["ratio_vs_spmd"] * 2)
    assert result["two_island_vs_one_island"] == result["modes"]["dp2"]["ratio_vs_spmd"]
    assert result["dp2_vs_plain_jax_two_island"] > 0
    assert result["machine"]["cpu_count"] >= 1
