"""Runtime: what serves program runs once they are lowered.

Virtual slices and the resource manager, clients, submission (a call
becomes a run and futures), the single controller, its admission core
(queues, windows, budget: shared with the controller service and the
simulator) and scheduling policies, the object store and futures,
accounting, the controller service, and the cluster that holds them and
starts its backend by name (``backends.registry``). May import: ``backends``, ``compile``,
``ir``, ``core``.

Modules: ``clusters`` (the ``Cluster``, ``pw.init``/``pw.shutdown``); ``exit_wait``
(how long a process's exit waits for it); ``init_args``
(``pw.init``'s arguments, their defaults and checks); ``slices`` (virtual slices,
``pw.devices``); ``resources`` (the resource manager); ``context`` (per-thread context);
``clients`` (clients); ``runnable`` (a lowered plan with the cluster and slices it runs on);
``runs`` (a run: one call queued); ``submission`` (a call becomes a run and futures); ``controller`` (the single controller); ``windows`` (its in-flight windows, what a backend
is handed while it dispatches); ``admission`` (the admission core);
``scheduler`` (scheduling policies); ``object_store`` (the object store); ``futures``
(``pw.Future``); ``accounting`` (busy time and usage); ``array_like`` (what a future
answers as the array it stands for); ``serving`` (the controller service:
its config, records, ledger, actor and ``pw.serve``).
"""
