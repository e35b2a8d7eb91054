"""The errors pathways_jax raises: ``import pathways_jax as pw; pw.errors.ResourceError``."""

from pathways_jax._src.errors import BackPressureTimeout as BackPressureTimeout
from pathways_jax._src.errors import ClusterError as ClusterError
from pathways_jax._src.errors import FutureTimeoutError as FutureTimeoutError
from pathways_jax._src.errors import HostLostError as HostLostError
from pathways_jax._src.errors import PathwaysError as PathwaysError
from pathways_jax._src.errors import PlacementError as PlacementError
from pathways_jax._src.errors import ProgramFailedError as ProgramFailedError
from pathways_jax._src.errors import ProgramTraceError as ProgramTraceError
from pathways_jax._src.errors import ResourceError as ResourceError
from pathways_jax._src.errors import TimelineError as TimelineError
from pathways_jax._src.errors import TransferError as TransferError

__all__ = [
    "BackPressureTimeout",
    "ClusterError",
    "FutureTimeoutError",
    "HostLostError",
    "PathwaysError",
    "PlacementError",
    "ProgramFailedError",
    "ProgramTraceError",
    "ResourceError",
    "TimelineError",
    "TransferError",
]
