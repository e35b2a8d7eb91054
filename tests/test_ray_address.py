"""Ray backend: joining a Ray cluster that was started outside the process (``address=``).

A head node is started with ``ray start --head --block`` in its own session
(this module starts no Ray cluster of its own), and a separate Python process
runs a two-host program against it with ``pw.init(backend="ray", address=...)``.
"""

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(240)

CLIENT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import pathways_jax as pw

    cluster = pw.init(backend="ray", address=sys.argv[1], hosts=2, devices_per_host=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)

    @pw.program
    def step(x):
        with a:
            y = jnp.sin(x) * 3
        with b:
            return y.sum()

    x = jnp.arange(8.0)
    got = step(x).result(timeout=120)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(lambda v: (jnp.sin(v) * 3).sum())(x)), rtol=1e-6)
    pids = sorted({info["pid"] for info in cluster.backend.info})
    print("joined", len(pids), "hosts; result matches jax.jit")
    """
)


@contextlib.contextmanager
def _ray_head(env: dict) -> Iterator[str]:
    """A Ray head started with ``ray start --head --block`` in its own session, under ``env``: its address."""
    ray_cli = pathlib.Path(sys.executable).with_name("ray")
    # `ray start` records its address for later `ray.init()`s on this machine, and the
    # record outlives the cluster: put back what was there before.
    record = pathlib.Path("/tmp/ray/ray_current_cluster")
    previous = record.read_text() if record.exists() else None
    head = subprocess.Popen(
        [
            str(ray_cli),
            "start",
            "--head",
            "--block",
            "--port=0",
            "--num-cpus=2",
            "--include-dashboard=false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its raylet, GCS and workers end with it, not with other clusters
    )
    try:
        address = None
        seen = []
        deadline = time.monotonic() + 120
        while address is None and time.monotonic() < deadline:
            line = head.stdout.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"ray start --address='([^']+)'", line)
            if found:
                address = found.group(1)
        assert address, "the Ray head did not report its address:\n" + "".join(seen)
        yield address
    finally:
        # Its own session's processes are killed: Ctrl-C (SIGINT) stops `ray start --block` in
        # about a second alone, but in full suites it did not stop (the test took 68 s with a
        # 60 s wait for it, 23 s with 15 s), nor with SIGTERM, and every full suite ended it so.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)
        head.stdout.close()
        if previous is None:
            record.unlink(missing_ok=True)
        else:
            record.write_text(previous)


def _run_client(path: pathlib.Path, source: str, address: str, env: dict, timeout: float):
    """Runs ``source`` (written to ``path``) as a client process given ``address``; it must succeed."""
    path.write_text(source)
    proc = subprocess.run(
        [sys.executable, str(path), address],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc


def test_joins_a_running_ray_cluster(tmp_path: pathlib.Path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0")
    env.pop("XLA_FLAGS", None)
    with _ray_head(env) as address:
        # The head uses Ray's token authentication (its default), and a driver joining by
        # address sends the token Ray saved for this user only in token mode: pw.init turns
        # it on when the process has not chosen (an earlier ray.init of this suite sets it).
        client_env = dict(env)
        client_env.pop("RAY_AUTH_MODE", None)
        proc = _run_client(tmp_path / "client.py", CLIENT, address, client_env, timeout=180)
        assert "joined 2 hosts; result matches jax.jit" in proc.stdout


ONE_HOST = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import pathways_jax as pw

    pw.init(backend="ray", address=sys.argv[1], hosts=1)
    x = jnp.arange(4.0)
    got = pw.jit(lambda v: jnp.cos(v) + 1, devices=pw.devices(mesh={"x": 1}))(x).result(timeout=60)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda v: jnp.cos(v) + 1)(x)))
    print("result matches jax.jit")
    """
)


def test_joins_a_ray_cluster_started_without_authentication_while_a_token_is_at_hand(tmp_path):
    # A head started with RAY_AUTH_MODE=disabled (Ray's opt-out), joined from a process with a
    # token at hand (one `ray start` or a local ray.init saved, here RAY_AUTH_TOKEN): pw.init turned
    # token mode on, ray.init joined, and every actor the process made there died before it
    # started ("the Ray host actors did not start"; a service's client was dropped at once).
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env.pop("XLA_FLAGS", None)
    with _ray_head(env) as address:
        client_env = dict(env, RAY_AUTH_TOKEN="0123456789abcdef0123456789abcdef")
        client_env.pop("RAY_AUTH_MODE")
        proc = _run_client(tmp_path / "one_host.py", ONE_HOST, address, client_env, timeout=120)
        assert "result matches jax.jit" in proc.stdout
        from pathways_jax._src.backends import ray_auth

        assert ray_auth.ask(address) == "answered"


