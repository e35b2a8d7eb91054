"""benchmarks/multitenancy.py runs end to end in quick mode and reports every mode.

No timing asserts: this only keeps the benchmark from rotting. It runs in its
own process because the benchmark sets its own device count, and the plain-JAX
multi-thread modes run in subprocesses of that one (they may deadlock; the
benchmark bounds them with a timeout and records what happened).
"""

import json

import pytest
from helpers import run_script, wait_for


@pytest.mark.timeout(240)
def test_multitenancy_benchmark_quick_mode_reports_every_mode(background_run):
    script, tmp_path = background_run  # run in the background (conftest.py, BACKGROUND)
    script.output()
    result = json.loads((tmp_path / "multitenancy_quick.json").read_text())
    assert (tmp_path / "multitenancy_quick.png").stat().st_size > 0
    assert result["benchmark"] == "multitenancy" and result["quick"] is True
    assert result["calibration"]["compute_ms"] > 0 and result["calibration"]["size"] > 0

    modes = result["modes"]
    jax_n = {"jax-2", "jax-4", "jax-2-w8", "jax-4-w8"}
    bare = {f"bare-{n}" for n in (1, 2, 4, 8, 16)}
    assert set(modes) == {"jax-1", "pw-1", "pw-2", "pw-4", "pw-8", "pw-16"} | bare | jax_n
    assert modes["jax-1"]["programs_per_s"] > 0
    assert modes["jax-1"]["ratio_to_jax_1"] == pytest.approx(1.0)
    for n in (1, 2, 4, 8, 16):
        entry = modes[f"pw-{n}"]
        assert entry["clients"] == n
        assert entry["programs_per_s"] > 0 and entry["ratio_to_jax_1"] > 0
        assert 0.0 <= entry["utilisation"] <= 1.0
        # Every program a client ran was accounted to that client.
        assert entry["accounted_programs"] == entry["programs"]
    for n in (1, 2, 4, 8, 16):
        entry = modes[f"bare-{n}"]
        assert entry["clients"] == n and entry["programs_per_s"] > 0 and entry["utilisation"] is None
        assert result["pw_over_bare"][str(n)] == pytest.approx(
            modes[f"pw-{n}"]["ratio_to_jax_1"] / entry["ratio_to_jax_1"]
        )
    for name in jax_n:
        entry = modes[name]
        assert entry["threads"] == int(name.split("-")[1])
        assert entry["outcome"] in {"completed", "aborted", "timeout", "failed"} or entry[
            "outcome"
        ].startswith("killed by")
        assert entry["summary"]

    fair = result["fair"]
    assert fair["weights"] == [1.0, 2.0, 4.0, 8.0]
    assert set(fair["clients"]) == {"w1", "w2", "w4", "w8"}
    for client in fair["clients"].values():
        assert client["device_time_s"] > 0
        assert client["weight_share"] == pytest.approx(client["weight"] / 15)
        assert 0.0 < client["share"] < 1.0
    assert sum(c["share"] for c in fair["clients"].values()) == pytest.approx(1.0)
    assert set(result["targets"]) == {
        "throughput_ratio_4plus_clients",
        "utilisation_4plus_clients",
        "fair_relative_error",
    }
    assert result["machine"]["cpu_count"] >= 1


@pytest.mark.timeout(240)
def test_multitenancy_benchmark_quick_process_mode_reports_every_mode(tmp_path, ray_cluster):
    # Client processes against one controller service (pw.serve), with jax-1 and pw-1 of the same run,
    # on the suite's Ray cluster (starting one costs seconds): the benchmark leaves it as it found it.
    address = ray_cluster.get_runtime_context().gcs_address
    run_script(
        "benchmarks/multitenancy.py",
        "--only_processes",
        "--quick",
        f"--ray_address={address}",
        f"--out={tmp_path}",
        timeout=220,
    )
    result = json.loads((tmp_path / "multitenancy_processes_quick.json").read_text())
    assert (tmp_path / "multitenancy_processes_quick.png").stat().st_size > 0
    assert result["benchmark"] == "multitenancy-processes" and result["quick"] is True
    assert result["config"]["processes"] == [1, 2]
    assert result["config"]["service"]["devices_per_host"] >= result["config"]["slice_devices"]
    assert result["calibration"]["size"] > 0 and result["machine"]["ray"]
    assert len(result["load_average"]["before"]) == 3

    modes = result["modes"]
    assert set(modes) == {"jax-1", "pw-1", "proc-1", "proc-2"}
    for entry in modes.values():
        assert entry["programs_per_s"] > 0 and entry["programs"] > 0
    # Every ratio is to the jax-1 of the same round.
    base = {r: rnd["jax-1"] for r, rnd in enumerate(result["rounds"])}
    assert modes["jax-1"]["ratios"] == pytest.approx([1.0] * len(base))
    for n in (1, 2):
        entry = modes[f"proc-{n}"]
        rounds = [(r, rnd) for r, rnd in enumerate(result["rounds"]) if rnd["processes"] == n]
        assert rounds and entry["processes"] == n
        assert entry["ratios"] == pytest.approx([rnd[f"proc-{n}"] / base[r] for r, rnd in rounds])
        assert entry["ratio_to_jax_1"] > 0
        # Each of the N processes completed programs, and the service ran every one of them.
        assert all(len(per) == n and min(per) > 0 for per in entry["per_process_programs"])
        assert entry["service_runs"] == entry["programs"]
        assert 0.0 < entry["utilisation"] <= 1.05
        assert entry["latency_ms_one_at_a_time"] > 0
        assert entry["cpu_us_per_program"]["client processes"] > 0
    assert 0.0 <= modes["pw-1"]["utilisation"] <= 1.0
    assert {f"p{i}" for i in range(2)} <= set(result["service_clients"])
    assert "proc-2" in result["table"]
    cpus = ray_cluster.cluster_resources()["CPU"]
    assert wait_for(lambda: ray_cluster.available_resources().get("CPU") == cpus, timeout=10), (
        "a host was left"
    )
