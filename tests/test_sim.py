"""pw.sim: exact timings on tiny clusters with hand-set costs, predict, calibration, errors.

Every timing below is worked out by hand in the comments (times in µs).
"""

import dataclasses
import json
import subprocess
import sys

import jax.numpy as jnp
import pytest
from helpers import ROOT, modules_of_a_fresh_import, wait_for

import pathways_jax as pw
from pathways_jax import sim
from pathways_jax.sim import _engine as sim_engine

US = 1e-6


def approx(us):
    return pytest.approx(us * US, rel=1e-9, abs=1e-15)


def executions(result, cat="execution"):
    """(name, start µs, end µs) of the trace's spans of ``cat``, by start, device 0's only for nodes."""
    spans = [e for e in result.trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == cat]
    if cat == "execution":
        spans = [
            e
            for e in spans
            if e["args"]["device"] == e["tid"] and e["tid"] in (0, 1) and e["tid"] == spans[0]["tid"]
        ]
    return [
        (e["name"], round(e["ts"], 6), round(e["ts"] + e["dur"], 6))
        for e in sorted(spans, key=lambda e: e["ts"])
    ]


def test_a_chain_of_three_nodes():
    # Controller: the run 0-5, each node 2 µs: n0 enqueued at 7, n1 at 9, n2 at 11.
    # Device: n0 7-17, n1 waits for n0: 17-27, n2 27-37.
    profile = sim.Profile(controller=sim.ControllerCosts(run_s=5 * US, node_s=2 * US))
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
    result = sim.simulate(cluster, sim.chain(cluster, 3, compute_s=10 * US))
    assert result.makespan_s == approx(37)
    assert result.runs[0].dispatch_end == approx(11)
    assert executions(result) == [("chain/n0", 7, 17), ("chain/n1", 17, 27), ("chain/n2", 27, 37)]
    assert result.utilisation == pytest.approx(30 / 37)


def test_a_dcn_transfer_between_two_islands_on_two_hosts():
    # Controller: run 0-1, A 1-2, the transfer 2-3, B 3-4; then one message per host:
    # host 0 4-6, host 1 6-8. Host 0 gets it at 6+3=9: enqueues A 9-10, its side of the transfer 10-11.
    # Host 1 gets it at 8+3=11: its side of the transfer 11-12, B 12-13.
    # A runs 10-20; the transfer (5 + 4000 B at 1000 B/µs = 9 µs) 20-29; B 29-39.
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=1 * US, node_s=1 * US, transfer_s=1 * US),
        # Sending runs to hosts, the controller's cost per node or transfer is the hosts' node_s.
        hosts=sim.HostCosts(message_s=2 * US, latency_s=3 * US, enqueue_s=1 * US, node_s=1 * US),
        dcn=sim.LinkCosts(latency_s=5 * US, bytes_per_s=1e9),
    )
    cluster = sim.SimCluster(hosts=2, devices_per_host=1, islands=2, profile=profile)
    assert cluster.dispatch == "hosts"
    transfer_s = profile.dcn.transfer(4000)
    assert transfer_s == approx(9)
    program = sim.SimProgram(
        "dcn",
        (
            sim.Step("node", "A", (0, 1), 10 * US, inputs=(sim.PREVIOUS_RUN,), windowed=False),
            sim.Step(
                "transfer", "grads", (1, 2), transfer_s, inputs=(0,), src=(0, 1), link="dcn", nbytes=4000
            ),
            sim.Step("node", "B", (1, 2), 10 * US, inputs=(1,), windowed=False),
        ),
    )
    result = sim.simulate(cluster, program)
    assert result.makespan_s == approx(39)
    (transfer,) = [e for e in result.trace["traceEvents"] if e.get("cat") == "transfer"]
    assert (transfer["ts"], transfer["ts"] + transfer["dur"]) == (pytest.approx(20), pytest.approx(29))
    assert transfer["args"]["kind"] == "dcn" and transfer["args"]["bytes"] == 4000
    assert transfer["pid"] == 2  # island 1's process
    sends = [e["name"] for e in result.trace["traceEvents"] if e.get("name", "").startswith("send")]
    assert sends == ["send dcn to host 0", "send dcn to host 1"]  # one message per host per run
    starts = {e["name"]: e["ts"] for e in result.trace["traceEvents"] if e.get("cat") == "execution"}
    assert starts == {"dcn/A": pytest.approx(10), "dcn/B": pytest.approx(29)}


