"""The controller service's answers to its clients: sent at once, or queued until a client reads.

The service's loop serves every client, so it never waits on one: an answer a
client's channel cannot take now (a slow or stopped reader) waits in that
client's outbox (``ClientProcess.outbox``) and is sent again from the loop;
a client that takes nothing for too long is dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pathways_jax._src.backends.ray_host import Refused
from pathways_jax._src.runtime.serving.records import ClientProcess

if TYPE_CHECKING:  # the channels need the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire

# A client's answers its channel cannot take now wait in its outbox, sent again after
# _DRAIN_FIRST_S, doubling up to _DRAIN_MAX_S; past this many bytes the client is dropped.
_DRAIN_FIRST_S = 0.002
_SEND_NOW_S = 0.002  # how long an answer's send may wait before it goes to the outbox
_DRAIN_MAX_S = 0.1
_OUTBOX_BYTES = 256 * 2**20


class Outbox:
    """Sends clients the answers to their batches over the service's channel, never waiting.

    ``by_identity``: the joined clients by channel identity (the actor's, shared);
    ``on_stalled(client, why)`` drops a client that stopped reading.
    """

    def __init__(
        self,
        channel: wire.Server,
        by_identity: dict[bytes, ClientProcess],
        stalled_timeout: float,
        on_stalled: Callable[[ClientProcess, str], None],
    ) -> None:
        self.channel = channel
        self.by_identity = by_identity
        self.stalled_timeout = stalled_timeout
        self.on_stalled = on_stalled

    def answer(self, peer: bytes, seq: int, answers: list) -> None:
        """Sends a client the answers to its batch ``seq`` (a client that went gets nothing).

        Never waits: the loop serves every client. An answer the client's
        channel cannot take now (a slow or stopped reader: its queue is at the
        high-water mark) waits in the client's outbox, behind which its later
        answers queue, and is sent again from the loop (:meth:`drain`).
        """
        from pathways_jax._src import wire
        from pathways_jax._src.backends.channel_link import answer_message

        client = self.by_identity.get(peer)
        if client is None:
            return
        try:  # each as the hosts answer (typed; what is not, a Refused, pickled)
            items = [answer_message(index, answer) for index, answer in enumerate(answers)]
        except Exception as exc:  # an answer that cannot be pickled still answers
            refused = Refused(f"the service could not send the answer: {type(exc).__name__}: {exc}")
            items = [answer_message(index, refused) for index in range(len(answers))]
        message = wire.Answered(seq, items)
        if not client.outbox and self.send_now(peer, message):
            return
        client.outbox.append(message)
        client.outbox_bytes += _nbytes(message)
        if client.stalled_since is None:
            client.stalled_since = time.monotonic()
            asyncio.get_running_loop().call_later(_DRAIN_FIRST_S, self.drain, client, _DRAIN_FIRST_S)

    def send_now(self, peer: bytes, message: Any) -> bool:
        """Sends ``message`` if the client's channel takes it at once; False if it is full."""
        from pathways_jax._src import wire

        try:
            # A moment's wait: the channel's heartbeat thread may hold its send lock now.
            self.channel.send(peer, message, timeout=_SEND_NOW_S)
        except wire.ChannelFull:
            return False
        except wire.ChannelClosed:  # the service is stopping: nothing more goes out
            pass
        return True

    def drain(self, client: ClientProcess, pause: float) -> None:
        """Sends what waits in a client's outbox; a client that took nothing for too long is dropped."""
        peer = f"client-{client.id}".encode()
        while client.outbox and client.alive:
            if not self.send_now(peer, client.outbox[0]):
                break
            client.outbox_bytes -= _nbytes(client.outbox.popleft())
            client.stalled_since = time.monotonic() if client.outbox else None
        if not client.outbox or not client.alive:
            client.stalled_since = None
            return
        stalled = time.monotonic() - (client.stalled_since or time.monotonic())
        if stalled >= self.stalled_timeout or client.outbox_bytes > _OUTBOX_BYTES:
            self.on_stalled(
                client,
                f"it stopped reading its answers ({len(client.outbox)} answers, {client.outbox_bytes} bytes "
                f"waited {stalled:.1f}s; stalled_client_timeout={self.stalled_timeout}s)",
            )
            return
        pause = min(pause * 2, _DRAIN_MAX_S)
        asyncio.get_running_loop().call_later(pause, self.drain, client, pause)


def _nbytes(message: wire.Answered) -> int:
    """Bytes of the payloads an answer carries (what a client's outbox counts)."""
    from pathways_jax._src import wire

    total = 0
    for item in message.answers:
        match item:
            case wire.Fetched(payload=payload):
                total += len(payload)
            case wire.Done(values=values) if values:
                total += sum(len(blob) for _key, blob in values)
            case wire.Failed(message=text, trace=trace):
                total += len(text) + len(trace)
    return total