WRONG_TOKEN = textwrap.dedent(
    """
    import sys, time
    import pathways_jax as pw

    for call in (
        lambda: pw.init(backend="ray", address=sys.argv[1], hosts=1),
        lambda: pw.init(backend="ray", address=sys.argv[1], service="pathways"),
        lambda: pw.serve("pathways", hosts=1, address=sys.argv[1]),
    ):
        started = time.monotonic()
        try:
            call()
        except pw.errors.ClusterError as exc:
            print("REFUSED", round(time.monotonic() - started, 1), exc)
    """
)


def test_a_token_the_cluster_refuses_or_none_is_refused_within_seconds(ray_cluster, tmp_path):
    # The suite's own local cluster asks for a token (Ray turns token authentication on for a new
    # local cluster). A process with another cluster's token, or none, waited 20 s for ray.init,
    # then was told it 'could not reach the Ray cluster ... Check the address'.
    import ray

    from pathways_jax._src.backends import ray_auth

    if os.environ.get("RAY_AUTH_MODE") != "token":
        pytest.skip("the suite's Ray cluster was started without token authentication")
    address = ray.get_runtime_context().gcs_address
    token, _ = ray_auth.token_at_hand()
    assert ray_auth.ask(address, token) == "answered"
    assert ray_auth.ask(address) == "refused"
    assert ray_auth.ask(address, "0" * 32) == "refused"
    assert ray_auth.ask("127.0.0.1:1") == "unknown"  # nothing there: left to Ray
    script = tmp_path / "wrong_token.py"
    script.write_text(WRONG_TOKEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(JAX_PLATFORMS="cpu", HOME=str(tmp_path))  # no token saved here
    for extra, said in (({"RAY_AUTH_TOKEN": "0" * 32}, "refused the authentication token"), ({}, "has none")):
        done = subprocess.run(
            [sys.executable, str(script), address],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, **extra},
        )
        refusals = [line.split(" ", 2) for line in done.stdout.splitlines() if line.startswith("REFUSED")]
        assert len(refusals) == 3, (done.stdout, done.stderr[-3000:])
        for _, seconds, message in refusals:
            assert float(seconds) < 10 and said in message and "RAY_AUTH_TOKEN" in message, message


REINIT = textwrap.dedent(
    """
    import time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)  # stand-ins for up to 8 hosts' devices
    import jax.numpy as jnp, numpy as np, ray
    import pathways_jax as pw

    pw.init(backend="ray", hosts=1, devices_per_host=1)  # a local session of this machine's CPUs
    pw.shutdown()
    start = time.monotonic()
    wanted = max(ray.cluster_resources()["CPU"], 1) + 1
    pw.init(backend="ray", hosts=int(wanted), devices_per_host=1)  # more hosts than it has CPUs
    print("started", time.monotonic() - start)
    out = pw.jit(lambda v: v * 2, devices=pw.devices(mesh={"x": 1}, island=int(wanted) - 1))(jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(out.result(timeout=120)), np.full(2, 2.0))
    pw.shutdown()
    """
)


def test_a_later_init_for_more_hosts_gets_a_larger_local_session(tmp_path: pathlib.Path):
    # The local session pw.init starts stays up, sized for its hosts: a later pw.init for more
    # hosts waited 120 s for a placement that could not come.
    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    started = float(re.search(r"started ([\d.]+)", done.stdout).group(1))
    assert started < 60, done.stdout


def test_an_init_for_more_hosts_than_the_users_own_ray_session_has_is_refused_at_once(ray_cluster):
    # A Ray session the user started (here the suite's, from ray.init) is not pathways_jax's to
    # replace: a pw.init asking for more hosts than it has CPUs is refused, saying what to do.
    cpus = int(ray_cluster.cluster_resources()["CPU"])
    with pytest.raises(
        pw.errors.ClusterError,
        match=rf"pw.init asks for {cpus + 1} hosts \(a Ray CPU each\), but this process's Ray session has "
        rf"{cpus} CPUs. Start Ray with more \(ray.init\(num_cpus={cpus + 1}\)\)",
    ):
        pw.init(backend="ray", hosts=cpus + 1, devices_per_host=1)
    assert ray_cluster.is_initialized() and int(ray_cluster.cluster_resources()["CPU"]) == cpus


