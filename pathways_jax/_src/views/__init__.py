"""Views: pictures of graphs (DOT, SVG), notebook HTML and timeline plots.

May import anything. Nothing imports ``views`` except lazily inside
``_repr_*`` methods (and ``Graph.to_dot``), so the runtime never needs it.

Modules: ``notebook`` (notebook HTML); ``render`` (DOT and SVG of graphs); ``plotting``
(``pw.plot_timeline``).
"""
