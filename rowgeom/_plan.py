"""The optimizer plan: every choice `lm_optimizer` makes for each leaf, read from the whole tree.

Contract: `make_plan(tree, hparams)` is a pure function of the tree's paths, shapes and dtypes
and the resolved `LMHyperparams`: it labels every leaf, reads the model structure
(`rowgeom._structure`, where every axis is inferred) and gives each leaf a `LeafPlan` of every
resolved choice. `rowgeom._recipe` only turns a plan into chains; `describe` returns it. Rules
decided here, and only here: a label's optimizer (`_optimizer`), a tied head is not centred and
a RowNorm router is (`_centred`), a Muon head is one matrix, a model has a head unless tied.
`PlanCache` keeps one transform's plans keyed on the structure, shapes and dtypes of its trees:
an eager ``update`` on a tree seen before plans nothing. Nothing is shared between transforms.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from rowgeom._hparams import LMHyperparams, hparams_of
from rowgeom._labels import Labeler
from rowgeom._muon import MuonDimensionNumbers, as_dimension_numbers, is_dimension_numbers
from rowgeom._names import DEFAULT_ROUTER_NAMES
from rowgeom._structure import (
    ModelStructure,
    StructureError,
    batch_axes,
    batch_roles,
    head_vocab_axis,
    model_structure,
    muon_axes,
    router_axes,
    router_matrix_axes,
)
from rowgeom._tree import Path, is_masked, leaf_shape, path_str, resolve_per_leaf, tree_paths


class LeafPlan(NamedTuple):
    """One parameter as `lm_optimizer` trains it (a row of `describe`): every choice made for it.

    ``path``: ``"/"``-joined key path; ``label``: its group; ``geometry``: the update rule with
    its axes, as text; ``learning_rate``, ``weight_decay``, ``momentum``: the group's resolved
    values (a schedule kept as the callable; None without a learning rate); ``muon_dims``: Muon's
    matrix axes (hidden leaves, a Muon head or router); ``vocab_axis``: the head's vocabulary
    axis (a RowNorm router's expert axis); ``note``: what a reader should check (an expert
    stack's axes, a head that is probably unused); ``batch_axes``: the axes Muon or a router's
    RowNorm takes as a batch of matrices; ``optimizer``: ``"muon"``, ``"rownorm"`` or
    ``"adamw"`` (``""``: a custom label); ``centred``: whether RowNorm centres the rows (None: no
    RowNorm leaf); ``reason``: why the leaf has its label (``"name"``, ``"rule"``, ``"shape"``,
    ``"block"``, ``"tied"``, ...; ``"given"`` for labels given as a tree or callable).

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> row = rowgeom.describe({"embed": {"embedding": jnp.zeros((8, 4))},
      ...                         "lm_head": {"kernel": jnp.zeros((4, 8))}}, 1e-3)[1]
      >>> row.path, row.label, row.geometry, row.learning_rate, row.centred, row.reason
      ('lm_head/kernel', 'head', 'RowNorm, vocab axis 1', 0.005, True, 'name')
    """

    path: str
    shape: tuple[int, ...]
    label: str
    geometry: str
    learning_rate: Any
    weight_decay: Any
    muon_dims: MuonDimensionNumbers | None = None
    vocab_axis: int | None = None
    note: str = ""
    batch_axes: tuple[int, ...] = ()
    optimizer: str = ""
    centred: bool | None = None
    momentum: Any = None
    reason: str = ""


class GroupPlan(NamedTuple):
    """One group's shared choices and its leaves, what `rowgeom._recipe` builds a chain from
    (an empty group keeps its resolved settings: nothing is trained with them)."""

    optimizer: str
    learning_rate: Any
    weight_decay: Any
    momentum: Any
    centred: bool | None
    leaves: Mapping[str, LeafPlan]


class OptimizerPlan(tuple):
    """Every leaf's `LeafPlan`, in tree order, with the `LMHyperparams` and model structure it
    was made from; ``str()`` is an aligned table.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> plan = rowgeom.describe({"wte": {"embedding": jnp.zeros((8, 4))}}, tied="embedding")
      >>> print(plan)
      path           shape   label      geometry  lr  wd
      -------------  ------  ---------  --------  --  ---
      wte/embedding  (8, 4)  embedding  AdamW     -   0.1
      >>> plan.structure.vocab_size, plan.structure.width
      (8, 4)
    """

    hparams: LMHyperparams
    structure: ModelStructure

    def __new__(cls, leaves, hparams: LMHyperparams, structure: ModelStructure):
        plan = super().__new__(cls, leaves)
        plan.hparams, plan.structure = hparams, structure
        return plan

    def by_label(self, label: str) -> dict[str, LeafPlan]:
        """``{path: LeafPlan}`` of the leaves with this label."""
        return {leaf.path: leaf for leaf in self if leaf.label == label}

    def group(self, label: str) -> GroupPlan:
        """The choices the leaves of one group share, and the leaves."""
        leaves = self.by_label(label)
        group = self.hparams[label]
        centred = {leaf.centred for leaf in leaves.values()}
        if len(centred) > 1:  # one chain per group: make_plan never mixes them
            raise AssertionError(f"group {label!r} mixes centred and uncentred RowNorm leaves")
        return GroupPlan(group.optimizer, group.learning_rate, group.weight_decay,
                         group.momentum, centred.pop() if centred else None, leaves)

    def __str__(self) -> str:
        header: tuple[str, ...] = ("path", "shape", "label", "geometry", "lr", "wd")
        cells = [header] + [(r.path, str(r.shape), r.label, r.geometry, _cell(r.learning_rate),
                             _cell(r.weight_decay)) for r in self]
        if any(r.note for r in self):  # the column only where a leaf has something to check
            header += ("note",)
            cells = [header] + [row + (r.note,) for row, r in zip(cells[1:], self, strict=True)]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _cell(x) -> str:
    if x is None:
        return "-"
    if callable(x):
        return "schedule"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def infers_muon_dims(dims: Any) -> bool:
    """Whether `MuonOptions.dimension_numbers` asks for inference: None, or a mapping of
    ``"/"``-joined paths to dimension numbers (overrides of the inference)."""
    return dims is None or (isinstance(dims, Mapping) and bool(dims)
                            and all(isinstance(k, str) for k in dims)
                            and all(is_dimension_numbers(v) for v in dims.values()))


def _axes_text(axes) -> str:
    return ",".join(map(str, (axes,) if isinstance(axes, int) else tuple(axes)))


def _unwrap(axes: tuple[int, ...]):
    return axes[0] if len(axes) == 1 else tuple(axes)


# --- The rules --------------------------------------------------------------------------------


def _optimizer(label: str, hp: LMHyperparams) -> str:
    """The optimizer of a label's leaves."""
    return {"hidden": "muon", "head": hp.head.optimizer, "router": hp.router.optimizer,
            "embedding": "adamw", "vector": "adamw"}.get(label, "")


def _centred(label: str, optimizer: str, hp: LMHyperparams) -> bool | None:
    """Whether RowNorm centres a leaf's rows: a head unless it is the tied input table (an
    input embedding has no shift symmetry), a router always; None for other geometries."""
    if optimizer != "rownorm":
        return None
    return label == "router" or hp.tied != "head"


def _geometry(label, optimizer, centred, dims, axis, batch) -> str:
    """A leaf's update rule as `describe` prints it."""
    with_batch = f" batch {_axes_text(batch)}" if batch else ""
    if label == "head":
        name = {"rownorm": "RowNorm", "adamw": "AdamW", "muon": "Muon"}[optimizer]
        return f"{name}{'' if centred in (None, True) else ' uncentred'}, vocab axis {axis}"
    if optimizer == "rownorm":
        return f"RowNorm over experts, expert axis {axis}{with_batch}"
    if optimizer == "adamw":
        return "AdamW"
    if optimizer == "muon" and dims is None:
        return "momentum only (dimension_numbers None)"
    if optimizer == "muon":
        return (f"Muon, in {_axes_text(dims.reduction_axis)} out {_axes_text(dims.output_axis)}"
                + with_batch)
    return "custom label"


def _check_head_group(leaves, hp: LMHyperparams) -> None:
    if any(label == "head" for _, _, label in leaves):
        return
    matrices = [(p, s, lab) for p, s, lab in leaves if len(s) == 2]
    largest = max((max(s) for _, s, _ in matrices), default=None)
    candidates = ", ".join(f"{path_str(p)} {tuple(s)} (labelled {lab!r})"
                           for p, s, lab in matrices if max(s) == largest)
    seen = f" (the matrices with the largest axis: {candidates})" if candidates else ""
    if hp.tied is None:
        raise ValueError(
            f"lm_optimizer(head={hp.head.optimizer!r}): no parameter is labelled 'head' by the "
            f"given labels{seen}. Label the output matrix 'head', or pass tied='embedding' if "
            "the logits reuse the embedding table (tied='head' trains that table with the head "
            "optimizer: label it 'head')")
    if hp.tied == "head":
        raise ValueError("lm_optimizer(tied='head'): no parameter is labelled 'head'; label the "
                         f"tied embedding table 'head'{seen}")


# --- Labels and axes ----------------------------------------------------------------------------


def _labelled(tree: Any, hp: LMHyperparams):
    """``([(path, shape, label)], {path: reason}, router names)`` of every leaf."""
    entries = tree_paths(tree)
    if isinstance(hp.labels, Labeler):
        leaves, _ = hp.labels.label_leaves(tree)
        return ([(lf.path, lf.shape, str(lf.label)) for lf in leaves],
                {lf.path: lf.source for lf in leaves}, hp.labels.router_names)
    given = hp.labels(tree) if callable(hp.labels) else hp.labels
    per_leaf = resolve_per_leaf(given, [p for p, _ in entries],
                                is_value=lambda v: isinstance(v, str), argname="labels")
    missing = [path_str(p) for (p, _), (found, _) in zip(entries, per_leaf, strict=True)
               if not found]
    if missing:
        raise ValueError(f"lm_optimizer: no label for parameter(s) {', '.join(missing)}")
    labelled = [(p, leaf_shape(x), str(label))
                for (p, x), (_, label) in zip(entries, per_leaf, strict=True)]
    return labelled, dict.fromkeys((p for p, _, _ in labelled), "given"), DEFAULT_ROUTER_NAMES


def _given_dims(option: Any, tree: Any, hidden: list[Path]) -> dict[Path, Any]:
    """Each hidden leaf's entry of a `MuonOptions.dimension_numbers` given outright (one
    value, a tree, or a callable of the tree); an entry None passes the leaf through."""
    option = option(tree) if callable(option) else option
    paths = [p for p, _ in tree_paths(tree)]
    per_leaf = dict(zip(paths, resolve_per_leaf(
        option, paths, is_value=lambda d: is_masked(d) or is_dimension_numbers(d),
        argname="MuonOptions.dimension_numbers"), strict=True))
    missing = [path_str(p) for p in hidden if not per_leaf[p][0]]
    if missing:
        raise ValueError(f"MuonOptions.dimension_numbers has no entry for the hidden "
                         f"parameter(s) {missing}")
    return {p: as_dimension_numbers(per_leaf[p][1]) for p in hidden}


def _hidden_dims(labelled, structure: ModelStructure, hp: LMHyperparams, tree: Any):
    """``({path: MuonDimensionNumbers or None}, undecided)`` of the hidden leaves: overrides
    and inferred axes (`muon_axes`), or the dimension numbers given outright."""
    option = hp.muon.dimension_numbers
    hidden = [(p, s) for p, s, label in labelled if label == "hidden"]
    if not infers_muon_dims(option):
        return _given_dims(option, tree, [p for p, _ in hidden]), []
    overrides = [(False, None)] * len(hidden)
    if option is not None:
        overrides = resolve_per_leaf(
            option, [p for p, _ in hidden], is_value=is_dimension_numbers,
            argname="MuonOptions.dimension_numbers (matched to the hidden parameters)")
    dims, undecided = {}, []
    for (path, shape), (found, value) in zip(hidden, overrides, strict=True):
        if found:
            dims[path] = as_dimension_numbers(value)
            continue
        try:
            red, out = muon_axes(path, shape, structure)
        except StructureError as err:
            undecided.append((path, shape, err, batch_roles(path, shape, structure)))
            continue
        dims[path] = MuonDimensionNumbers(_unwrap(red), _unwrap(out))
    return dims, undecided


def _undecided_error(errors) -> ValueError:
    """One error for every leaf whose Muon axes the shapes do not decide, with the mapping to
    pass (the likely reading where there is one)."""
    lines, entries = [], []
    for path, shape, err, roles in errors:
        lines.append(f"  {err}")
        roles = {**roles, **err.roles}
        dims, comment = "reduction_axis=..., output_axis=...", ""
        if err.suggestion is not None:
            red, out = err.suggestion
            dims = f"reduction_axis={_unwrap(red)!r}, output_axis={_unwrap(out)!r}"
            batch = [f"{a} ({roles.get(a, 'batch')})" for a in range(len(shape))
                     if a not in set(red) | set(out)]
            comment = f"  # batch axes {', '.join(batch)}" if batch else ""
        entries.append(f"    {path_str(path)!r}: rowgeom.MuonDimensionNumbers({dims}),{comment}")
    return ValueError(
        f"lm_optimizer: cannot infer Muon's matrix axes of {len(errors)} parameter(s) from the "
        "shapes:\n" + "\n".join(lines) + "\nCheck the likely reading below (axes not named "
        "in a side are batch axes: experts, layers), correct it where needed and pass "
        "it; leaves not named there are still inferred:\n"
        "muon=rowgeom.MuonOptions(dimension_numbers={\n" + "\n".join(entries) + "\n})")


def _router_axes(path, shape, structure: ModelStructure, optimizer: str):
    """``(muon dims or None, expert axis or None, batch axes)`` of a router leaf."""
    try:
        feature, expert = (router_axes if optimizer == "rownorm" else router_matrix_axes)(
            path, shape, structure)
    except StructureError as err:
        raise ValueError(f"lm_optimizer(router={optimizer!r}): {err}. Train routers with "
                         "router='muon', or label this one 'hidden'") from None
    batch = tuple(a for a in range(len(shape)) if a not in (feature, expert))
    if optimizer == "muon":
        return MuonDimensionNumbers(feature, expert), None, batch
    return None, (expert if optimizer == "rownorm" else None), batch


def _head_axes(path, shape, structure: ModelStructure, hp: LMHyperparams):
    """``(muon dims or None, vocabulary axis)`` of a head leaf."""
    if hp.head.optimizer == "muon" and len(shape) != 2:
        raise ValueError(f"head='muon': the head {path_str(path)} {shape} must be a single "
                         "matrix (rank 2)")
    axis = hp.head.vocab_axis
    if axis is None:
        try:
            axis = head_vocab_axis(path, shape, structure.vocab_size)
        except StructureError as err:
            raise ValueError(str(err)) from None
    return (MuonDimensionNumbers(0, 1) if hp.head.optimizer == "muon" else None), axis


def _note(path, shape, label, structure, reason) -> str:
    if reason == "unused head":
        return "probably unused: tied model, the logits read the token table"
    roles = batch_roles(path, shape, structure)
    if label == "router":
        count = structure.routers.get(tuple(path))
        text = "router" + (f" over E={count} experts" if count is not None else "")
        layers = [a for a, r in roles.items() if r == "layers"]
        return text + (f", layers axis {layers[0]}" if layers else "")
    if "experts" in roles.values():
        return ", ".join(f"{role} axis {a}" for a, role in sorted(roles.items()))
    return ""


def _leaf_plan(path, shape, label, reason, hp, structure, hidden_dims) -> LeafPlan:
    """Every choice for one leaf (module docstring)."""
    optimizer, dims, axis = _optimizer(label, hp), None, None
    batch: tuple[int, ...] = ()
    if label == "hidden":
        dims = hidden_dims[path]
        batch = () if dims is None else batch_axes(dims, len(shape))
    elif label == "router":
        dims, axis, batch = _router_axes(path, shape, structure, optimizer)
    elif label == "head":
        dims, axis = _head_axes(path, shape, structure, hp)
    centred = _centred(label, optimizer, hp)
    group = hp.groups.get(label)
    return LeafPlan(path_str(path), tuple(shape), label,
                    _geometry(label, optimizer, centred, dims, axis, batch),
                    None if group is None else group.learning_rate,
                    None if group is None else group.weight_decay, dims, axis,
                    _note(path, shape, label, structure, reason), batch, optimizer, centred,
                    None if group is None else group.momentum, reason or "")


def make_plan(tree: Any, hparams: LMHyperparams) -> OptimizerPlan:
    """The plan of `hparams` on `tree` (module docstring); raises naming every undecided leaf."""
    labelled, reasons, router_names = _labelled(tree, hparams)
    _check_head_group(labelled, hparams)
    structure = model_structure(labelled, router_names=router_names)
    hidden_dims, undecided = _hidden_dims(labelled, structure, hparams, tree)
    if undecided:
        raise _undecided_error(undecided)
    return OptimizerPlan([_leaf_plan(p, s, label, reasons.get(p), hparams, structure,
                                     hidden_dims) for p, s, label in labelled],
                         hparams, structure)


def tree_key(tree: Any) -> tuple:
    """What a plan depends on in a tree: its structure and each leaf's shape and dtype (values
    unread). The structure is the treedef where it hashes, else every leaf's path."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shapes = tuple((np.shape(x), getattr(x, "dtype", None)) for x in leaves)
    try:
        hash(treedef)
    except TypeError:  # node data that does not hash: the (slower) paths say the same
        return tuple(path for path, _ in tree_paths(tree)), shapes
    return treedef, shapes


class PlanCache:
    """The plans of one transform, and what `build` made of each, keyed on `tree_key`: a tree
    whose paths, shapes and dtypes were seen before is not planned again. The `size` most
    recently used entries are kept."""

    def __init__(self, hparams: LMHyperparams, build: Callable[[OptimizerPlan], Any],
                 size: int = 8):
        self.hparams, self.build, self.size = hparams, build, size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def built(self, tree: Any) -> Any:
        """``build(make_plan(tree, hparams))``, planned once per `tree_key`."""
        key = tree_key(tree)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        self._entries[key] = self.build(make_plan(tree, self.hparams))
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return self._entries[key]


def describe(params: Any, learning_rate: Any = None, **options: Any) -> OptimizerPlan:
    """What `lm_optimizer(learning_rate, **options)` does to each leaf of `params`.

    The same plan `lm_optimizer` builds from at ``init`` and ``update`` (labels with their
    shape cross-checks, Muon's matrix axes, the head's vocabulary axis, each group's resolved
    rate and decay), so what is printed is what will run. Errors are those `lm_optimizer`
    would raise, naming the leaf.

    Args:
      params: the parameter tree (arrays, ``jax.ShapeDtypeStruct`` or Flax boxes).
      learning_rate: `lm_optimizer`'s base rate, or an `LMHyperparams`; None leaves the rate
        columns empty.
      **options: `lm_optimizer_hparams`' keywords (``head``, ``labels``, ``tied``, ``groups``,
        ``muon``, ...).

    Returns:
      An `OptimizerPlan`: a tuple of `LeafPlan` whose ``str()`` is an aligned table.

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
      >>> params = {"embed": {"embedding": S(100, 16)},
      ...           "layers": {"attn": {"query": {"kernel": S(16, 2, 4, 4)}},  # (d, L, H, Dh)
      ...                      "norm": {"scale": S(16, 2)}},
      ...           "lm_head": {"kernel": S(16, 100)}}
      >>> print(rowgeom.describe(params, 1e-3))
      path                      shape          label      geometry                    lr     wd
      ------------------------  -------------  ---------  --------------------------  -----  ---
      embed/embedding           (100, 16)      embedding  AdamW                       0.001  0.1
      layers/attn/query/kernel  (16, 2, 4, 4)  hidden     Muon, in 0 out 2,3 batch 1  0.001  0.1
      layers/norm/scale         (16, 2)        vector     AdamW                       0.001  0
      lm_head/kernel            (16, 100)      head       RowNorm, vocab axis 1       0.005  0.1
    """
    return make_plan(params, hparams_of(learning_rate, options, caller="describe", stacklevel=2))
