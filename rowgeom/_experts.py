"""Mixture-of-experts modules: which leaves are routers and expert stacks, and the expert count.

A **mixture-of-experts module** holds a **router** (named in the labeler's router names, or an
unnamed ``(d, E)`` matrix) and **expert stacks**: its leaves with three or more axes besides the
layer axis (``(E, d, f)``, MaxText's scanned ``(E, L, d, f)``), or leaves under an
``experts``/``*moe*`` component. The expert count ``E`` is the router's axis other than ``d``
that every expert stack has (or the number of numbered experts ``experts/0``, ``experts/1``...).
A dense MLP's ``gate`` ``(d, f)``, with no expert stack beside it, is no router. Which axis of a
stack indexes the experts (its one axis of size ``E``) is read in `rowgeom._structure`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from rowgeom._names import DEFAULT_ROUTER_NAMES, GENERIC_LEAF_NAMES
from rowgeom._paths import is_expert_component, module_index, naming_path, router_index
from rowgeom._tree import Path


def _numbered_experts(paths, module: Path) -> int | None:
    """The number of numbered experts (``experts/0``, ``experts/1``, ...) under a module."""
    indices = set()
    for path in paths:
        rest = path[len(module):]
        for i, c in enumerate(rest[:-1]):
            if c.lower() in ("experts", "expert") and rest[i + 1].isdigit():
                indices.add(int(rest[i + 1]))
    return len(indices) if indices and indices == set(range(len(indices))) else None


class _MatrixLeaves:
    """The rank >= 2 leaves `find_experts` reads: shapes, labels and axes besides a layer axis."""

    def __init__(self, entries, width: int | None, axes_of: Callable[[Path, tuple], list[int]]):
        self.entries = [(tuple(p), tuple(s), lb) for p, s, lb in entries if len(s) >= 2]
        self.axes = {p: axes_of(p, s) for p, s, _ in self.entries}
        self.shapes = {p: s for p, s, _ in self.entries}
        self.labels = {p: lb for p, _, lb in self.entries}
        self.width = width
        self.may_expert = [p for p, _, lb in self.entries
                           if lb in ("hidden", None) and len(self.axes[p]) >= 3]

    def stacks_under(self, module: Path, skip) -> list[Path]:
        """The possible expert stacks of a module (its shared experts excluded)."""
        return [p for p in self.may_expert if p[:len(module)] == module and p not in skip
                and not any(c.lower().startswith("shared") for c in p[len(module):])]

    def router_sizes(self, path) -> set[int]:
        """A router's possible expert counts: its sizes other than one of ``d``."""
        sizes = [self.shapes[path][a] for a in self.axes[path]]
        if self.width is not None and sizes.count(self.width) == 1:
            return {s for s in sizes if s != self.width}
        return set(sizes)

    def count_for(self, router, members, module) -> int | None:
        """The expert count a router and the stacks beside it agree on (or numbered experts)."""
        sizes = self.router_sizes(router)
        if members:
            common = {e for e in sizes if all(any(self.shapes[m][a] == e for a in self.axes[m])
                                              for m in members)}
            if len(common) == 1:
                return common.pop()
        numbered = _numbered_experts(list(self.shapes), module)
        return numbered if numbered in sizes else None

    def common_sizes(self, members) -> set[int]:
        """Sizes at one position in every stack (the expert axis; f changes places in wo)."""
        ranks = {len(self.axes[m]) for m in members}
        if len(ranks) != 1:
            return set()
        first = members[0]
        sizes = {self.shapes[first][self.axes[first][i]] for i in range(ranks.pop())
                 if len({self.shapes[m][self.axes[m][i]] for m in members}) == 1}
        return sizes - {self.width}

    def beside(self, p: Path, module: Path, skip) -> bool:
        """A direct child leaf of the MoE module or of its parent."""
        for outer in (module, module[:-1]):
            rel = naming_path(p)[len(outer):]
            if p[:len(outer)] == outer and p not in skip and (
                    len(rel) == 1 or (len(rel) == 2 and rel[-1].lower() in GENERIC_LEAF_NAMES)):
                return True
        return False


def _named_routers(leaves: _MatrixLeaves, router_names, movable) -> dict[Path, list[Path]]:
    """``{module: [router candidates]}``: matrices labelled ``"router"`` or named as one."""
    by_module: dict[Path, list[Path]] = {}
    for path, _, label in leaves.entries:
        if len(leaves.axes[path]) != 2:
            continue
        k = router_index(path, router_names)
        if label == "router" and k is None:
            k = module_index(path)
        if k is not None and (label == "router" or (label in ("hidden", None) and movable(path))):
            by_module.setdefault(path[:k], []).append(path)
    return by_module


def _shaped_router(leaves: _MatrixLeaves, module, members, movable):
    """``(router or None, E or None)`` of expert stacks with no named router: the one unnamed
    ``(d, E)`` matrix beside them whose ``E`` they share."""
    sizes, skip, width = leaves.common_sizes(members), set(members), leaves.width
    shaped = [p for p, _, lb in leaves.entries if leaves.beside(p, module, skip)
              and lb in ("hidden", None) and movable(p) and len(leaves.axes[p]) == 2
              and width is not None and width in [leaves.shapes[p][a] for a in leaves.axes[p]]
              and leaves.router_sizes(p) & sizes]
    if len(shaped) == 1 and len(leaves.router_sizes(shaped[0]) & sizes) == 1:
        return shaped[0], (leaves.router_sizes(shaped[0]) & sizes).pop()
    return None, None


def find_experts(entries, width: int | None, axes_of: Callable[[Path, tuple], list[int]], *,
                 router_names: Collection[str] = DEFAULT_ROUTER_NAMES,
                 movable: Callable[[Path], bool] = lambda p: True):
    """``(experts, routers)``: expert-stack leaf -> ``E``, router leaf -> ``E`` (module doc).

    `entries`: ``(path, shape, label)`` of every leaf (label None: not named); `axes_of(path,
    shape)`: a leaf's axes besides its layer axis (`rowgeom._structure.unstacked_axes`).
    Routers are the leaves labelled ``"router"`` and, where `movable(path)`, the ``"hidden"`` or
    unlabelled leaves named in `router_names` (or unnamed ``(d, E)`` matrices beside expert
    stacks) that the shapes confirm; expert stacks are among the ``"hidden"`` or unlabelled
    leaves.
    """
    leaves = _MatrixLeaves(entries, width, axes_of)
    routers: dict[Path, int | None] = {}
    experts: dict[Path, int | None] = {}
    for module, candidates in _named_routers(leaves, router_names, movable).items():
        members = leaves.stacks_under(module, set(candidates))
        for router in candidates:
            count = leaves.count_for(router, members, module)
            if count is not None or leaves.labels[router] == "router":
                routers[router] = count
            if count is not None:
                experts.update((m, count) for m in members)
    # Expert stacks under an experts/moe component and no named router beside them: a router
    # by its (d, E) shape alone, else an expert count nobody can tell.
    for path in leaves.may_expert:
        marks = [i for i, c in enumerate(path[:-1]) if is_expert_component(c)]
        if path in experts or not marks:
            continue
        module = path[:marks[-1] + 1]
        members = leaves.stacks_under(module, set(routers))
        if members:
            router, count = _shaped_router(leaves, module, members, movable)
            if router is not None:
                routers[router] = count
            experts.update((m, count) for m in members)
    return experts, routers
