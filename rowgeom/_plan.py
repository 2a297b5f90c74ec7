"""The optimizer plan: what `lm_optimizer` does to each leaf, computed from the whole tree.

Contract: `make_plan(tree, hparams)` is a pure function of the tree's paths and shapes and the
resolved `LMHyperparams`. It labels every leaf (`rowgeom.label_params` or the given labels),
reads the model structure (``V``, ``d``, layer stacks: `rowgeom._structure`) and gives each leaf
its geometry, Muon's matrix axes (hidden leaves) or the vocabulary axis (head leaves), and its
group's learning rate and decay. `lm_optimizer` builds its partition from this object on every
``init``/``update``; `describe` returns it for a user to read. Nothing is cached between calls.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from rowgeom._labels import Labeler
from rowgeom._muon import MuonDimensionNumbers, as_dimension_numbers
from rowgeom._names import DEFAULT_ROUTER_NAMES, GENERIC_LEAF_NAMES
from rowgeom._options import LMHyperparams, lm_optimizer_hparams
from rowgeom._structure import (
    ModelStructure,
    StructureError,
    batch_roles,
    head_vocab_axis,
    model_structure,
    muon_axes,
    naming_path,
    router_axes,
    stack_of,
    unstacked_axes,
)
from rowgeom._tree import Path, leaf_shape, path_str, resolve_per_leaf, tree_paths


class LeafPlan(NamedTuple):
    """One parameter as `lm_optimizer` trains it (a row of `describe`).

    ``path``: ``"/"``-joined key path; ``label``: its group; ``geometry``: the update rule with
    its axes (Muon's reduction/output/batch axes, the head's vocabulary axis);
    ``muon_dims`` / ``vocab_axis``: the same axes as values (None where they do not apply; a
    RowNorm router's ``vocab_axis`` is its expert axis);
    ``learning_rate`` and ``weight_decay``: the group's resolved values (None without a
    learning rate; a schedule is kept as the callable); ``note``: what a reader should check
    (the expert and layer axes of an expert stack or router, a head that is probably unused);
    ``batch_axes``: the axes Muon or a router's RowNorm treats as a batch of matrices.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> row = rowgeom.describe({"embed": {"embedding": jnp.zeros((8, 4))},
      ...                         "lm_head": {"kernel": jnp.zeros((4, 8))}}, 1e-3)[1]
      >>> row.path, row.label, row.geometry, row.learning_rate
      ('lm_head/kernel', 'head', 'RowNorm, vocab axis 1', 0.005)
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

    def __str__(self) -> str:
        def fmt(x):
            if x is None:
                return "-"
            if callable(x):
                return "schedule"
            return f"{x:.4g}" if isinstance(x, float) else str(x)

        header: tuple[str, ...] = ("path", "shape", "label", "geometry", "lr", "wd")
        cells = [header] + [(r.path, str(r.shape), r.label, r.geometry, fmt(r.learning_rate),
                             fmt(r.weight_decay)) for r in self]
        if any(r.note for r in self):  # the column only where a leaf has something to check
            header += ("note",)
            cells = [header] + [row + (r.note,) for row, r in zip(cells[1:], self, strict=True)]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def infers_muon_dims(dims: Any) -> bool:
    """Whether `MuonOptions.dimension_numbers` asks for inference: None, or a mapping of
    ``"/"``-joined paths to dimension numbers (overrides of the inference)."""
    return dims is None or (isinstance(dims, Mapping) and bool(dims)
                            and all(isinstance(k, str) for k in dims)
                            and all(as_dimension_numbers(v) is not None for v in dims.values()))


def _is_dims(x) -> bool:
    return as_dimension_numbers(x) is not None


def _axes_text(axes) -> str:
    return ",".join(map(str, (axes,) if isinstance(axes, int) else tuple(axes)))


