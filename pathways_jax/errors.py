"""The errors pathways_jax raises: ``import pathways_jax as pw; pw.errors.ResourceError``."""

from pathways_jax._src.core.errors import AccessError as AccessError
from pathways_jax._src.core.errors import BackPressureTimeout as BackPressureTimeout
from pathways_jax._src.core.errors import ClusterError as ClusterError
from pathways_jax._src.core.errors import FutureTimeoutError as FutureTimeoutError
from pathways_jax._src.core.errors import HostLostError as HostLostError
from pathways_jax._src.core.errors import PathwaysError as PathwaysError
from pathways_jax._src.core.errors import PlacementError as PlacementError
from pathways_jax._src.core.errors import ProgramFailedError as ProgramFailedError
from pathways_jax._src.core.errors import ProgramTraceError as ProgramTraceError
from pathways_jax._src.core.errors import ResourceError as ResourceError
from pathways_jax._src.core.errors import SpecializationError as SpecializationError
from pathways_jax._src.core.errors import TimelineError as TimelineError
from pathways_jax._src.core.errors import TransferError as TransferError

__all__ = [
    "AccessError",
    "BackPressureTimeout",
    "ClusterError",
    "FutureTimeoutError",
    "HostLostError",
    "PathwaysError",
    "PlacementError",
    "ProgramFailedError",
    "ProgramTraceError",
    "ResourceError",
    "SpecializationError",
    "TimelineError",
    "TransferError",
]
