"""Trace events: typed records of plain values that the runtime emits, and the recorder lays out."""

import collections
import dataclasses
import types
import typing

import jax.numpy as jnp
import pytest

import pathways_jax as pw
from pathways_jax._src.api import recording
from pathways_jax._src.core import events

PLAIN = (int, float, str, bool, type(None))
RECORDS = {obj for obj in vars(events).values() if isinstance(obj, type) and dataclasses.is_dataclass(obj)}


def _plain(annotation) -> bool:
    """Whether a field's type holds only plain values: scalars, and tuples, dicts and records of them."""
    origin = typing.get_origin(annotation)
    if origin is None:
        return annotation in PLAIN or (annotation in RECORDS and _record_is_plain(annotation))
    if origin in (tuple, dict, types.UnionType, typing.Union):
        return all(arg is Ellipsis or _plain(arg) for arg in typing.get_args(annotation))
    return False


def _record_is_plain(cls) -> bool:
    hints = typing.get_type_hints(cls)
    return all(_plain(hints[f.name]) for f in dataclasses.fields(cls) if f.name != "watch")


def test_every_event_is_a_frozen_record_of_plain_values():
    kinds = set(typing.get_args(events.Event))
    assert kinds | {events.Device} == RECORDS  # every record is an event, or a row of one
    for cls in RECORDS:
        params = cls.__dataclass_params__
        assert params.frozen and "__slots__" in vars(cls), cls
        assert _record_is_plain(cls), cls
        hints = typing.get_type_hints(cls)
        if "watch" in hints:  # device work: the arrays whose readiness ends it, and nothing else
            assert hints["watch"] == tuple[typing.Any, ...], cls
            assert {events.Dispatched, events.Sent, events.Moved} >= {cls}
    event = events.Waited("back-pressure", "alice", 0, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.client = "bob"  # type: ignore[misc]


@pytest.mark.timeout(60)
def test_a_two_island_program_emits_one_event_per_thing_done(monkeypatch):
    """What the emitters send for a two-island program: the trace is laid out from these alone."""
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    scale = pw.jit(lambda x: jnp.sin(x) * 2, devices=a, out_specs=pw.P("x"))
    total = pw.jit(lambda x: x.sum(), devices=b)

    @pw.program
    def step(x):
        return total(scale(x))

    seen = []
    original = recording.Recorder.record

    def keep(self, event):
        seen.append(event)
        return original(self, event)

    monkeypatch.setattr(recording.Recorder, "record", keep)
    with pw.trace() as rec:
        for _ in range(2):
            step(jnp.arange(16.0))
    assert events.SINK is None and recording.ACTIVE is None
    kinds = collections.Counter(type(e).__name__ for e in seen)
    assert kinds == {
        "Devices": 1,  # the running cluster, read when the trace began
        "Traced": 1,
        "Lowered": 1,
        "Compiled": 2,
        "Submitted": 2,
        "Dispatched": 4,  # two nodes per run
        "Moved": 4,  # per run: the input put onto island 0 (a reshard), the DCN transfer
    }
    (table,) = [e for e in seen if isinstance(e, events.Devices)]
    assert [(d.id, d.island) for d in table.devices] == [(d.id, d.id // 4) for d in pw.cluster().devices]
    runs = {e.run for e in seen if isinstance(e, events.Submitted)}
    for e in seen:
        if isinstance(e, events.Dispatched):
            assert e.run in runs and e.program == "step" and e.client == "default"
            assert e.devices == tuple(d.id for d in (a if e.island == 0 else b).devices)
            assert e.start <= e.end and len(e.watch) >= 1
    dcn = [e for e in seen if isinstance(e, events.Moved) and e.kind == "dcn"]
    assert len(dcn) == 2 and all(e.bytes == 16 * 4 and e.value == "f32[16]" for e in dcn)
    assert {e.dst_devices for e in dcn} == {tuple(d.id for d in b.devices)}
    spans = collections.Counter(e["cat"] for e in rec.events if e["ph"] == "X")
    assert spans["execution"] == 2 * (4 + 4) and spans["submit"] == 2
    a.release()
    b.release()