def _geometry(label: str, shape, dims, axis, hp: LMHyperparams, given_dims: bool,
              batch: tuple[int, ...] = ()) -> str:
    if label == "router":
        if hp.router.optimizer == "rownorm":
            text = f"RowNorm over experts, expert axis {axis}"
            return text + (f" batch {_axes_text(batch)}" if batch else "")
        if hp.router.optimizer == "adamw":
            return "AdamW"
        label = "hidden"
    if label == "hidden":
        if given_dims:
            return "Muon, given dimension_numbers"
        used = set()
        for side in (dims.reduction_axis, dims.output_axis):
            used |= set((side,) if isinstance(side, int) else side)
        rest = [a for a in range(len(shape)) if a not in used]
        text = f"Muon, in {_axes_text(dims.reduction_axis)} out {_axes_text(dims.output_axis)}"
        return text + (f" batch {_axes_text(rest)}" if rest else "")
    if label == "head":
        name = {"rownorm": "RowNorm", "adamw": "AdamW", "muon": "Muon"}[hp.head.optimizer]
        if hp.head.optimizer == "rownorm" and hp.tied == "head":
            name = "RowNorm uncentred"
        return f"{name}, vocab axis {axis}"
    if label in ("embedding", "vector"):
        return "AdamW"
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


def _features(path: Path, structure: ModelStructure, vectors) -> set[int]:
    """Sizes of the norm scales in a leaf's module (a low-rank projection's width)."""
    names = naming_path(path)
    module = names[:-2] if len(names) > 2 and names[-1].lower() in GENERIC_LEAF_NAMES \
        else names[:-1]
    found = set()
    for vpath, vshape in vectors:
        rest = list(vshape)
        stack = stack_of(vpath, structure.stacks)
        if stack is not None and stack[1] is not None and len(rest) == 2 \
                and rest[stack[1][0]] == stack[1][1]:
            del rest[stack[1][0]]  # a stacked norm scale (r, L)
        if vpath[:len(module)] == module and len(rest) == 1 and rest[0] != structure.width:
            found.add(rest[0])
    return found


def _undecided_error(errors) -> ValueError:
    """One error for every leaf whose Muon axes the shapes do not decide, with the mapping to
    pass (the likely reading where there is one)."""
    lines, entries = [], []
    for path, shape, err, roles in errors:
        lines.append(f"  {err}")
        roles = {**roles, **err.roles}
        if err.suggestion is None:
            dims = "reduction_axis=..., output_axis=..."
        else:
            red, out = err.suggestion
            unwrap = lambda axes: axes[0] if len(axes) == 1 else tuple(axes)
            dims = f"reduction_axis={unwrap(red)!r}, output_axis={unwrap(out)!r}"
        used = set() if err.suggestion is None else set(err.suggestion[0]) | set(err.suggestion[1])
        batch = [f"{a} ({roles.get(a, 'batch')})" for a in range(len(shape)) if a not in used]
        comment = f"  # batch axes {', '.join(batch)}" if err.suggestion and batch else ""
        entries.append(f"    {path_str(path)!r}: rowgeom.MuonDimensionNumbers({dims}),{comment}")
    return ValueError(
        f"lm_optimizer: cannot infer Muon's matrix axes of {len(errors)} parameter(s) from the "
        "shapes:\n" + "\n".join(lines) + "\nCheck the likely reading below (axes not named "
        "in a side are batch axes: experts, layers), correct it where needed and pass "
        "it; leaves not named there are still inferred:\n"
        "muon=rowgeom.MuonOptions(dimension_numbers={\n" + "\n".join(entries) + "\n})")


def _router_plan(path, shape, structure, hp):
    """``(muon dims or None, expert axis or None, batch axes)`` of a router leaf."""
    try:
        feature, expert = router_axes(path, shape, structure)
    except StructureError as err:
        rest = unstacked_axes(path, shape, structure.stacks)
        if hp.router.optimizer == "rownorm" or len(rest) != 2:
            raise ValueError(f"lm_optimizer(router={hp.router.optimizer!r}): {err}. Train "
                             "routers with router='muon', or label this one 'hidden'") from None
        feature, expert = rest  # Muon's polar factor does not depend on which side is which
    batch = tuple(a for a in range(len(shape)) if a not in (feature, expert))
    if hp.router.optimizer == "muon":
        return MuonDimensionNumbers(feature, expert), None, batch
    return None, (expert if hp.router.optimizer == "rownorm" else None), batch


def _note(path, shape, label, structure, source) -> str:
    if source == "unused head":
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


