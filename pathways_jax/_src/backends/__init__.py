"""Backends: where the devices of a cluster live, behind one ``Backend`` protocol.

``base`` defines the protocol the controller dispatches through, the
options a backend starts with and the optional capabilities callers look for
(``HostFleet``, ``Shares``, ``ServiceView``, ``Strikes``, ``HostWrites``); ``registry`` maps
``pw.init(backend=...)``'s names to start functions (``ray_start`` starts the
Ray backend's hosts or joins a service). ``local``
runs steps on this process's JAX devices, ``ray`` sends each host its part
of a run (``ray_host`` is the host side, a package importing nothing else
of pathways_jax). ``host_link`` is how the Ray backend reaches its hosts
(``channel_link``: signed ZeroMQ channels; or one Ray actor call a message);
``service_client`` is a client process's side of a controller service. The Ray
backend and a service's client each hold a ``ray_dispatch.Dispatcher`` (plans, runs, fetches),
given a route to the hosts: ``ray_route`` (its own host actors) or ``service_route`` (the service).
May import: ``compile``, ``ir``, ``wire``, ``core`` (and Ray, lazily, through ``ray_boot``).

Modules: ``base`` (the protocol, start options, capabilities); ``registry`` (backends by name);
``local`` (this process's devices); ``ray`` (the Ray backend: its host actors, what a lost host
means); ``ray_boot`` (Ray joined, GPUs checked, the layout, the link); ``ray_auth`` (whether
to send Ray's authentication token to a cluster joined by address); ``ray_dispatch`` (plans
split, runs sent, values fetched, through a route); ``ray_route`` (the Ray backend's route: its own
hosts); ``ray_places`` (where the stand-in devices are); ``ray_losses`` (lost islands, generations,
the lost message); ``ray_failures`` (what hosts' failures raise); ``ray_fleet`` (the host actors: started, watched, replaced, killed);
``ray_send`` (messages out: numbered, grouped per island; what each host has and is to free);
``ray_plan`` (a plan split per host); ``ray_values`` (values on hosts); ``ray_checkpoints``
(checkpoints the hosts write and read: the controller's messages); ``ray_colocated``
(``colocated_python`` calls sent to the hosts, their outputs' handles); ``ray_start`` (starting
it); ``ray_host`` (the host side: its records, values, data plane, steps and actor);
``host_link`` (how hosts are reached); ``channel_link`` (over ZeroMQ); ``service_client`` (a
service's client process); ``service_route`` (its route: batches to the service);
``version_check`` (the versions a service and its clients, or a controller and its host actors,
must share, and what is said when they differ).
"""
