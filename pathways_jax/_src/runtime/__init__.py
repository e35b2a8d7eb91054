"""Runtime: what serves program runs once they are lowered.

Virtual slices and the resource manager, clients, submission (a call
becomes a run and futures), the single controller, its admission core
(queues, windows, budget: shared with the controller service and the
simulator) and scheduling policies, the object store and futures,
accounting, the controller service, and the cluster that holds them and
picks the backend. May import: ``backends``, ``compile``,
``ir``, ``core``.
"""
