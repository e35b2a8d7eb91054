"""benchmarks/soak.py runs end to end in quick mode: both sides did real work and were sampled.

No timing or flatness asserts (a few seconds say nothing about growth): this
only keeps the benchmark from rotting. It runs in its own process because the
benchmark sets its own device count (and runs each side in a process of its own).
"""

import json

import pytest

METRICS = ("rss_mib", "fds", "threads", "os_threads")
PW_METRICS = ("clients", "live_values", "accounting_rows", "executables")


@pytest.mark.timeout(90)
def test_soak_benchmark_quick_mode_samples_both_sides(background_run):
    script, tmp_path = background_run  # run in the background (conftest.py, BACKGROUND)
    script.output()
    result = json.loads((tmp_path / "soak_quick.json").read_text())
    assert (tmp_path / "soak_quick.png").stat().st_size > 0
    assert result["benchmark"] == "soak" and result["quick"] is True
    assert set(result["sides"]) == {"jax", "pw"}
    for name, side in result["sides"].items():
        assert side["calls"] > 0 and side["requests"] > 0, name
        assert side["wrong"] == 0, (name, side["first_error"])
        assert not side["sampler_error"], (name, side["sampler_error"])
        assert sum(side["by_kind"].values()) == side["requests"], name
        samples = side["samples"]
        assert len(samples) >= 4, name
        assert [s["t"] for s in samples] == sorted(s["t"] for s in samples), name
        assert samples[-1]["calls"] == side["calls"], name
        for s in samples:
            assert s["rss_mib"] > 0 and s["fds"] > 0 and s["threads"] >= 2 and s["os_threads"] >= 1, (name, s)
        summary = side["summary"]
        assert summary["programs_per_s"] > 0, name
        assert set(summary["slopes_per_min_second_half"]) == set(METRICS + PW_METRICS), name
    # Only the pathways_jax side has clients and an object store (the accounting's records
    # and the compile cache are read from internals, so they may be missing: None).
    pw_last = result["sides"]["pw"]["samples"][-1]
    assert pw_last["clients"] is not None and pw_last["live_values"] is not None, pw_last
    assert all(s[m] is None for s in result["sides"]["jax"]["samples"] for m in PW_METRICS)
    ratios = result["ratios"]
    assert ratios["programs_per_s_pw_over_jax"] == pytest.approx(
        result["sides"]["pw"]["summary"]["programs_per_s"]
        / result["sides"]["jax"]["summary"]["programs_per_s"]
    )
    assert result["machine"]["cpu_count"] >= 1
