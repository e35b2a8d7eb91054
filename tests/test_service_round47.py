"""The controller service as client processes and shells written from the README meet it.

Results are compared with plain ``jax.jit`` on the same inputs; the command line's own checks
need no service (``pw.serve`` is replaced where a test only reads what it was given).
"""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
from helpers import jax_config, wait_for

import pathways_jax as pw

pytestmark = pytest.mark.timeout(180)


def test_the_command_line_takes_address_and_name_after_its_command_too(monkeypatch, capsys):
    # `python -m pathways_jax serve --hosts 4 --address HEAD:6379` (or `stats --name eval`) was
    # refused as "unrecognized arguments": --address and --name were taken only before the
    # command, where the README's lines (`python -m pathways_jax stats`) never show them.
    from pathways_jax.__main__ import main

    given: dict = {}
    asked: list = []

    def serve(name, **kwargs):
        given.update(kwargs, name=name)
        return types.SimpleNamespace(name=name, address="here:1")

    def service(name, *, address=None):
        asked.append((name, address))
        return types.SimpleNamespace(stats=lambda: {"name": name}, stop=lambda: None)

    monkeypatch.setattr(pw, "serve", serve)
    monkeypatch.setattr(pw, "service", service)
    assert main(["serve", "--hosts", "2", "--address", "head:6379", "--name", "eval"]) == 0, (
        capsys.readouterr()
    )
    assert (given["name"], given["address"], given["hosts"]) == ("eval", "head:6379", 2)
    assert main(["stats", "--name", "eval", "--address", "head:6379"]) == 0, capsys.readouterr()
    assert main(["stop", "--name=eval"]) == 0, capsys.readouterr()
    assert asked == [("eval", "head:6379"), ("eval", "auto")]
    # Given on both sides, the one after the command is the one meant (as it reads).
    assert main(["--name", "a", "stop", "--name", "b"]) == 0
    assert asked[-1] == ("b", "auto")
    # Before the command, as before; left out, the defaults.
    given.clear()
    assert main(["--address", "h:1", "--name", "n", "serve", "--hosts", "1"]) == 0
    assert (given["name"], given["address"]) == ("n", "h:1")
    given.clear()
    assert main(["serve", "--hosts", "1"]) == 0
    assert (given["name"], given["address"]) == ("pathways", "auto")