def test_a_host_paces_its_executables_as_the_runtime_s_hosts_do():
    # One message reaches host 0 at 0 (no costs but the host's 1 µs a node). It enqueues n_i at
    # i..i+1; n_i runs 1+10i..11+10i, each after the one before. At 26, about to enqueue n26, the host
    # has 26 enqueued and 2 done (n0 at 11, n1 at 21): PACE = 24 in flight. It waits until half are
    # done: 12 more, n2-n13, the last at 141; n26-n29 are enqueued 141-145. The device never idles:
    # the chain of 30 ends at 301. (Unpaced, the host would be done enqueueing at 30.)
    assert sim_engine.PACE == 24
    profile = sim.Profile(hosts=sim.HostCosts(enqueue_s=1 * US))
    cluster = sim.SimCluster(hosts=2, devices_per_host=1, islands=2, profile=profile)
    steps = tuple(
        sim.Step("node", f"n{i}", (0, 1), 10 * US, inputs=(i - 1,) if i else (), windowed=False)
        for i in range(30)
    )
    result = sim.simulate(cluster, sim.SimProgram("paced", steps))
    assert result.makespan_s == approx(301)
    (enqueue,) = [e for e in result.trace["traceEvents"] if e.get("cat") == "enqueue"]
    assert (enqueue["ts"], enqueue["ts"] + enqueue["dur"]) == (pytest.approx(0), pytest.approx(145))


def test_two_clients_interleave_in_submission_order():
    # Both clients submit 2 runs at t=0, alternately (a0 b0 a1 b1); FIFO dispatches them in that order,
    # 3 µs each (run 2 + node 1): enqueued at 3, 6, 9, 12. The device runs them back to back, 10 µs
    # each: a0 3-13, b0 13-23, a1 23-33, b1 33-43.
    profile = sim.Profile(controller=sim.ControllerCosts(run_s=2 * US, node_s=1 * US))
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
    a = sim.chain(cluster, 1, compute_s=10 * US, name="a_step")
    b = sim.chain(cluster, 1, compute_s=10 * US, name="b_step")
    result = sim.simulate(cluster, [sim.Workload(a, runs=2, client="a"), sim.Workload(b, runs=2, client="b")])
    order = [
        (r.client, r.index, r.dispatch_end / US, r.done / US)
        for r in sorted(result.runs, key=lambda r: r.done)
    ]
    assert order == [
        ("a", 0, pytest.approx(3), pytest.approx(13)),
        ("b", 0, pytest.approx(6), pytest.approx(23)),
        ("a", 1, pytest.approx(9), pytest.approx(33)),
        ("b", 1, pytest.approx(12), pytest.approx(43)),
    ]
    assert [e[0] for e in executions(result)] == ["a_step/n0", "b_step/n0", "a_step/n0", "b_step/n0"]
    assert {c.client: c.step_time_s for c in result.clients} == {"a": approx(20), "b": approx(20)}
    assert result.utilisation == pytest.approx(40 / 40)  # steady state: the device never idles


def test_a_full_in_flight_window_holds_the_controller_until_it_drains_to_half():
    # 2 devices (so every node counts against the window), a window of 2, nodes of 10 µs, 1 µs each to
    # dispatch. n0 dispatched 0-1, n1 1-2: the window is full. The controller waits until it drains to
    # 1 (n0 done at 11): n2 11-12, full again; waits for n1 (11-21): n3 21-22.
    # Devices: n0 1-11, n1 11-21, n2 21-31, n3 31-41.
    profile = sim.Profile(controller=sim.ControllerCosts(node_s=1 * US))
    cluster = sim.SimCluster(hosts=1, devices_per_host=2, profile=profile, in_flight=2)
    result = sim.simulate(cluster, sim.chain(cluster, 4, compute_s=10 * US))
    waits = executions(result, "wait")
    assert [(start, end) for _, start, end in waits] == [(2, 11), (12, 21)]
    assert waits[0][0] == "wait: in-flight window (island 0)"
    assert result.runs[0].dispatch_end == approx(22)
    assert result.makespan_s == approx(41)
    # A window of 8 never fills: dispatch is done at 4 µs, the devices finish at the same 41 µs.
    roomy = sim.simulate(
        sim.SimCluster(hosts=1, devices_per_host=2, profile=profile, in_flight=8),
        sim.chain(cluster, 4, compute_s=10 * US),
    )
    assert roomy.runs[0].dispatch_end == approx(4)
    assert roomy.makespan_s == approx(41)
    assert not executions(roomy, "wait")


def test_single_device_runs_fill_their_device_window():
    # 1 device, a device window of 2, one node of 10 µs a run, 1 µs to dispatch. r0 dispatched 0-1,
    # r1 1-2: full. The controller waits until it drains to 1 (r0 done at 11): r2 11-12; full again,
    # waits for r1 (done at 21): r3 21-22. Device: r0 1-11, r1 11-21, r2 21-31, r3 31-41.
    profile = sim.Profile(controller=sim.ControllerCosts(node_s=1 * US))
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile, device_in_flight=2)
    result = sim.simulate(cluster, sim.chain(cluster, 1, compute_s=10 * US), runs=4)
    waits = executions(result, "wait")
    assert [(start, end) for _, start, end in waits] == [(2, 11), (12, 21)]
    assert waits[0][0] == "wait: in-flight window (device 0)"
    assert [round(r.dispatch_end / US, 6) for r in result.runs] == [1, 2, 12, 22]
    assert result.makespan_s == approx(41)