def make_plan(tree: Any, hparams: LMHyperparams) -> OptimizerPlan:
    """The plan of `hparams` on `tree` (module docstring); raises naming every undecided leaf."""
    hp = hparams
    labels = Labeler(tied=hp.tied) if hp.labels is None else hp.labels
    entries = tree_paths(tree)
    sources: dict[Path, str | None] = {}
    router_names: Collection[str] = DEFAULT_ROUTER_NAMES
    if isinstance(labels, Labeler):
        labelled_leaves, _ = labels.label_leaves(tree)
        sources = {lf.path: lf.source for lf in labelled_leaves}
        table = {path_str(lf.path): lf.label for lf in labelled_leaves}
        router_names = labels.router_names
        given = table
    else:
        given = labels(tree) if callable(labels) else labels
    per_leaf = resolve_per_leaf(given, [p for p, _ in entries],
                                is_value=lambda v: isinstance(v, str), argname="labels")
    leaves = [(path, leaf_shape(x), label if found else None)
              for (path, x), (found, label) in zip(entries, per_leaf, strict=True)]
    missing = [path_str(p) for p, _, label in leaves if label is None]
    if missing:
        raise ValueError(f"lm_optimizer: no label for parameter(s) {', '.join(missing)}")
    labelled = [(p, shape, str(label)) for p, shape, label in leaves]
    _check_head_group(labelled, hp)
    structure = model_structure(labelled, router_names=router_names)
    vectors = [(p, s) for p, s, label in labelled if label == "vector"]
    layer_sizes = {s[1 - s.index(structure.width)] for p, s in vectors if len(s) == 2
                   and structure.width is not None and list(s).count(structure.width) == 1
                   and stack_of(p, structure.stacks) is None}
    dims_option = hp.muon.dimension_numbers
    infer = infers_muon_dims(dims_option)
    hidden = [p for p, _, label in labelled if label == "hidden"]
    overrides = [(False, None)] * len(hidden)
    if infer and dims_option is not None:
        overrides = resolve_per_leaf(
            dims_option, hidden, is_value=_is_dims,
            argname="MuonOptions.dimension_numbers (matched to the hidden parameters)")
    override_of = dict(zip(hidden, overrides, strict=True))
    plans, undecided = [], []
    for path, shape, label in labelled:
        dims = axis = None
        batch: tuple[int, ...] = ()
        if label == "hidden" and infer:
            found, value = override_of[path]
            dims = as_dimension_numbers(value) if found else None
            if dims is None:
                try:
                    red, out = muon_axes(path, shape, structure,
                                         _features(path, structure, vectors), layer_sizes)
                except StructureError as err:
                    undecided.append((path, shape, err, batch_roles(path, shape, structure)))
                    continue
                unwrap = lambda axes: axes[0] if len(axes) == 1 else axes
                dims = MuonDimensionNumbers(unwrap(red), unwrap(out))
        if label == "router":
            dims, axis, batch = _router_plan(path, shape, structure, hp)
        if label == "head":
            if hp.head.optimizer == "muon" and len(shape) != 2:
                raise ValueError(f"head='muon': the head {path_str(path)} {shape} must be a "
                                 "single matrix (rank 2)")
            axis = hp.head.vocab_axis
            if axis is None:
                try:
                    axis = head_vocab_axis(path, shape, structure.vocab_size)
                except StructureError as err:
                    raise ValueError(str(err)) from None
        if dims is not None:
            used = set()
            for side in (dims.reduction_axis, dims.output_axis):
                used |= set((side,) if isinstance(side, int) else side)
            batch = tuple(a for a in range(len(shape)) if a not in used)
        group = hp.groups.get(label)
        plans.append(LeafPlan(
            path_str(path), tuple(shape), str(label),
            _geometry(label, shape, dims, axis, hp, given_dims=not infer and label == "hidden",
                      batch=batch),
            None if group is None else group.learning_rate,
            None if group is None else group.weight_decay, dims, axis,
            _note(path, shape, label, structure, sources.get(path)), batch))
    if undecided:
        raise _undecided_error(undecided)
    return OptimizerPlan(plans, hp, structure)


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
      **options: `lm_optimizer`'s keywords (``head``, ``labels``, ``tied``, ``groups``,
        ``muon``, ...), as `lm_optimizer_hparams` takes them.

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
    if isinstance(learning_rate, LMHyperparams):
        if options:
            raise TypeError("describe: options are part of the LMHyperparams already; got "
                            f"{sorted(options)} too")
        hp = learning_rate
    else:
        hp = lm_optimizer_hparams(learning_rate, **options)
    return make_plan(params, hp)
