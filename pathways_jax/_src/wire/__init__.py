"""Wire: the control plane's messages and the authenticated ZeroMQ channels that carry them.

Owns the typed messages (``msgspec`` structs, one tagged union dispatched with
``match``), their framing (out-of-band buffers for blobs, no copy), HMAC
signing, refusal of forged, replayed, truncated and malformed frames,
back-pressure, batching and heartbeats between a :class:`Server` (controller,
service) and its :class:`Peer`\\ s (hosts, clients). May import: the standard
library, ``zmq``, ``msgspec``, and nothing of pathways_jax but
``pathways_jax._src.core.errors``.

Modules: ``messages`` (the typed messages and their frames); ``channel`` (signed ZeroMQ channels).
"""

from pathways_jax._src.wire.channel import SERVER as SERVER
from pathways_jax._src.wire.channel import Address as Address
from pathways_jax._src.wire.channel import ChannelClosed as ChannelClosed
from pathways_jax._src.wire.channel import ChannelError as ChannelError
from pathways_jax._src.wire.channel import ChannelFull as ChannelFull
from pathways_jax._src.wire.channel import Peer as Peer
from pathways_jax._src.wire.channel import Received as Received
from pathways_jax._src.wire.channel import Server as Server
from pathways_jax._src.wire.messages import WIRE_VERSION as WIRE_VERSION
from pathways_jax._src.wire.messages import Answered as Answered
from pathways_jax._src.wire.messages import Batch as Batch
from pathways_jax._src.wire.messages import Blob as Blob
from pathways_jax._src.wire.messages import Cancel as Cancel
from pathways_jax._src.wire.messages import Codec as Codec
from pathways_jax._src.wire.messages import Colocated as Colocated
from pathways_jax._src.wire.messages import Done as Done
from pathways_jax._src.wire.messages import Failed as Failed
from pathways_jax._src.wire.messages import Feed as Feed
from pathways_jax._src.wire.messages import Fetch as Fetch
from pathways_jax._src.wire.messages import Fetched as Fetched
from pathways_jax._src.wire.messages import Forget as Forget
from pathways_jax._src.wire.messages import Free as Free
from pathways_jax._src.wire.messages import Handle as Handle
from pathways_jax._src.wire.messages import Heartbeat as Heartbeat
from pathways_jax._src.wire.messages import Item as Item
from pathways_jax._src.wire.messages import Load as Load
from pathways_jax._src.wire.messages import Message as Message
from pathways_jax._src.wire.messages import Peers as Peers
from pathways_jax._src.wire.messages import Register as Register
from pathways_jax._src.wire.messages import Reply as Reply
from pathways_jax._src.wire.messages import Request as Request
from pathways_jax._src.wire.messages import Routed as Routed
from pathways_jax._src.wire.messages import Run as Run
from pathways_jax._src.wire.messages import RunMeta as RunMeta
from pathways_jax._src.wire.messages import Share as Share
from pathways_jax._src.wire.messages import Stash as Stash
from pathways_jax._src.wire.messages import Store as Store
from pathways_jax._src.wire.messages import Submit as Submit

__all__ = [
    "SERVER",
    "WIRE_VERSION",
    "Address",
    "Answered",
    "Batch",
    "Blob",
    "ChannelClosed",
    "ChannelError",
    "ChannelFull",
    "Codec",
    "Colocated",
    "Done",
    "Failed",
    "Feed",
    "Fetch",
    "Reply",
    "Request",
    "Routed",
    "Fetched",
    "Forget",
    "Free",
    "Handle",
    "Heartbeat",
    "Item",
    "Message",
    "Peer",
    "Peers",
    "Received",
    "Register",
    "Run",
    "RunMeta",
    "Server",
    "Share",
    "Cancel",
    "Stash",
    "Store",
    "Load",
    "Submit",
]