def test_the_former_names_still_work_and_warn():
    # pw.sim.Cluster is SimCluster now (pw.Cluster is the running cluster); device_window= is device_in_flight=.
    with pytest.warns(DeprecationWarning, match="SimCluster"):
        old = sim.Cluster
    assert old is sim.SimCluster
    with pytest.warns(DeprecationWarning, match="device_in_flight"):
        cluster = old(hosts=1, devices_per_host=1, device_window=3)
    assert cluster.device_in_flight == 3 and cluster == sim.SimCluster(
        hosts=1, devices_per_host=1, device_in_flight=3
    )
    with pytest.warns(DeprecationWarning, match="device_in_flight"):
        assert cluster.device_window == 3
    with pytest.raises(AttributeError, match="Clusters"):
        sim.Clusters  # noqa: B018


def test_inline_execution_keeps_the_controller_in_the_call():
    # XLA:CPU runs a 1-device executable on the thread that calls it. Nodes of launch 2 + 10 µs; a
    # one-computation node would last 2 + 1, so the call keeps the controller 12 - 3 = 9 µs more.
    # r0: run 0-5, node 5-6, enqueued at 6 (device 6-18), in the call until 15; r1: 15-20, 20-21,
    # device 21-33, in the call until 30; r2: 30-35, 35-36, device 36-48. Done at 18, 33, 48: the
    # controller's 15 µs a run set the pace (the device needs 12).
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=5 * US, node_s=1 * US),
        device=sim.DeviceCosts(launch_s={1: 2 * US}, computation_s={1: 1 * US}, inline={1: 1.0}),
    )
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
    result = sim.simulate(cluster, sim.chain(cluster, 1, compute_s=10 * US), runs=3)
    assert [r.done / US for r in result.runs] == [pytest.approx(18), pytest.approx(33), pytest.approx(48)]
    assert result.runs[0].dispatch_end == approx(15)
    assert result.step_time_s == approx(15)
    # Without inline execution the device sets the pace: 12 µs a run.
    plain = dataclasses.replace(profile, device=dataclasses.replace(profile.device, inline={1: 0.0}))
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=plain)
    assert sim.simulate(cluster, sim.chain(cluster, 1, compute_s=10 * US), runs=3).step_time_s == approx(12)


def test_shared_cores_charge_the_controllers_work_to_the_devices():
    # CPU devices whose threads fill the cores lose the controller's working time while they run.
    # r0: node dispatched 0-4, runs 4-14. r1 dispatched 4-8 while r0 runs: 4 µs owed, so r1, which
    # starts when r0 ends (14), lasts 10 + 4: 14-28. Dispatch of r0 overlapped no node: nothing owed.
    profile = sim.Profile(
        controller=sim.ControllerCosts(node_s=4 * US),
        hosts=sim.HostCosts(node_s=4 * US),
        device=sim.DeviceCosts(shared_cpu={1: 1.0}),
    )
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
    result = sim.simulate(cluster, sim.chain(cluster, 1, compute_s=10 * US), runs=2)
    assert executions(result) == [("chain/n0", 4, 14), ("chain/n0", 14, 28)]
    # Remote hosts run their own devices: no charge there (free messages: r0 4-14, r1 14-24).
    hosts = sim.SimCluster(hosts=2, devices_per_host=1, islands=2, profile=profile)
    result = sim.simulate(hosts, sim.chain(hosts, 1, compute_s=10 * US, devices=(0, 1)), runs=2)
    assert [round(r.done / US, 6) for r in result.runs] == [14, 24]


def test_the_controllers_costs_by_device_count_and_jax_s_own_call_exempt_from_the_devices_loss():
    # On 2 CPU devices the controller's run costs 6 µs and a node 8 (1 device: 1 and 1), and of a
    # node's 8 the 3 that jax.jit's own call spends are already in the devices' figures.
    # r0: run 0-6, node 6-14, device 14-24 (no node ran meanwhile: nothing owed). r1: run 14-20
    # (r0 runs: 6 owed), node 20-28 (r0 runs until 24: 4, less the 3 exempt: 1 owed), so r1 lasts
    # 10 + 7: 28-45. r2: run 28-34 and node 34-42 all while r1 runs: 6 + 8 - 3 = 11 owed, 45-66.
    profile = sim.Profile(
        controller=sim.ControllerCosts(
            run_s=1 * US, node_s=1 * US, run_at_s={1: 1 * US, 2: 6 * US}, node_at_s={1: 1 * US, 2: 8 * US}
        ),
        device=sim.DeviceCosts(shared_cpu={1: 0.0, 2: 1.0}, launch_cpu_s={2: 3 * US}),
    )
    cluster = sim.SimCluster(hosts=1, devices_per_host=2, profile=profile)
    result = sim.simulate(cluster, sim.chain(cluster, 1, compute_s=10 * US, devices=(0, 2)), runs=3)
    assert executions(result) == [("chain/n0", 14, 24), ("chain/n0", 28, 45), ("chain/n0", 45, 66)]
    # Without the exemption r1 owes 6 + 4 (28-48), r2 all 14 (48-72); the scalars serve 1 device.
    owed = dataclasses.replace(profile, device=dataclasses.replace(profile.device, launch_cpu_s={}))
    cluster = sim.SimCluster(hosts=1, devices_per_host=2, profile=owed)
    result = sim.simulate(cluster, sim.chain(cluster, 1, compute_s=10 * US, devices=(0, 2)), runs=3)
    assert executions(result)[1:] == [("chain/n0", 28, 48), ("chain/n0", 48, 72)]
    one = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
    assert sim.simulate(one, sim.chain(one, 1, compute_s=10 * US), runs=1).makespan_s == approx(12)
    # The tables go through a profile's JSON and back; absent tables stay absent.
    data = profile.to_json()
    assert data["controller"]["node_at_s"] == {"1": 1 * US, "2": 8 * US}
    assert sim.load_profile(data) == dataclasses.replace(profile, name="custom")
    assert "launch_cpu_s" not in sim.Profile().to_json()["device"]


