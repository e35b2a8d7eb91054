"""A lost island's rebuild on a machine whose hosts start slowly (round 49).

A try at rebuilding an island gives its new hosts a while to start and kills them when they
have not; the next try started over with the same while. On a loaded machine, where a host
took longer than that to start (60-90 s were seen on 2 cores at load 15), the island never came
back: ``tests/test_elastic.py``'s lost-islands test then waited out its own time.
"""

from __future__ import annotations

import types

from pathways_jax._src.backends import ray as ray_backend


def test_a_rebuild_gives_new_hosts_longer_to_start_at_each_try_until_they_do(monkeypatch):
    # No Ray here: the rebuild's retry loop, with tries that fail as a real one does when the
    # new hosts need longer to start than the try gives them (90 s against a first try's 60 s).
    monkeypatch.setattr(ray_backend, "_REBUILD_RETRY_S", 0.0)  # no pause between tries here
    needs = 1.5 * ray_backend._REBUILD_TIMEOUT_S
    given: list[float] = []
    restored: list[int] = []

    def rebuild_once(island, timeout=ray_backend._REBUILD_TIMEOUT_S):
        given.append(timeout)
        if len(given) == 5:  # a fixed time never gets there: stop as a closed cluster does
            backend.closed = True
        return timeout >= needs

    backend = types.SimpleNamespace(closed=False, _rebuild_once=rebuild_once, on_restored=restored.append)
    ray_backend.RayBackend._rebuild(backend, 1)
    assert restored == [1], f"the island was not rebuilt: its tries gave the new hosts {given} s"
    assert given == [ray_backend._REBUILD_TIMEOUT_S, 2 * ray_backend._REBUILD_TIMEOUT_S]
