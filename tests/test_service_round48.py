"""The controller service as client processes written from the README meet it (round 48).

One service (an island of two hosts of two devices) serves the module's tests: a service start
costs seconds. Results are compared with plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(180)

SERVICE = "test-round48"


@pytest.fixture(scope="module")
def service(ray_cluster):
    svc = pw.serve(SERVICE, hosts=2, devices_per_host=2, islands=1)
    try:
        yield svc
    finally:
        pw.shutdown()
        svc.stop()


def _join(svc, name: str) -> None:
    pw.init(backend="ray", address=svc.address, service=svc.name, client_name=name)


def test_a_client_of_another_version_is_refused_at_join_saying_both_versions(service, ray_cluster, monkeypatch):
    # A client process of another pathways_jax (or wire format) joined and failed later, with a
    # garbled error or a hang, when it and the service misread each other's messages.
    from pathways_jax._src import wire
    from pathways_jax._src.backends import service_client

    ours = pw.__version__
    monkeypatch.setattr(pw, "__version__", "0.0.9")
    with pytest.raises(
        pw.errors.ClusterError,
        match=rf"the service runs pathways_jax {ours} \(wire format \d+, jax {jax.__version__}\), this "
        rf"process pathways_jax 0.0.9 .*\(pip install pathways-jax=={ours} jax=={jax.__version__}\)",
    ):
        _join(service, "other-version")
    monkeypatch.undo()
    monkeypatch.setattr(wire, "WIRE_VERSION", wire.WIRE_VERSION + 1)
    with pytest.raises(pw.errors.ClusterError, match=rf"wire format {wire.WIRE_VERSION}, jax"):
        _join(service, "other-wire")
    monkeypatch.undo()

    # A client from before the check (its join names no versions) is refused too, saying so.
    token = ray_cluster.remote(service_client.Token).options(num_cpus=0).remote()
    try:
        old = ray_cluster.get(service.actor.join.remote("old", 1, "node", token, False), timeout=30)
    finally:
        ray_cluster.kill(token)
    assert "older than its version check" in old["refused"], old

    # And a service from before the check (its join takes no versions) is named so at join.
    @ray_cluster.remote(num_cpus=0)
    class OldService:
        async def join(self, name, pid, node, token, x64):
            return {"client": 1}

    old_service = OldService.options(name="test-round48-old", namespace=service_client.NAMESPACE).remote()
    try:
        with pytest.raises(
            pw.errors.ClusterError,
            match=r"service='test-round48-old'\): the service runs a pathways_jax older than its version check .* this process "
            rf"pathways_jax {pw.__version__}",
        ):
            pw.init(backend="ray", service="test-round48-old", client_name="new")
    finally:
        ray_cluster.kill(old_service)

    # Refused, none of them holds a name at the service: the same one joins, and computes.
    _join(service, "other-version")
    f = pw.jit(lambda v: jnp.cumsum(v) * 2, devices=pw.devices(mesh={"x": 2}))
    x = np.arange(8.0, dtype=np.float32)
    np.testing.assert_array_equal(f(x).result(timeout=60), jax.jit(lambda v: jnp.cumsum(v) * 2)(x))