def test_controller_costs_by_device_count_come_from_the_python_threads_cpu_seconds():
    # Per call as the calibration's loops would see them, made from known costs.
    from pathways_jax.sim._calibrate import _L, PYTHON, local_costs

    per_call = {"pw-run": 20 * US, "pw-chain": 20 * US + (_L - 1) * 5 * US}
    for n in (1, 2):
        per_call |= {f"jax-one/{n}": 50 * US, f"jax-mid/{n}": 500 * US, f"jax-long/{n}": 1500 * US}
        per_call |= {f"jax-one-in/{n}": 4 * US, f"jax-mid-in/{n}": 10 * US}
    run, node, jax_call = 30 * US, 25 * US, 18 * US
    per_call |= {
        f"pw-run/2{PYTHON}": run + node,
        f"pw-chain/2{PYTHON}": run + _L * node,
        f"jax-one/2{PYTHON}": jax_call,
    }
    controller, device, _ = local_costs(per_call, [1, 2])
    assert controller.run(2) == pytest.approx(run) and controller.node(2) == pytest.approx(node)
    assert controller.run(1) == pytest.approx(15 * US) and controller.node(1) == pytest.approx(5 * US)
    assert controller.run_s == pytest.approx(15 * US) and device.launch_cpu(2) == pytest.approx(jax_call)
    # Without the Python threads' figures (no per-thread clocks): the 1-device scalars only.
    bare = {k: v for k, v in per_call.items() if not k.endswith(PYTHON)}
    controller, device, _ = local_costs(bare, [1, 2])
    assert controller.run_at_s == {} and controller.run(2) == controller.run_s and device.launch_cpu(2) == 0


def test_python_threads_cpu_seconds_count_every_python_thread():
    import queue
    import threading
    import time

    from pathways_jax.sim._calibrate import PYTHON, python_cpu_timer

    if not hasattr(time, "pthread_getcpuclockid"):
        pytest.skip("this OS has no per-thread CPU clocks")
    work, done = queue.Queue(), queue.Queue()

    def worker():  # another thread, as the controller's: 2 ms of CPU for each item
        while (seconds := work.get()) is not None:
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
            done.put(None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def loop(calls):  # the caller only waits: the CPU seconds are the other thread's
        start = time.perf_counter()
        for _ in range(calls):
            work.put(0.002)
            done.get(timeout=10)
        return time.perf_counter() - start

    try:
        figures = python_cpu_timer(loop, 0.05)()
    finally:
        work.put(None)
        thread.join(timeout=10)
    assert figures[PYTHON] == pytest.approx(0.002, rel=0.25)
    assert figures[""] >= figures[PYTHON] * 0.9


def test_host_messages_grow_with_hosts_and_gang_nodes_wait_for_the_last_host():
    # One SPMD node over every host: the controller sends one message per host (2 µs each), the node
    # starts once the last host has it: run 1 + node 1 + hosts x 2, then 1 µs to enqueue.
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=1 * US, node_s=1 * US),
        hosts=sim.HostCosts(message_s=2 * US, enqueue_s=1 * US, node_s=1 * US),
    )
    for hosts in (4, 64):
        cluster = sim.SimCluster(hosts=hosts, devices_per_host=4, profile=profile)
        result = sim.simulate(cluster, sim.spmd(cluster, 10 * US), record=False)
        assert result.makespan_s == approx(2 + 2 * hosts + 1 + 10)


