"""Which islands of hosts are lost, and why: what the controller's side knows of its hosts' deaths.

An island is lost as a unit (a host of it died). :class:`Losses` keeps the
lost islands and hosts, why, and each island's generation (bumped when it is
rebuilt on new hosts, so that a value or a death of the old hosts is told
apart); it words the ``HostLostError`` a lost island's work raises. The Ray
backend marks islands lost itself; a controller service's client applies
what the service says. Changed with the holder's lock held.
"""

from __future__ import annotations

from pathways_jax._src.backends.ray_boot import Layout


class Losses:
    """The lost islands of ``layout``'s hosts, and each island's generation.

    Attributes:
      lost: island -> why it was lost (``Backend.lost``).
      lost_hosts: host -> why (every host of a lost island).
      generations: each island's generation, bumped when it is rebuilt.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.lost: dict[int, str] = {}
        self.lost_hosts: dict[int, str] = {}
        self.before: dict[int, str] = {}  # island -> why it was lost last (rebuilt since or not)
        self.generations = [0] * layout.islands

    def record(self, island: int, why: str) -> bool:
        """Marks ``island`` and its hosts lost, saying ``why``; False if it was already."""
        if island in self.lost:
            return False
        self.lost[island] = self.before[island] = why
        for member in self.layout.members(island):
            self.lost_hosts[member] = why
        return True

    def restore(self, island: int, generation: int) -> None:
        """``island`` serves again, on new hosts of ``generation``."""
        self.lost.pop(island, None)
        self.generations[island] = generation
        for member in self.layout.members(island):
            self.lost_hosts.pop(member, None)

    def message(self, island: int, what: str) -> str:
        """The ``HostLostError`` message of ``what`` (a program, a value) that needed lost ``island``."""
        layout = self.layout
        members = layout.members(island)
        hosts = f"host {members[0]}" if len(members) == 1 else f"hosts {members[0]}-{members[-1]}"
        why = self.lost.get(island) or self.before.get(island, "it died")
        lost = f"{what} needed island {island} ({hosts}), which was lost: {why}. "
        if len(self.lost) == layout.islands:
            return lost + (
                f"Its values are gone, and no island survives (all {layout.islands} were lost), so "
                "nothing can run on this cluster: call pw.shutdown() and then pw.init(...) to start new hosts."
            )
        return lost + (
            "Its values are gone; slices on it were moved to surviving islands where they fit, so "
            "calling the program again runs there."
        )
