"""The wire package: typed messages, authenticated ZeroMQ channels, refusal, back-pressure, liveness."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from pathways_jax._src import wire
from pathways_jax._src.wire import (
    Address,
    Batch,
    Blob,
    Cancel,
    ChannelClosed,
    ChannelFull,
    Codec,
    Done,
    Failed,
    Feed,
    Fetch,
    Fetched,
    Forget,
    Free,
    Heartbeat,
    Peer,
    Received,
    Register,
    Reply,
    Routed,
    Run,
    Server,
    Share,
    Submit,
)
from pathways_jax.errors import PathwaysError

KEY = b"k" * 32

EVERY_KIND = [
    Register(plan=7, ops=Blob(b"ops" * 500), constants=Blob(b"c"), blobs=Blob(b""), x64=True),
    Register(plan=8, ops=Blob(b"o"), constants=Blob(b"c"), blobs=Blob(b"b"), x64=None),
    Run(
        plan=7,
        run_id=3,
        base=100,
        feeds=[Feed(0, data=Blob(b"f" * 5000))],
        keep=[(1, 2), (3, 4)],
        frees=[5, 6],
    ),
    Fetch(key=9, reply_to=Reply("ipc:///tmp/up", "ipc:///tmp/down", b"k" * 32, 7)),
    Fetch(key=9),
    Free(keys=[1, 2, 3]),
    Forget(plan=7),
    Share(key=9, reader="client-2"),
    Submit(batch=3, messages=[Routed(0, Free(keys=[1, (2, 3)])), Routed(-1, Share(key=9, reader="b"))]),
    Submit(batch=4, messages=[Routed(-1, Cancel(client=12))]),
    Done(seq=4, value=0.25),
    Done(seq=5, value=None),
    Failed(seq=6, kind="XlaRuntimeError", host=1, message="boom", trace="Traceback ...", peers=[0, 2]),
    Failed(seq=6, kind="HostLost", host=None, message="gone"),
    Fetched(seq=7, payload=Blob(np.arange(1000, dtype=np.float32))),
    Heartbeat(sent_at=123.5),
    Batch(
        items=[
            Run(1, 2, 3, [Feed(0, data=Blob(b"x")), Feed(1, value=4), Feed(2, value=(1, 5))]),
            Done(seq=1),
            Fetched(seq=2, payload=Blob(b"y" * 4096)),
        ]
    ),
]


def _until(predicate, timeout: float = 5.0):
    """Polls ``predicate`` until it is truthy (returned) or ``timeout`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError(f"not true within {timeout} s: {predicate}")


@pytest.fixture
def pair():
    server = Server(KEY, heartbeat=None)
    peer = Peer(server.address, KEY, identity=b"host-0", heartbeat=None)
    yield server, peer
    peer.close()
    server.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("message", EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips_through_the_codec(message):
    header, frames = Codec().encode(message)
    assert Codec().decode(header, [bytes(f) for f in frames]) == message


@pytest.mark.timeout(10)
def test_every_kind_crosses_a_channel_both_ways_in_order(pair):
    server, peer = pair
    got: list[Received] = []
    for message in EVERY_KIND:
        if isinstance(message, Heartbeat):
            continue  # consumed by the channel
        peer.send(message)
        received = server.recv(timeout=5)
        expected = message.items if isinstance(message, Batch) else [message]
        got = [received] + [server.recv(timeout=5) for _ in expected[1:]]
        assert [r.body for r in got] == expected
        assert [r.seq for r in got] == list(range(got[0].seq, got[0].seq + len(expected)))
        server.send(got[0].peer, message)
        back = [peer.recv(timeout=5) for _ in expected]
        assert [r.body for r in back] == expected
        assert back[0].peer == wire.SERVER
    assert server.refused == {} and peer.refused == {}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "int64", "bool", "complex64"])
def test_numpy_buffers_travel_in_their_own_frames_exactly(pair, dtype):
    server, peer = pair
    array = (np.arange(3 * 700) % 7).astype(dtype).reshape(3, 700)
    header, frames = Codec().encode(Fetched(seq=1, payload=Blob(array)))
    assert len(frames) == 1 and len(header) < 64  # the buffer is out of band
    peer.send(Run(plan=1, run_id=1, base=0, feeds=[Feed(0, data=Blob(array))]))
    feeds = server.recv(timeout=5).body.feeds
    np.testing.assert_array_equal(np.frombuffer(feeds[0].data.view, dtype).reshape(array.shape), array)
    server.send(b"host-0", Fetched(seq=1, payload=Blob(array)))
    payload = peer.recv(timeout=5).body.payload
    assert isinstance(payload.data, memoryview)  # a view of the received frame, not a copy
    np.testing.assert_array_equal(np.frombuffer(payload.view, dtype).reshape(array.shape), array)


def _sign(key, identity, seq, frames, count=None):
    prefix = struct.pack("<HQ", len(frames) + 1 if count is None else count, seq)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(b"u" + struct.pack("<Q", len(identity)) + identity + prefix)
    for frame in frames:
        mac.update(struct.pack("<Q", len(frame)) + frame)
    return prefix + mac.digest()


@pytest.mark.timeout(10)
def test_forged_replayed_truncated_and_malformed_frames_are_refused_counted_and_survived():
    server = Server(KEY, heartbeat=None)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"mallory")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address.up)
    try:
        header, _ = Codec().encode(Done(seq=1, value=1.0))
        good = [_sign(KEY, b"mallory", 1, [header]), header]
        raw.send_multipart(good)
        assert server.recv(timeout=5).body == Done(seq=1, value=1.0)
        raw.send_multipart(good)  # replayed: same seq
        raw.send_multipart([_sign(KEY, b"mallory", 2, [header]), header + b"\x00"])  # altered
        raw.send_multipart([_sign(b"x" * 32, b"mallory", 3, [header]), header])  # wrong key
        raw.send_multipart([_sign(KEY, b"someone-else", 4, [header]), header])  # another's identity
        renumbered = struct.pack("<HQ", 2, 99) + good[0][struct.calcsize("<HQ") :]
        raw.send_multipart([renumbered, header])  # the seq is signed too
        payload_header, frames = Codec().encode(Fetched(seq=1, payload=Blob(b"z" * 4096)))
        raw.send_multipart(
            [_sign(KEY, b"mallory", 5, [payload_header, *frames]), payload_header]
        )  # truncated
        raw.send_multipart([b"short"])  # truncated: one frame
        junk = b"\xc1\xff\x00"
        raw.send_multipart([_sign(KEY, b"mallory", 6, [junk]), junk])  # malformed msgpack
        wrong = msgspec.msgpack.encode(["Done", "not a number", None])
        raw.send_multipart([_sign(KEY, b"mallory", 7, [wrong]), wrong])  # wrong types
        raw.send_multipart([b"x" * 3, header])  # malformed signature frame
        _until(lambda: sum(server.refused.values()) == 10)
        assert server.refused == {"replayed": 1, "forged": 4, "truncated": 2, "malformed": 3}
        raw.send_multipart([_sign(KEY, b"mallory", 8, [header]), header])
        assert server.recv(timeout=5).seq == 8  # still serving
    finally:
        raw.close()
        server.close()


@pytest.mark.timeout(10)
def test_a_peer_with_another_key_is_refused_both_ways():
    server = Server(KEY, heartbeat=None)
    intruder = Peer(server.address, b"i" * 32, heartbeat=None)
    honest = Peer(server.address, KEY, identity=b"honest", heartbeat=None)
    try:
        intruder.send(Free(keys=[1]))
        honest.send(Free(keys=[2]))
        assert server.recv(timeout=5).body == Free(keys=[2])
        _until(lambda: server.refused == {"forged": 1})
        server.send(intruder.identity, Free(keys=[3]))
        _until(lambda: intruder.refused == {"forged": 1})
        assert intruder.recv(timeout=0.05) is None
    finally:
        intruder.close()
        honest.close()
        server.close()


@pytest.mark.timeout(10)
def test_a_stopped_reader_gives_its_sender_channel_full_not_a_hang():
    server = Server(KEY, heartbeat=None, hwm=4, queue_size=2)
    peer = Peer(server.address, KEY, heartbeat=None, hwm=4, queue_size=2)  # nobody calls recv()
    try:
        peer.send(Forget(plan=0))
        server.recv(timeout=5)
        with pytest.raises(ChannelFull) as caught:
            for i in range(100_000):
                server.send(peer.identity, Free(keys=[i]), timeout=0.2)
        assert isinstance(caught.value, PathwaysError) and isinstance(caught.value, TimeoutError)
        assert i < 100_000
        with pytest.raises(ChannelFull):
            for i in range(100_000):
                peer.send(Free(keys=[i]), timeout=0.2)  # the server's queue is not read either
        with pytest.raises(ChannelFull, match="not connected"):
            server.send(b"nobody", Forget(plan=1), timeout=0.05)
    finally:
        peer.close()
        server.close()


@pytest.mark.timeout(10)
def test_heartbeats_keep_a_quiet_peer_alive_and_silence_is_detected():
    server = Server(KEY, heartbeat=0.05)
    peer = Peer(server.address, KEY, identity=b"quiet", heartbeat=0.05)
    try:
        _until(lambda: server.peers() == [b"quiet"])
        start = time.monotonic()
        _until(lambda: time.monotonic() - start > 0.4, timeout=1)
        assert server.silent_peers(0.3) == [] and peer.silent_peers(0.3) == []
        assert server.received > 3  # heartbeats, none delivered
        assert server.recv(timeout=0) is None
        peer.close()
        _until(lambda: server.silent_peers(0.2) == [b"quiet"], timeout=3)
        server.forget(b"quiet")
        assert server.peers() == []
    finally:
        peer.close()
        server.close()


@pytest.mark.timeout(10)
def test_a_peer_hears_a_dead_server_as_silence():
    server = Server(KEY, heartbeat=0.05)
    peer = Peer(server.address, KEY, heartbeat=0.05)
    try:
        _until(lambda: server.peers())
        server.close()
        _until(lambda: peer.silent_peers(0.2) == [wire.SERVER], timeout=3)
    finally:
        peer.close()
        server.close()


@pytest.mark.timeout(10)
def test_posts_behind_a_send_in_progress_go_out_as_one_batch(pair):
    server, peer = pair
    peer.post(Free(keys=[0]))  # nothing in progress: sent at once
    assert server.recv(timeout=5).body == Free(keys=[0]) and peer.sent == 1
    with peer._send_lock:  # a send in progress (another thread)
        for i in range(1, 6):
            peer.post(Free(keys=[i]))
        assert peer.sent == 1
    peer.post(Free(keys=[6]))
    got = [server.recv(timeout=5) for _ in range(6)]
    assert [r.body.keys for r in got] == [[i] for i in range(1, 7)]
    assert [r.seq for r in got] == list(range(2, 8))
    assert peer.sent == 2  # one batch
    first = peer.send_many([Done(seq=1), Done(seq=2)])
    assert [server.recv(timeout=5).seq for _ in range(2)] == [first, first + 1]


@pytest.mark.timeout(10)
def test_concurrent_senders_lose_nothing_and_keep_each_threads_order(pair):
    server, peer = pair

    def send(thread: int) -> None:
        for i in range(200):
            (peer.post if i % 2 else peer.send)(Done(seq=thread * 1000 + i))

    threads = [threading.Thread(target=send, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    got = [server.recv(timeout=5) for _ in range(800)]
    assert server.recv(timeout=0.05) is None
    for t in range(4):
        assert [r.body.seq for r in got if r.body.seq // 1000 == t] == [t * 1000 + i for i in range(200)]
    assert [r.seq for r in got] == sorted(r.seq for r in got)


@pytest.mark.timeout(10)
def test_a_raising_handler_is_counted_and_the_loop_goes_on():
    server = Server(KEY, heartbeat=None)
    seen: list[Received] = []

    def handler(received: Received) -> None:
        seen.append(received)
        if received.body == Forget(plan=0):
            raise RuntimeError("handler bug")

    peer = Peer(server.address, KEY, heartbeat=None, on_message=handler)
    try:
        peer.send(Forget(plan=9))
        server.recv(timeout=5)
        server.send(peer.identity, Forget(plan=0))
        server.send(peer.identity, Forget(plan=1))
        _until(lambda: len(seen) == 2)
        assert peer.handler_errors == 1
        with pytest.raises(RuntimeError, match="on_message"):
            peer.recv(timeout=0)
    finally:
        peer.close()
        server.close()


PEER_PROCESS = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pathways_jax._src.wire import Address, Blob, Done, Feed, Fetch, Fetched, Peer, Run
    up, down, key = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
    with Peer(Address(up, down), key, identity=b"host-1", heartbeat=None) as peer:
        peer.send(Done(seq=0))
        while True:
            received = peer.recv(timeout=20)
            match received.body:
                case Run(run_id=run_id, feeds=feeds):
                    total = float(np.frombuffer(feeds[0].data.view, np.float64).sum())
                    peer.post(Done(seq=received.seq, value=total))
                case Fetch(key=key_):
                    peer.send(Fetched(seq=received.seq, payload=Blob(np.full(1000, key_, np.int32))))
                    break
    """
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_peer_in_another_process(transport):
    server = Server(KEY, transport=transport, heartbeat=None)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-c", PEER_PROCESS, server.address.up, server.address.down, KEY.hex()],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        hello = server.recv(timeout=25)
        assert hello is not None and hello.peer == b"host-1" and hello.body == Done(seq=0)
        seqs = server.send_many(
            b"host-1",
            [
                Run(plan=1, run_id=i, base=0, feeds=[Feed(0, data=Blob(np.arange(i + 300.0)))])
                for i in range(5)
            ],
        )
        dones = [server.recv(timeout=5) for _ in range(5)]
        assert [d.body for d in dones] == [
            Done(seq=seqs + i, value=float(np.arange(i + 300.0).sum())) for i in range(5)
        ]
        asked = server.send(b"host-1", Fetch(key=42))
        fetched = server.recv(timeout=5).body
        assert fetched.seq == asked
        np.testing.assert_array_equal(
            np.frombuffer(fetched.payload.view, np.int32), np.full(1000, 42, np.int32)
        )
        assert process.wait(timeout=10) == 0, process.stderr.read() if process.stderr else ""
        assert server.refused == {}
    finally:
        process.kill()
        process.wait()
        if process.stderr:
            process.stderr.close()
        server.close()


@pytest.mark.timeout(10)
def test_close_is_idempotent_and_leaves_no_thread_socket_or_file():
    before = set(threading.enumerate())
    server = Server(KEY, heartbeat=0.01)
    peers = [Peer(server.address, KEY, heartbeat=0.01) for _ in range(3)]
    ipc_dir = os.path.dirname(server.address.up[len("ipc://") :])
    assert os.path.isdir(ipc_dir)
    _until(lambda: len(server.peers()) == 3)
    for peer in peers:
        peer.close()
        peer.close()
    server.close()
    server.close()
    assert set(threading.enumerate()) == before
    assert not os.path.exists(ipc_dir)
    with pytest.raises(ChannelClosed):
        peers[0].send(Forget(plan=1))
    with pytest.raises(ChannelClosed):
        server.recv(timeout=1)


@pytest.mark.timeout(10)
def test_tcp_binds_loopback_unless_asked_and_bad_arguments_say_what_was_expected():
    with Server(KEY, transport="tcp", heartbeat=None) as server:
        assert server.address.up.startswith("tcp://127.0.0.1:")
        assert isinstance(server.address, Address)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Server(b"short")
    with pytest.raises(ValueError, match="'ipc' or 'tcp'"):
        Server(KEY, transport="udp")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Blob"):
        Codec().encode(Fetched(seq=1, payload=np.zeros(3)))  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_a_post_that_cannot_be_sent_in_time_is_dropped_and_counted():
    with Server(KEY, heartbeat=None) as server:
        server.post(b"nobody", Forget(plan=1), timeout=0.05)
        assert server.dropped == 1 and server.sent == 0


# --- fan-out: one send, each peer its own part --------------------------------------------


def _topic(kind: bytes, name: bytes) -> bytes:
    return kind + struct.pack("<H", len(name)) + name


def _sign_down(key, topic, seq, frames):
    prefix = struct.pack("<HQ", len(frames) + 1, seq)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(b"d" + struct.pack("<Q", len(topic)) + topic + prefix)
    for frame in frames:
        mac.update(struct.pack("<Q", len(frame)) + bytes(frame))
    return prefix + mac.digest()


def _drain(peer, timeout=0.05):
    got = []
    while (received := peer.recv(timeout=timeout)) is not None:
        got.append(received)
    return got


@pytest.mark.timeout(20)
def test_a_broadcast_is_one_send_and_each_peer_gets_its_own_part_in_order_among_unicast():
    server = Server(KEY, heartbeat=None)
    names = [f"host-{i}".encode() for i in range(4)]
    peers = [Peer(server.address, KEY, identity=n, groups=[b"island-0"], heartbeat=None) for n in names]
    outsider = Peer(server.address, KEY, identity=b"host-9", groups=[b"island-1"], heartbeat=None)
    try:
        server.send(names[0], Free(keys=[-1]))  # waits for the subscription: no slow-joiner loss
        sent = server.sent
        firsts = server.broadcast(b"island-0", {n: [Forget(plan=i)] for i, n in enumerate(names)})
        assert server.sent == sent + 1  # one send for four peers
        server.send(names[1], Free(keys=[1]))
        server.send(outsider.identity, Free(keys=[9]))
        batch = {n: [Free(keys=[10 + i]), Forget(plan=20 + i)] for i, n in enumerate(names[1:], 1)}
        seconds = server.broadcast(b"island-0", batch)  # host-0 has no part in this one
        server.send(names[0], Free(keys=[0]))
        got = {n: _drain(p) for n, p in zip(names, peers, strict=True)}
        assert [(r.seq, r.body) for r in got[names[0]]] == [
            (1, Free(keys=[-1])),
            (2, Forget(plan=0)),
            (3, Free(keys=[0])),
        ]
        assert [(r.seq, r.body) for r in got[names[1]]] == [
            (1, Forget(plan=1)),
            (2, Free(keys=[1])),
            (3, Free(keys=[11])),
            (4, Forget(plan=21)),
        ]
        for i, n in enumerate(names[2:], 2):
            assert [(r.seq, r.body) for r in got[n]] == [
                (1, Forget(plan=i)),
                (2, Free(keys=[10 + i])),
                (3, Forget(plan=20 + i)),
            ]
        assert firsts == {names[0]: 2, names[1]: 1, names[2]: 1, names[3]: 1}
        assert seconds == {names[1]: 3, names[2]: 2, names[3]: 2}
        assert [r.body for r in _drain(outsider)] == [Free(keys=[9])]  # another island's: nothing
        assert all(p.refused == {} for p in [*peers, outsider])
        # Blobs of every part share the frame's buffers; each peer reads its own exactly.
        arrays = {n: np.arange(1000 + i, dtype=np.float32) for i, n in enumerate(names)}
        server.broadcast(b"island-0", {n: [Fetched(seq=1, payload=Blob(a))] for n, a in arrays.items()})
        for n, p in zip(names, peers, strict=True):
            np.testing.assert_array_equal(
                np.frombuffer(p.recv(timeout=5).body.payload.view, np.float32), arrays[n]
            )
        with pytest.raises(ValueError, match="at least one message"):
            server.broadcast(b"island-0", {names[0]: []})
    finally:
        for peer in [*peers, outsider]:
            peer.close()
        server.close()


@pytest.mark.timeout(20)
def test_forged_and_replayed_broadcast_frames_are_refused_and_counted():
    context = zmq.Context.instance()
    raw = context.socket(zmq.XPUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    up = context.socket(zmq.ROUTER)
    up.setsockopt(zmq.LINGER, 0)
    up_port = up.bind_to_random_port("tcp://127.0.0.1")
    address = Address(f"tcp://127.0.0.1:{up_port}", f"tcp://127.0.0.1:{port}")
    peer = Peer(address, KEY, identity=b"host-0", groups=[b"g0"], heartbeat=None)
    group, own = _topic(b"g", b"g0"), _topic(b"p", b"host-0")
    try:
        seen = set()
        while own not in seen:  # its own topic comes last
            raw.poll(5000)
            seen.add(raw.recv()[1:])
        assert group in seen

        def fanout(parts):
            return Codec().encode_fanout(parts)[0]

        header = fanout({b"host-0": (1, Forget(plan=1)), b"host-1": (1, Forget(plan=2))})
        good = [group, _sign_down(KEY, group, 1, [header]), header]
        raw.send_multipart(good)
        assert (peer.recv(timeout=5).body, peer.refused) == (Forget(plan=1), {})
        raw.send_multipart(good)  # the frame replayed
        again = [group, _sign_down(KEY, group, 2, [header]), header]
        raw.send_multipart(again)  # renumbered and signed (a leaked key), but the part is old
        raw.send_multipart([group, good[1], header + b"\x00"])  # altered
        raw.send_multipart([group, _sign_down(b"x" * 32, group, 3, [header]), header])  # wrong key
        raw.send_multipart([group, _sign_down(KEY, own, 4, [header]), header])  # signed for another topic
        raw.send_multipart([group, _sign_down(KEY, group, 5, [header])])  # truncated
        junk = b"\xc1\xff"
        raw.send_multipart([group, _sign_down(KEY, group, 6, [junk]), junk])  # malformed
        _until(lambda: sum(peer.refused.values()) == 7)
        assert peer.refused == {"replayed": 2, "forged": 3, "truncated": 1, "malformed": 1}
        fresh = fanout({b"host-0": (2, Free(keys=[7]))})
        raw.send_multipart([group, _sign_down(KEY, group, 7, [fresh]), fresh])
        got = peer.recv(timeout=5)
        assert (got.seq, got.body) == (2, Free(keys=[7]))  # still serving
        assert peer.recv(timeout=0.05) is None
    finally:
        peer.close()
        raw.close()
        up.close()


@pytest.mark.timeout(20)
def test_a_stopped_subscriber_gives_the_broadcaster_channel_full_not_a_hang_or_a_drop():
    server = Server(KEY, heartbeat=None, hwm=4)
    reader = Peer(server.address, KEY, identity=b"reader", groups=[b"g"], heartbeat=None, hwm=4)
    stopped = Peer(
        server.address, KEY, identity=b"stopped", groups=[b"g"], heartbeat=None, hwm=4, queue_size=1
    )
    try:
        sent = 0
        got = []  # what the reader took, as it went and after
        with pytest.raises(ChannelFull, match="full"):
            for i in range(100_000):
                server.broadcast(
                    b"g", {b"reader": [Free(keys=[i])], b"stopped": [Free(keys=[i])]}, timeout=0.2
                )
                sent += 1
                got += _drain(reader, timeout=0)
        assert sent < 100_000
        got += _drain(reader, timeout=0.2)
        # Nothing of the refused broadcast reached anyone: the reader has exactly what was sent.
        assert [r.body.keys[0] for r in got] == list(range(sent))
        assert server.refused == {} and reader.refused == {}
        # The stopped peer got every broadcast sent, none dropped, in order.
        taken = []
        while (received := stopped.recv(timeout=0.2)) is not None:
            taken.append(received.body.keys[0])
        assert taken == list(range(sent))
    finally:
        reader.close()
        stopped.close()
        server.close()


@pytest.mark.timeout(20)
def test_a_late_subscriber_gets_nothing_sent_before_it_joined_and_everything_after():
    server = Server(KEY, heartbeat=None)
    early = Peer(server.address, KEY, identity=b"early", groups=[b"g"], heartbeat=None)
    late = None
    try:
        server.broadcast(b"g", {b"early": [Forget(plan=1)]})
        with pytest.raises(ChannelFull, match="not connected"):
            server.broadcast(b"g", {b"early": [Forget(plan=2)], b"late": [Forget(plan=2)]}, timeout=0.1)
        late = Peer(server.address, KEY, identity=b"late", groups=[b"g"], heartbeat=None)
        # Sent before "late" subscribed, it waits for it (the slow joiner loses nothing).
        server.broadcast(b"g", {b"early": [Forget(plan=3)], b"late": [Forget(plan=3)]}, timeout=5)
        server.broadcast(b"g", {b"early": [Forget(plan=4)]})
        server.broadcast(b"g", {b"early": [Forget(plan=5)], b"late": [Forget(plan=5)]})
        assert [(r.seq, r.body.plan) for r in _drain(early)] == [(1, 1), (2, 3), (3, 4), (4, 5)]
        assert [(r.seq, r.body.plan) for r in _drain(late)] == [(1, 3), (2, 5)]
        assert early.refused == {} and late.refused == {}
    finally:
        early.close()
        if late is not None:
            late.close()
        server.close()


@pytest.mark.timeout(10)
def test_a_message_given_to_many_peers_is_encoded_and_carried_once():
    shared = Run(plan=7, run_id=1, base=0, feeds=[Feed(0, data=Blob(b"f" * 5000))], keep=[(1, 2)])
    names = [f"host-{i}".encode() for i in range(64)]
    one, frames_one = Codec().encode_fanout({n: (i + 1, shared) for i, n in enumerate(names)})
    distinct = {
        n: (i + 1, Run(plan=7, run_id=1, base=0, feeds=[Feed(0, data=Blob(b"f" * 5000))]))
        for i, n in enumerate(names)
    }
    many, frames_many = Codec().encode_fanout(distinct)
    assert len(frames_one) == 1 and len(frames_many) == 64
    assert len(one) < len(many)  # one body, not 64
    codec = Codec()
    for i, n in enumerate(names):
        part = codec.decode_part(one, [bytes(f) for f in frames_one], n)
        assert (part.seq, part.body) == (i + 1, shared)
    assert codec.decode_part(one, frames_one, b"host-99") is None
