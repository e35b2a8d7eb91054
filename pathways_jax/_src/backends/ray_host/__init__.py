"""The host side of the Ray backend: one host process owning its own JAX devices.

A host runs inside a Ray actor (``ray.py`` wraps :class:`Host` with
``ray.remote``). Nothing here imports the rest of pathways_jax, nor Ray:
the controller and the hosts share only these records, pickled.

Modules: ``ops`` (a plan's part for a host: sharding descriptors, operations);
``answers`` (a host's role, what it answers, failures described); ``values``
(values to and from the wire, typed keys, placing, fetch reads); ``plane``
(the data plane: shardings, the transfer server, host to host); ``steps``
(operations made into steps, executables paced); ``checkpoint`` (the shards of
a checkpoint this host writes and reads itself); ``faults`` (a
fault the host strikes on itself when asked: ``pw.faults``); ``colocated``
(``colocated_python`` functions and objects run on the host, in its order); ``actor`` (the ``Host``
actor: messages in order, the executor, the completer).
"""

from pathways_jax._src.backends.ray_host.actor import Host as Host
from pathways_jax._src.backends.ray_host.answers import MessageFailed as MessageFailed
from pathways_jax._src.backends.ray_host.answers import Refused as Refused
from pathways_jax._src.backends.ray_host.answers import Role as Role
from pathways_jax._src.backends.ray_host.answers import RunDone as RunDone
from pathways_jax._src.backends.ray_host.answers import RunFailure as RunFailure
from pathways_jax._src.backends.ray_host.faults import Fault as Fault
from pathways_jax._src.backends.ray_host.ops import ExecOp as ExecOp
from pathways_jax._src.backends.ray_host.ops import NamedDesc as NamedDesc
from pathways_jax._src.backends.ray_host.ops import Op as Op
from pathways_jax._src.backends.ray_host.ops import Piece as Piece
from pathways_jax._src.backends.ray_host.ops import PostOp as PostOp
from pathways_jax._src.backends.ray_host.ops import PullOp as PullOp
from pathways_jax._src.backends.ray_host.ops import PutOp as PutOp
from pathways_jax._src.backends.ray_host.ops import ShardingDesc as ShardingDesc
from pathways_jax._src.backends.ray_host.ops import SingleDesc as SingleDesc
from pathways_jax._src.backends.ray_host.ops import sharding_of as sharding_of
from pathways_jax._src.backends.ray_host.plane import transfer_options as transfer_options
from pathways_jax._src.backends.ray_host.steps import PACE as PACE
from pathways_jax._src.backends.ray_host.values import Blocks as Blocks
from pathways_jax._src.backends.ray_host.values import KeyData as KeyData
from pathways_jax._src.backends.ray_host.values import Shards as Shards
from pathways_jax._src.backends.ray_host.values import bounds_of as bounds_of
from pathways_jax._src.backends.ray_host.values import to_wire as to_wire

__all__ = [
    "PACE",
    "Blocks",
    "ExecOp",
    "Fault",
    "Host",
    "KeyData",
    "MessageFailed",
    "NamedDesc",
    "Op",
    "Piece",
    "PostOp",
    "PullOp",
    "PutOp",
    "Refused",
    "Role",
    "RunDone",
    "RunFailure",
    "ShardingDesc",
    "Shards",
    "SingleDesc",
    "bounds_of",
    "sharding_of",
    "to_wire",
    "transfer_options",
]
