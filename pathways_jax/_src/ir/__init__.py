"""IR: the dataflow graph a program traces to, its fusion, and argument signatures.

A graph names only virtual slices (frozen ``SliceRef`` s); nothing here knows physical devices,
plans or the runtime. May import: ``core``.

Modules: ``graph`` (the graph); ``fusion`` (fusing its nodes); ``signatures`` (argument
signatures).
"""