def test_serial_messages_cost_the_controller_per_host_and_a_tree_per_round():
    # One SPMD node over every host; the controller's run 1 + node 1, then its messages (2 µs each).
    # Serial: one message a host, 2 + 2 H. Tree of degree 2: each round, every sender that has the
    # message (the controller, each host reached) sends it to 2 more: after r rounds 3^r - 1 hosts
    # have it, the controller sent 2 r messages: 2 + 4 r, for H = 3^r - 1 hosts.
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=1 * US, node_s=1 * US),
        hosts=sim.HostCosts(message_s=2 * US, latency_s=3 * US, enqueue_s=1 * US, node_s=1 * US),
    )

    def busy_us(hosts, **fanout):
        cluster = sim.SimCluster(hosts=hosts, devices_per_host=1, profile=profile, **fanout)
        result = sim.simulate(cluster, sim.spmd(cluster, 10 * US), record=False)
        return result.controller_busy * result.makespan_s / US, result.makespan_s

    for rounds in (2, 3, 4, 5):
        hosts = 3**rounds - 1
        serial, _ = busy_us(hosts)
        tree, _ = busy_us(hosts, fanout="tree", fanout_degree=2)
        assert serial == pytest.approx(2 + 2 * hosts)  # linear in hosts
        assert tree == pytest.approx(2 + 4 * rounds)  # linear in log3(hosts + 1)
    # 8 hosts, where the node starts: serial, the last message leaves at 2 + 16 = 18, lands at 21,
    # host 7 enqueues 21-22, the node runs 22-32. Tree: the controller sends to hosts 0-3 at 2-4,
    # 4-6, 6-8, 8-10; host 0 (has it at 7) forwards to 4 and 5 at 7-9, 9-11; host 1 (at 9) to 6 and
    # 7 at 9-11, 11-13; host 7 has it at 16 and enqueues 16-17 (the last): the node runs 17-27.
    assert busy_us(8)[1] == approx(32)
    assert busy_us(8, fanout="tree", fanout_degree=2)[1] == approx(27)
    assert sim._fanout.fanout_tree(range(8), "tree", 2) == {-1: (0, 1, 2, 3), 0: (4, 5), 1: (6, 7)}
    with pytest.raises(pw.errors.ResourceError, match="fanout must be one of"):
        sim.SimCluster(hosts=2, fanout="star")
    with pytest.raises(pw.errors.ResourceError, match="dispatch='local' the controller sends no messages"):
        sim.SimCluster(hosts=1, fanout="tree")


def test_a_broadcast_costs_the_controller_one_send_and_a_little_a_host():
    # As the runtime's channel: one send for every host, broadcast_s + H broadcast_host_s on the
    # controller, then every host has it latency_s later (no forwarding hop).
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=1 * US, node_s=1 * US),
        hosts=sim.HostCosts(
            message_s=2 * US, latency_s=3 * US, enqueue_s=1 * US, node_s=1 * US,
            broadcast_s=3 * US, broadcast_host_s=0.5 * US,
        ),
    )  # fmt: skip

    def run(hosts, **fanout):
        cluster = sim.SimCluster(hosts=hosts, devices_per_host=1, profile=profile, **fanout)
        result = sim.simulate(cluster, sim.spmd(cluster, 10 * US), record=False)
        return result.controller_busy * result.makespan_s / US, result.makespan_s

    for hosts in (2, 8, 80):
        busy, _ = run(hosts, fanout="broadcast")
        assert busy == pytest.approx(2 + 3 + 0.5 * hosts)
        assert busy <= run(hosts)[0]  # equal at 2 hosts, less beyond
    # 8 hosts: the send 2-9, every host has it at 12 and enqueues 12-13, the node runs 13-23.
    assert run(8, fanout="broadcast")[1] == approx(23)
    assert "fanout='broadcast'" in repr(sim.SimCluster(hosts=2, fanout="broadcast"))
    with pytest.raises(pw.errors.ResourceError, match="dispatch='local' the controller sends no messages"):
        sim.SimCluster(hosts=1, fanout="broadcast")


def test_hosts_sending_runs_pay_their_own_per_run_and_per_node_costs():
    # Sending a run to hosts, the controller pays controller.run_s + hosts.dispatch_s a run and
    # hosts.node_s a node (not controller.node_s): run 1 + 5, 3 nodes x 2, one message 4: 16 µs.
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=1 * US, node_s=100 * US),
        hosts=sim.HostCosts(dispatch_s=5 * US, node_s=2 * US, message_s=4 * US),
    )
    cluster = sim.SimCluster(hosts=2, devices_per_host=1, islands=2, profile=profile)
    result = sim.simulate(cluster, sim.chain(cluster, 3, compute_s=10 * US, devices=(0, 1)), record=False)
    assert result.runs[0].dispatch_end == approx(16)
    assert result.makespan_s == approx(16 + 3 * 10)


def test_hosts_sharing_a_machines_cores_take_turns_on_them():
    # One node on each of 2 hosts (10 µs of device time each). The controller: run 2, nodes 1 + 1,
    # a message to each host 3 + 3 (10 µs); each host: its run 4, an enqueue 1.
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=2 * US),
        hosts=sim.HostCosts(node_s=1 * US, message_s=3 * US, run_s=4 * US, enqueue_s=1 * US),
    )
    program = sim.SimProgram(
        "both",
        (
            sim.Step("node", "A", (0, 1), 10 * US, inputs=(), windowed=False),
            sim.Step("node", "B", (1, 2), 10 * US, inputs=(), windowed=False),
        ),
    )

    def makespan(cores):
        cluster = sim.SimCluster(hosts=2, devices_per_host=1, islands=2, profile=profile, cores=cores)
        return sim.simulate(cluster, program, record=False).makespan_s

    # Cores of their own: host 0 has its message at 7: run 7-11, enqueue 11-12, A 12-22; host 1 at
    # 10: 10-14, 14-15, B 15-25.
    assert makespan(None) == approx(25)
    # One core: nothing overlaps and something always waits for it, so the run takes all the
    # work there is: the controller's 10, the hosts' 2 x 5, the nodes' 2 x 10.
    assert makespan(1) == approx(10 + 2 * 5 + 2 * 10)
    # As many cores as threads: nothing waits, as with cores of their own.
    assert makespan(8) == approx(25)
    with pytest.raises(pw.errors.ResourceError, match="cores= models hosts"):
        sim.SimCluster(hosts=1, devices_per_host=2, cores=2)
    with pytest.raises(pw.errors.ResourceError, match="cores must be an integer >= 1"):
        sim.SimCluster(hosts=2, devices_per_host=1, cores=0)