_REFUSALS = textwrap.dedent(
    """
    import json, os, sys, time
    import pathways_jax as pw

    dead, others = json.loads(sys.argv[1])

    def refused(group, call):
        started = time.monotonic()
        try:
            call()
        except pw.errors.ClusterError as exc:
            print("REFUSED", group, round(time.monotonic() - started, 1), json.dumps(str(exc)), flush=True)

    for address in others:
        for call in (
            lambda: pw.init(backend="ray", address=address, hosts=1),
            lambda: pw.init(backend="ray", address="ray://" + address, service="pathways"),
            lambda: pw.serve("pathways", hosts=1, address=address),
        ):
            refused("elsewhere", call)
    # "auto": the address RAY_ADDRESS (or `ray start`'s record, which outlives its cluster) names.
    os.environ["RAY_ADDRESS"] = dead
    for call in (
        lambda: pw.init(backend="ray", address=dead, hosts=1),
        lambda: pw.init(backend="ray", address="ray://" + dead, service="pathways"),
        lambda: pw.serve("pathways", hosts=1, address=dead),
        lambda: pw.init(backend="ray", address="auto", service="pathways"),
        lambda: pw.serve("pathways", hosts=1, address="auto"),
    ):
        refused("nothing", call)
    """
)


@pytest.fixture(scope="module")
def refusals() -> dict:
    """One process (a Python and pathways_jax start costs seconds) calls pw.init and pw.serve with
    addresses where no Ray cluster listens: a closed port (``"dead"``), and servers that are not Ray
    (a web server, a controller service's own ZeroMQ channel, one that hangs up: ``"others"``).
    What it printed, its refusals by group (seconds taken, message) and the addresses it was given."""
    import http.server
    import json
    import socket
    import threading

    import zmq

    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    context = zmq.Context()
    channel = context.socket(zmq.ROUTER)
    channel.setsockopt(zmq.LINGER, 0)
    zmq_port = channel.bind_to_random_port("tcp://127.0.0.1")
    rude = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        while True:
            try:
                conn, _ = rude.accept()
            except OSError:
                return
            conn.close()

    threads = [
        threading.Thread(target=web.serve_forever, daemon=True),
        threading.Thread(target=hang_up, daemon=True),
    ]
    for thread in threads:
        thread.start()
    others = [f"127.0.0.1:{port}" for port in (web.server_address[1], zmq_port, rude.getsockname()[1])]
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _REFUSALS, json.dumps([dead, others])],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    finally:
        web.shutdown()
        web.server_close()
        rude.close()
        channel.close()
        context.term()
    by_group: dict[str, list] = {"nothing": [], "elsewhere": []}
    for line in done.stdout.splitlines():
        if line.startswith("REFUSED"):
            _, group, seconds, message = line.split(" ", 3)
            by_group[group].append((float(seconds), json.loads(message)))
    return {"said": (done.stdout, done.stderr[-3000:]), "dead": dead, "others": others, **by_group}


def test_an_address_where_no_ray_cluster_listens_is_refused_within_seconds(refusals):
    """ray.init retries a refused address for minutes; pw.init and pw.serve say so at once."""
    assert len(refusals["nothing"]) == 5, refusals["said"]
    for seconds, message in refusals["nothing"]:
        assert seconds < 10 and refusals["dead"] in message and "could not reach" in message, message


def test_an_address_where_something_else_listens_is_refused_within_seconds(refusals):
    """An address where a server that is not Ray takes connections (a web server, a controller
    service's own ZeroMQ channel, one that hangs up): ray.init retries it for 20 s; pw.init and
    pw.serve say at once that it is not a Ray cluster."""
    assert len(refusals["elsewhere"]) == 9, refusals["said"]
    for i, (seconds, message) in enumerate(refusals["elsewhere"]):
        assert seconds < 10, (seconds, message)
        assert refusals["others"][i // 3] in message and "is not a Ray cluster's address" in message, message
