"""Runtime: what serves program runs once they are lowered.

Virtual slices and the resource manager, clients, submission (a call
becomes a run and futures), the single controller and its scheduling
policies, the object store and futures, accounting, and the cluster that
holds them and picks the backend. May import: ``backends``, ``compile``,
``ir``, ``core``.
"""