def test_hosts_crowding_a_machines_cores_pay_towards_the_costs_measured_with_none_idle():
    # One node on host 0: the controller's run 2 + node 1 + message 3 (6), the host's run, an
    # enqueue 1, the node 10. The host's run is 4 µs with cores to spare (hosts) and 9 with none
    # idle (hosts_busy); between as many processes (hosts + the controller) as cores and twice as
    # many, the cost goes linearly from one to the other.
    costs = dict(node_s=1 * US, message_s=3 * US, enqueue_s=1 * US)
    profile = sim.Profile(
        controller=sim.ControllerCosts(run_s=2 * US),
        hosts=sim.HostCosts(run_s=4 * US, **costs),
        hosts_busy=sim.HostCosts(run_s=9 * US, **costs),
    )
    program = sim.SimProgram("one", (sim.Step("node", "A", (0, 1), 10 * US, inputs=(), windowed=False),))

    def makespan(hosts, cores, profile=profile):
        cluster = sim.SimCluster(hosts=hosts, devices_per_host=1, islands=hosts, profile=profile, cores=cores)
        return sim.simulate(cluster, program, record=False).makespan_s

    assert makespan(2, None) == approx(6 + 4 + 1 + 10)  # cores of their own: never crowded
    assert makespan(2, 3) == approx(6 + 4 + 1 + 10)  # 3 processes, 3 cores
    assert makespan(2, 2) == approx(6 + 6.5 + 1 + 10)  # 3 processes, 2 cores: halfway
    assert makespan(3, 2) == approx(6 + 9 + 1 + 10)  # 4 processes, 2 cores: none idle
    assert makespan(4, 2) == approx(6 + 9 + 1 + 10)  # and beyond
    assert makespan(4, 2, dataclasses.replace(profile, hosts_busy=None)) == approx(6 + 4 + 1 + 10)
    # The section reads back from a profile's JSON, and a profile without it has none.
    again = sim.load_profile(json.loads(json.dumps(profile.to_json())))
    assert again.hosts_busy == profile.hosts_busy and again.hosts == profile.hosts
    assert sim.load_profile(sim.Profile().to_json()).hosts_busy is None
    with pytest.raises(sim.ProfileError, match="hosts_busy"):
        sim.load_profile({"hosts_busy": {"run": 1.0}})


def test_the_busy_loops_run_with_no_idle_core_and_leave_nothing_running():
    import os

    from pathways_jax.sim._calibrate import cores_taken

    def cpu_s(proc):
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    with cores_taken() as spinners:
        assert len(spinners) == max(1, (os.cpu_count() or 1) - 1)
        first = [cpu_s(proc) for proc in spinners]
        # Each of them spins: its CPU seconds grow all the while (on a loaded machine, slowly:
        # how long 0.1 s of CPU takes is the scheduler's to say, so the wait is bounded, not fixed).
        assert wait_for(
            lambda: all(cpu_s(proc) - t > 0.1 for proc, t in zip(spinners, first, strict=True)), timeout=60
        ), "a busy loop did not spin"
        assert all(proc.poll() is None for proc in spinners)
    assert all(proc.poll() is not None for proc in spinners)  # killed and reaped
    with pytest.raises(KeyError), cores_taken(1) as spinners:
        raise KeyError("inside")
    assert spinners[0].poll() is not None


def test_host_costs_come_from_each_processs_cpu_seconds():
    # CPU seconds a call as the Ray calibration loops would see them, made from known costs: the
    # calibration must give those costs back.
    from pathways_jax.sim._calibrate import _RAY_L, host_costs

    controller = sim.ControllerCosts(run_s=20 * US, node_s=9 * US)
    device = sim.DeviceCosts(launch_s={1: 7 * US}, computation_s={1: 1 * US})
    run, node, message, dispatch = 20 * US, 3 * US, 500 * US, 300 * US
    host_run, enqueue, d = 1000 * US, 10 * US, 8 * US
    per_call = {
        "ray-one/controller": run + dispatch + node + message,
        "ray-both/controller": run + dispatch + 2 * node + 2 * message,
        "ray-chain/controller": run + dispatch + _RAY_L * node + message,
        "ray-one/host0": host_run + d,
        "ray-chain/host0": host_run + d + (_RAY_L - 1) * (enqueue + d),
    }
    got = host_costs(per_call, controller, device)
    assert got.node_s == pytest.approx(node)
    assert got.message_s == pytest.approx(message)
    assert got.dispatch_s == pytest.approx(dispatch)
    assert got.run_s == pytest.approx(host_run)
    assert got.enqueue_s == pytest.approx(enqueue)
    # The loops measured with no idle core (their names end in BUSY) give hosts_busy's costs.
    from pathways_jax.sim._calibrate import BUSY

    doubled = {k.replace("/", BUSY + "/"): 2 * v for k, v in per_call.items()}
    assert host_costs({**per_call, **doubled}, controller, device) == got
    busy = host_costs(doubled, sim.ControllerCosts(), sim.DeviceCosts(), BUSY)
    assert busy.run_s == pytest.approx(2 * (host_run + d)) and busy.message_s == pytest.approx(2 * message)


