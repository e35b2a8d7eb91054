"""The controller service: one long-lived controller on Ray that many client processes share.

``pw.serve(name, hosts=H, ...)`` starts a :class:`ServiceActor`, a named,
detached Ray actor. It owns the host actors (a :class:`RayBackend` of its
own: placement group, islands, the transfer servers, loss and rebuild), the
record of every value the hosts keep and who may read it, and the scheduler
that decides which client's run goes to the hosts next.

A client process joins with ``pw.init(backend="ray", address=..., service=name)``
and keeps the whole API: it traces and lowers locally, against stand-in CPU
devices, as on the plain Ray backend, and its :class:`ServiceBackend` sends
what that backend would send to the hosts to the service instead, one
numbered batch per run (every host's message of the run, so that the hosts
of an island see the run at the same place in their order). Plans go once
per host (``jax.export`` blobs), a run is its plan key, input handles and
fed arguments; values stay on the hosts and the client holds handles.

Modules: ``config`` (``ServiceConfig``, host keys); ``records`` (a client process, a
batch); ``ledger`` (the values on the hosts: owners, readers, bytes under the budget);
``gate`` (admission: batches in each client's order, queued runs, windows, the budget);
``outbox`` (answers to clients, queued for a slow reader); ``handoff`` (what the channels'
threads hand the service's loop: one wake-up for a burst); ``actor`` (the ``ServiceActor``:
clients, forwarding and completing batches, stats); ``handle`` (``pw.serve``, ``pw.service``
and the ``Service`` handle).
"""

from pathways_jax._src.runtime.serving.actor import ServiceActor as ServiceActor
from pathways_jax._src.runtime.serving.config import DEFAULT_WINDOW as DEFAULT_WINDOW
from pathways_jax._src.runtime.serving.config import ServiceConfig as ServiceConfig
from pathways_jax._src.runtime.serving.config import host_key as host_key
from pathways_jax._src.runtime.serving.handle import Service as Service
from pathways_jax._src.runtime.serving.handle import serve as serve
from pathways_jax._src.runtime.serving.handle import service as service

__all__ = ["DEFAULT_WINDOW", "Service", "ServiceActor", "ServiceConfig", "host_key", "serve", "service"]