def test_the_command_line_refuses_to_serve_in_a_ray_cluster_that_ends_with_it(monkeypatch, capsys):
    # `python -m pathways_jax serve --address local --hosts 1` started a Ray cluster in the
    # command's own process, printed "is running in the Ray cluster at ..." with a join line,
    # and returned: the cluster, and the service in it, ended with the command, and the line
    # printed named nothing any more.
    from pathways_jax.__main__ import main

    monkeypatch.setattr(pw, "serve", lambda *a, **k: pytest.fail("pw.serve was called"))
    for argv in (
        ["serve", "--hosts", "1", "--address", "local"],
        ["--address", "local", "serve", "--hosts", "1"],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "--address local" in err and "ends with this command" in err, err
        assert "ray start --head" in err, err


def test_a_service_says_why_it_refused_or_dropped_a_client_and_stops_once_many_left(ray_cluster):
    # One service for three checks (a service start costs seconds). Stop: the service lists the
    # last 64 clients that left and forgets older ones as another goes. Its stop dropped its
    # joined clients while walking its table of clients, so once more had left than it lists,
    # the first one dropped changed the table under the walk: stop raised
    # RuntimeError, the later joined clients were not told, and its hosts were not stopped.
    import importlib

    svc = pw.serve("test-round47-stop", hosts=1)
    try:
        # A process whose jax_enable_x64 differs from the service's is refused, saying what to do.
        with (
            jax_config("jax_enable_x64", True),
            pytest.raises(
                pw.errors.ClusterError,
                match=r"jax_enable_x64=False, this process with True.*jax_enable_x64', False\) in this "
                r"process before pw.init, or join a service started from a process with it True",
            ),
        ):
            pw.init(backend="ray", address=svc.address, service=svc.name, client_name="x64")
        pw.init(backend="ray", address=svc.address, service=svc.name, client_name="first")
        first = pw.jit(lambda v: v + 1, devices=pw.devices(mesh={"x": 1}))
        assert float(first(np.float32(1)).result(timeout=60)) == 2.0
        # Its token actor killed (`ray kill`, Ray's memory monitor) while the process lives: the
        # service drops it, and says why, not that its process died.
        ray_cluster.kill(pw.cluster().backend._token)
        said: list[str] = []

        def dropped() -> bool:
            try:
                first(np.float32(1)).result(timeout=60)
            except pw.errors.ClusterError as exc:
                said.append(str(exc))
                return True
            return False

        assert wait_for(dropped, timeout=60)
        assert re.search(
            r"its token actor, .* died \(it was killed by `ray.kill`; ActorDiedError\)", said[0]
        ), said
        pw.shutdown()  # one that left
        pw.init(backend="ray", address=svc.address, service=svc.name, client_name="last")
        step = pw.jit(lambda v: v * 3 + 1, devices=pw.devices(mesh={"x": 1}))
        np.testing.assert_array_equal(step(np.arange(4.0)).result(timeout=60), np.arange(4.0) * 3 + 1)

        def list_one_that_left(actor):  # as if 64 had left: the next one to go forgets the first
            importlib.import_module("pathways_jax._src.runtime.serving.actor")._DEPARTED_KEPT = 1

        ray_cluster.get(svc.actor.__ray_call__.remote(list_one_that_left), timeout=30)
        ray_cluster.get(svc.actor.stop.remote(), timeout=60)  # raised RuntimeError
        with pytest.raises(pw.errors.ClusterError, match="dropped this process: the service stopped"):
            step(np.arange(4.0)).result(timeout=60)
    finally:
        pw.shutdown()
        svc.stop()


class _RayPort:
    """A gRPC server that answers as one of a Ray head's ports: ``answers`` maps the methods it has
    to the status it gives (the others are UNIMPLEMENTED, as a server without them says)."""

    def __init__(self, answers: dict):
        import concurrent.futures

        import grpc

        def handler(code):
            def answer(request, context):
                if code != grpc.StatusCode.OK:
                    context.abort(code, "as Ray's")
                return b""

            return grpc.unary_unary_rpc_method_handler(answer)

        class Methods(grpc.GenericRpcHandler):
            def service(self, details):
                code = answers.get(details.method)
                return None if code is None else handler(code)

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((Methods(),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(None)


def test_ray_s_client_port_and_gcs_port_taken_for_each_other_are_refused_in_seconds_saying_which():
    # Port 10001 (Ray Client's server) given as the cluster's address, or the GCS port (6379) with
    # 'ray://', is the classic mix-up: both speak gRPC, so it passed the check for "not a Ray
    # address" and Ray retried it, 20 s (then "Failed to connect to Ray cluster") or 30 s (then
    # "ray client connection timeout"), never saying which port was meant.
    import time

    import grpc

    from pathways_jax._src.backends import ray_auth, ray_boot

    client_call = "/ray.rpc.RayletDriver/ClusterInfo"
    ports = {
        # As Ray answers a caller without its token (the first call every client makes)...
        "client": _RayPort({client_call: grpc.StatusCode.UNAUTHENTICATED}),
        "gcs": _RayPort({ray_auth.CALL: grpc.StatusCode.UNAUTHENTICATED}),
        # ...and a GCS of a cluster started without authentication.
        "open gcs": _RayPort({ray_auth.CALL: grpc.StatusCode.OK}),
    }
    try:
        started = time.monotonic()
        where = ports["client"].address
        with pytest.raises(
            pw.errors.ClusterError, match=rf"is Ray Client's server .* address='ray://{where}'"
        ):
            ray_boot.check_reachable(where)
        for gcs in (ports["gcs"].address, ports["open gcs"].address):
            with pytest.raises(
                pw.errors.ClusterError,
                match=rf"names a Ray cluster's GCS port .* address='{gcs}', without 'ray://'",
            ):
                ray_boot.check_reachable("ray://" + gcs)
            ray_boot.check_reachable(gcs)  # as meant: left to Ray
        ray_boot.check_reachable("ray://" + where)
        assert time.monotonic() - started < 10
    finally:
        for port in ports.values():
            port.close()


def test_a_channel_listens_on_one_machine_whatever_the_length_of_tmpdir(tmp_path, monkeypatch):
    # A client process (or a controller) whose TMPDIR is long (a job scheduler's per-job folder,
    # a build sandbox) crashed in pw.init with ZeroMQ's raw ZMQError: its channel's socket files
    # went under TMPDIR, past the 107 characters a Unix socket's path may have.
    import secrets
    import tempfile

    from pathways_jax._src import wire

    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again, as a fresh process does
    key = secrets.token_bytes(32)
    with wire.Server(key, transport="ipc") as server, wire.Peer(server.address, key, identity=b"h") as peer:
        peer.send(wire.Done(seq=0))
        hello = server.recv(timeout=10)
        server.send(hello.peer, wire.Fetch(key=7))
        assert peer.recv(timeout=10).body == wire.Fetch(key=7)
    # Where no folder is short enough, it listens on loopback TCP: one machine still.
    from pathways_jax._src.wire import channel

    monkeypatch.setattr(channel, "_IPC_PATH_MAX", 4)
    with wire.Server(key, transport="ipc") as server, wire.Peer(server.address, key, identity=b"h") as peer:
        assert server.address.up.startswith("tcp://127.0.0.1:"), server.address
        peer.send(wire.Done(seq=0))
        assert server.recv(timeout=10).body == wire.Done(seq=0)