def test_fair_scheduler_shares_by_weight():
    profile = sim.Profile(controller=sim.ControllerCosts(run_s=1 * US))
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile, scheduler="fair")
    a = sim.chain(cluster, 1, compute_s=10 * US, name="a")
    b = sim.chain(cluster, 1, compute_s=10 * US, name="b")
    result = sim.simulate(
        cluster,
        [sim.Workload(a, runs=30, client="a", weight=3.0), sim.Workload(b, runs=30, client="b")],
        record=False,
    )
    first = sorted(result.runs, key=lambda r: r.done)[:20]
    assert sum(r.client == "a" for r in first) == 15  # 3:1 while both have runs queued


def test_predict_a_traced_program_and_draw_its_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    s = pw.devices(mesh={"x": 2})
    dense = pw.jit(lambda w, x: jnp.tanh(x @ w), devices=s)
    total = pw.jit(lambda x: x.sum(), devices=s)

    @pw.program(fuse=False)
    def step(w, x):
        return total(dense(w, x))

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    cluster = sim.SimCluster(hosts=2, profile="tpu_v4")
    pred = pw.sim.predict(step, w, x, cluster=cluster, runs=4)
    assert pred.step_time_s > 0
    assert 0 < pred.utilisation <= 1
    # Every node runs on all 8 simulated devices (the slice is all of this machine's island... scaled).
    nodes = [e for e in pred.timeline["traceEvents"] if e.get("cat") == "execution"]
    assert len(nodes) == 4 * 2 * len({e["tid"] for e in nodes})
    assert {e["args"]["program"] for e in nodes} == {"step"}
    png = tmp_path / "sim.png"
    fig = pw.plot_timeline(pred.timeline, png)
    assert fig is not None and png.stat().st_size > 0
    trace = tmp_path / "sim.json"
    pred.save_timeline(trace)
    assert pw.plot_timeline(str(trace)) is not None
    s.release()


def test_predict_names_the_node_times_it_is_given():
    s = pw.devices(mesh={"x": 1})
    f = pw.jit(lambda v: v + 1, devices=s)
    prog = pw.program(lambda v: f(f(v)), name="two", fuse=False)
    profile = sim.Profile(controller=sim.ControllerCosts(run_s=4 * US, node_s=1 * US))
    cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
    names = [n.name for n in prog.graph(jnp.zeros(3)).nodes]
    # Run 0-4, nodes dispatched at 5 and 6; 100 µs each: 5-105, 105-205; the next run's first node
    # waits for 205, so the steady step is 200 µs.
    pred = sim.predict(prog, jnp.zeros(3), cluster=cluster, node_times=dict.fromkeys(names, 100 * US), runs=6)
    assert pred.result.runs[0].done == approx(205)
    assert pred.step_time_s == approx(200)
    s.release()


def test_errors_are_named_types():
    with pytest.raises(pw.errors.ResourceError, match="no profile named 'nope'"):
        sim.SimCluster(hosts=2, profile="nope")
    with pytest.raises(sim.ProfileError):
        sim.load_profile({"controller": {"run_s": -1}})
    with pytest.raises(sim.ProfileError, match="unknown fields"):
        sim.load_profile({"controller": {"runs": 1}})
    with pytest.raises(pw.errors.ResourceError, match="hosts must be an integer >= 1"):
        sim.SimCluster(hosts=0)
    with pytest.raises(pw.errors.ResourceError, match="cannot split 3 hosts"):
        sim.SimCluster(hosts=3, islands=2)
    cluster = sim.SimCluster(hosts=1, devices_per_host=2, profile=sim.Profile())
    bad = sim.SimProgram("bad", (sim.Step("node", "n", (0, 4), 1.0),))
    with pytest.raises(pw.errors.ResourceError, match=r"devices \[0, 4\); the cluster has 2"):
        sim.simulate(cluster, bad)
    with pytest.raises(pw.errors.ProgramTraceError):
        sim.predict(42, cluster=cluster)


def test_profiles_ship_with_sources():
    assert {"cpu_2core", "tpu_v4"} <= set(sim.builtin_profiles())
    tpu = sim.load_profile("tpu_v4")
    assert tpu.devices_per_host == 4 and tpu.device.flops_per_s > 1e14
    for field in (
        "device.flops_per_s",
        "ici.bytes_per_s",
        "dcn.bytes_per_s",
        "hosts.message_s",
        "controller.run_s",
    ):
        assert tpu.sources.get(field), field
    cpu = sim.load_profile("cpu_2core")
    assert cpu.meta["machine"]["cpu_count"] >= 1 and cpu.controller.run_s > 0
    # Measured twice on Ray hosts: with cores to spare and with none idle, each figure named.
    assert cpu.hosts.run_s > 0 and cpu.hosts_busy is not None and cpu.hosts_busy.run_s > 0
    assert cpu.sources.get("hosts_busy", "").startswith("measured")
    assert sim.load_profile(sim.builtin_profiles and (sim._profile.PROFILES_DIR / "tpu_v4.json")) == tpu


@pytest.mark.timeout(120)
def test_calibration_quick_mode_writes_a_profile(tmp_path):
    out = tmp_path / "here.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pathways_jax.sim", "calibrate", "--quick", f"--out={out}"],
        capture_output=True, text=True, timeout=110, cwd=ROOT, env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray hosts not measured" in proc.stdout
    profile = sim.load_profile(out)
    assert profile.name == "here"
    assert profile.controller.run_s > 0 and profile.controller.node_s > 0
    assert set(profile.device.computation_s) == {1, 2}
    # On 2 devices the controller's costs are the Python threads' CPU seconds there.
    assert set(profile.controller.run_at_s) == {1, 2} and profile.controller.node(2) > 0
    assert profile.device.launch_cpu(2) > 0
    assert profile.meta["quick"] is True
    assert json.loads(out.read_text())["sources"]["controller.node_s"].startswith("measured")


@pytest.mark.timeout(120)
def test_without_simpy_the_package_imports_and_the_simulator_says_which_extra():
    code = (
        "import sys\n"
        "sys.modules['simpy'] = None\n"
        "import pathways_jax as pw\n"
        "assert 'pathways_jax.sim' not in sys.modules\n"
        "c = pw.sim.SimCluster(hosts=2, profile='tpu_v4')\n"
        "try:\n"
        "    pw.sim.simulate(c, pw.sim.spmd(c, 1e-3))\n"
        "except pw.errors.ClusterError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=110,
        env={"JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SimulatorUnavailable" in proc.stdout
    assert "pip install 'pathways-jax[sim]'" in proc.stdout


def test_importing_pathways_jax_does_not_import_simpy():
    loaded = modules_of_a_fresh_import()["package"]  # a fresh process, after `import pathways_jax`
    assert "pathways_jax" in loaded
    assert "simpy" not in loaded and "pathways_jax.sim" not in loaded


# Script runs of this module that go side by side (pure Python each, on one core): by test name.
@pytest.mark.timeout(300)
def test_sim_predict_example_runs(background_run):  # run in the background (conftest.py, BACKGROUND)
    out = background_run[0].output()
    assert "predicted step" in out
    assert "hosts" in out


@pytest.mark.timeout(120)
def test_scale_benchmark_quick_mode_writes_every_figure(background_run):
    script, tmp_path = background_run
    script.output()
    report = json.loads((tmp_path / "sim_scale_quick.json").read_text())
    assert set(report["dispatch"]) == {"1", "16"}
    for row in report["dispatch"].values():
        assert {"jax-O", "jax-F", "pw-O", "pw-C", "pw-F"} <= set(row)
    # The controller's cost a run grows with the hosts it messages: so does the threshold.
    assert report["threshold"]["16"]["95%"] > report["threshold"]["1"]["95%"] > 0
    assert report["threshold_ray_message"]["16"]["95%"] > report["threshold"]["16"]["95%"]
    # The measured channel's messages: a tree sends fewer from the controller than one per host.
    serial, tree = report["threshold_channel"]["16"], report["threshold_channel_tree"]["16"]
    assert serial["controller_messages"] == 16 > tree["controller_messages"]
    assert serial["95%"] > tree["95%"] > 0
    broadcast = report["threshold_channel_broadcast"]["16"]
    assert broadcast["controller_messages"] == 1 and serial["95%"] > broadcast["95%"] > 0
    for row in report["pipeline"]["rows"]:
        assert 0 < row["vs_spmd"] <= row["bubble_bound"] + 1e-9
    assert 0 < report["two_islands"]["rows"][0]["ratio"] < 1


@pytest.mark.timeout(120)
def test_validation_benchmark_quick_mode_reports_every_point(background_run):
    # Only that it runs and reports: the validation itself is in benchmarks/README.md, not timed here.
    script, tmp_path = background_run
    script.output()
    report = json.loads((tmp_path / "sim_validate_quick.json").read_text())
    assert set(report["local"]) == {"1", "2"}
    for row in report["local"].values():
        for mode in ("pw-O", "pw-C", "pw-F"):
            point = row[mode]
            assert point["measured"] > 0 and point["simulated"] > 0, mode
            assert point["error"] == pytest.approx(point["simulated"] / point["measured"] - 1)
    assert report["points"] == 6 and report["ray"] is None
