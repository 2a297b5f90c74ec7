"""The plan: every per-leaf fact `lm_optimizer` builds from, read from the whole tree.

Contract: `make_plan(tree, ...)` is a pure function of the tree's paths, shapes and dtypes and
the options that decide a leaf's treatment (``head``, ``muon``, ``router``, ``labels``,
``tied``), memoised on them: it labels every leaf, reads the model structure
(`rowgeom._structure`, where every axis is inferred) and gives each leaf a `PlanRow`. Under
``nnx.Optimizer`` (``init`` sees Variables, ``update`` arrays: the same paths, shapes and dtypes)
both get the same `Plan`. `rowgeom._recipe` writes chains from a plan and decides nothing;
`describe` prints it with every group's `GroupOptions`. Rules decided here, and only here: a
label's optimizer (`optimizer_of`), a tied head is not centred and a RowNorm router is
(`centred`), a Muon head is one matrix, a model has a head unless tied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import optax

from rowgeom._labels import Labeler
from rowgeom._muon import (
    MuonDimensionNumbers,
    MuonOptions,
    as_dimension_numbers,
    is_dimension_numbers,
)
from rowgeom._names import DEFAULT_ROUTER_NAMES, HEAD_OPTIMIZERS, ROUTER_OPTIMIZERS, TIED_POLICIES
from rowgeom._options import HeadOptions, RouterOptions, as_options, group_options
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
from rowgeom._tree import (
    Path,
    flatten_with_paths,
    is_masked,
    leaf_shape,
    path_str,
    prefix_entries,
    resolve_per_leaf,
    tree_paths,
    unbox,
)
from rowgeom._validation import one_of


class PlanRow(NamedTuple):
    """One parameter as `lm_optimizer` trains it (a row of `describe`): every per-leaf fact.

    ``path``: ``"/"``-joined key path; ``label``: its group (its rate, decay and momentum are
    the group's `GroupOptions`); ``geometry``: the update rule with its axes, as text;
    ``optimizer``: ``"muon"``, ``"rownorm"`` or ``"adamw"`` (``""``: a custom label);
    ``centred``: whether RowNorm centres the rows (None: no RowNorm leaf); ``muon_dims``:
    Muon's matrix axes (hidden leaves, a Muon head or router); ``vocab_axis``: the head's
    vocabulary axis (a RowNorm router's expert axis); ``batch_axes``: the axes Muon or a
    router's RowNorm takes as a batch of matrices; ``note``: what a reader should check (an
    expert stack's axes, a head that is probably unused); ``reason``: why the leaf has its
    label (``"name"``, ``"rule"``, ``"shape"``, ``"block"``, ``"tied"``, ...; ``"given"`` for
    labels given as a tree or callable).

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> row = rowgeom.describe({"embed": {"embedding": jnp.zeros((8, 4))},
      ...                         "lm_head": {"kernel": jnp.zeros((4, 8))}}, 1e-3)[1]
      >>> row.path, row.label, row.geometry, row.centred, row.reason
      ('lm_head/kernel', 'head', 'RowNorm, vocab axis 1', True, 'name')
    """

    path: str
    shape: tuple[int, ...]
    label: str
    geometry: str
    optimizer: str = ""
    centred: bool | None = None
    muon_dims: MuonDimensionNumbers | None = None
    vocab_axis: int | None = None
    batch_axes: tuple[int, ...] = ()
    note: str = ""
    reason: str = ""


class Plan(tuple):
    """Every leaf's `PlanRow`, in tree order, with the model structure it was read from and
    (from `describe`) every group's `GroupOptions`; ``str()`` is an aligned table.

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

    structure: ModelStructure
    groups: Mapping[str, Any]

    def __new__(cls, rows, structure: ModelStructure, groups: Mapping[str, Any] | None = None):
        plan = super().__new__(cls, rows)
        plan.structure, plan.groups = structure, dict(groups or {})
        return plan

    def with_groups(self, groups: Mapping[str, Any]) -> Plan:
        """The same rows, printed with these groups' rates and decays."""
        return Plan(self, self.structure, groups)

    def by_label(self, label: str) -> dict[str, PlanRow]:
        """``{path: PlanRow}`` of the leaves with this label."""
        return {row.path: row for row in self if row.label == label}

    @property
    def labels(self) -> dict[str, str]:
        """``{path: label}`` of every leaf (`rowgeom.partition_by_label`'s labels)."""
        return {row.path: row.label for row in self}

    def __str__(self) -> str:
        rate = lambda r, field: _cell(getattr(self.groups.get(r.label), field, None))
        header: tuple[str, ...] = ("path", "shape", "label", "geometry", "lr", "wd")
        cells = [header] + [(r.path, str(r.shape), r.label, r.geometry, rate(r, "learning_rate"),
                             rate(r, "weight_decay")) for r in self]
        if any(r.note for r in self):  # the column only where a leaf has something to check
            header += ("note",)
            cells = [header] + [row + (r.note,) for row, r in zip(cells[1:], self, strict=True)]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


class PlanOptions(NamedTuple):
    """The options a plan depends on (the others, rates and AdamW's, do not change a leaf's
    treatment)."""

    head: HeadOptions
    muon: MuonOptions
    router: RouterOptions
    labels: Any
    tied: str | None


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


def optimizer_of(label: str, hp: PlanOptions) -> str:
    """The optimizer of a label's leaves."""
    return {"hidden": "muon", "head": hp.head.optimizer, "router": hp.router.optimizer,
            "embedding": "adamw", "vector": "adamw"}.get(label, "")


def centred(label: str, optimizer: str, hp: PlanOptions) -> bool | None:
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


def _check_head_group(leaves, hp: PlanOptions) -> None:
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


def _labelled(tree: Any, hp: PlanOptions):
    """``([(path, shape, label)], {path: reason}, router names)`` of every leaf."""
    entries = tree_paths(tree)
    if isinstance(hp.labels, Labeler):
        leaves, _ = hp.labels.label_leaves(tree)
        return ([(lf.path, lf.shape, str(lf.label)) for lf in leaves],
                {lf.path: lf.source for lf in leaves}, hp.labels.router_names)
    given = hp.labels(tree) if callable(hp.labels) else hp.labels
    given = given.table() if isinstance(given, _GivenLabels) else given
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


def _hidden_dims(labelled, structure: ModelStructure, hp: PlanOptions, tree: Any):
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


def _head_axes(path, shape, structure: ModelStructure, hp: PlanOptions):
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


def _row(path, shape, label, reason, hp: PlanOptions, structure, hidden_dims) -> PlanRow:
    """Every fact of one leaf (module docstring)."""
    optimizer, dims, axis = optimizer_of(label, hp), None, None
    batch: tuple[int, ...] = ()
    if label == "hidden":
        dims = hidden_dims[path]
        batch = () if dims is None else batch_axes(dims, len(shape))
    elif label == "router":
        dims, axis, batch = _router_axes(path, shape, structure, optimizer)
    elif label == "head":
        dims, axis = _head_axes(path, shape, structure, hp)
    centre = centred(label, optimizer, hp)
    return PlanRow(path_str(path), tuple(shape), label,
                   _geometry(label, optimizer, centre, dims, axis, batch), optimizer, centre,
                   dims, axis, batch, _note(path, shape, label, structure, reason), reason or "")


def _plan(tree: Any, hp: PlanOptions) -> Plan:
    """The plan of `tree` (module docstring); raises naming every undecided leaf."""
    labelled, reasons, router_names = _labelled(tree, hp)
    _check_head_group(labelled, hp)
    structure = model_structure(labelled, router_names=router_names)
    hidden_dims, undecided = _hidden_dims(labelled, structure, hp, tree)
    if undecided:
        raise _undecided_error(undecided)
    return Plan([_row(p, s, label, reasons.get(p), hp, structure, hidden_dims)
                 for p, s, label in labelled], structure)


_MASKED = ("masked",)  # a partition's MaskedNode in a key: a leaf of another group
# key -> [(options, plan)], the least recently used key first. Options are compared, not
# hashed: a MuonOptions may hold a dict of dimension numbers.
_MEMO: dict[tuple, list[tuple[Any, Plan]]] = {}
_MEMO_SIZE = 64


def _key(tree: Any) -> tuple:
    """The tree's paths, shapes and dtypes (Flax boxes opened): all a plan depends on."""
    leaves, _ = flatten_with_paths(tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return tuple((path, *_MASKED) if isinstance(x, optax.MaskedNode)
                 else (path, leaf_shape(x), getattr(unbox(x), "dtype", None))
                 for path, x in leaves)


def _covers(key: tuple, view: tuple) -> bool:
    """Whether `view` (a partition's masked view) is `key` with some leaves masked."""
    return len(key) == len(view) and all(
        a[0] == b[0] and (b[1:] == _MASKED or a == b) for a, b in zip(key, view, strict=True))


class _GivenLabels(tuple):
    """A labels tree as ``(("/"-joined path, label), ...)``: hashable, so its plans memoise."""

    def table(self) -> dict[str, Any]:
        return dict(self)


def plan_options(*, head: Any = "rownorm", muon: MuonOptions | None = None,
                 router: Any = "muon", labels: Any = None, tied: str | None = None
                 ) -> PlanOptions:
    """The options objects a plan depends on, from `lm_optimizer`'s keywords; the tied policy
    said once (here or in the `Labeler` given as `labels`)."""
    one_of(tied, TIED_POLICIES, "tied")
    if isinstance(labels, (str, jax.Array)):
        # A callable `labels` passed to inject_hyperparams arrives here evaluated as a schedule.
        raise TypeError(f"labels must be None, a tree of labels or a callable, got {labels!r}; "
                        "under optax.inject_hyperparams list it in static_args "
                        "(rowgeom.STATIC_ARGS)")
    if labels is None:
        labels = Labeler(tied=tied)
    elif isinstance(labels, Labeler):
        if labels.tied is not None and tied is not None:
            raise ValueError(f"lm_optimizer: tied={tied!r} and labels=Labeler(tied="
                             f"{labels.tied!r}) both set the tied policy; give it once")
        tied = labels.tied if tied is None else tied
        labels = dataclasses.replace(labels, tied=tied)
    elif not callable(labels) and not isinstance(labels, str):
        labels = _GivenLabels(sorted((path_str(p), label)
                                     for p, label in prefix_entries(labels).items()))
    return PlanOptions(as_options(head, HeadOptions, HEAD_OPTIMIZERS, "head"),
                       as_options(muon, MuonOptions, (), "muon"),
                       as_options(router, RouterOptions, ROUTER_OPTIMIZERS, "router"),
                       labels, tied)


def plan_of(tree: Any, options: PlanOptions) -> Plan:
    """Every leaf's `PlanRow` on `tree` (arrays, ``jax.ShapeDtypeStruct`` or Flax boxes): a pure
    function of its paths, shapes and dtypes and `options` (`plan_options`), memoised on them.

    A tree with ``optax.MaskedNode`` leaves is the view ``optax.partition`` gives one group of
    a tree: its plan is the one of the whole tree, which the partition's labels (`labels_of`)
    planned just before, the most recently used plan whose key the view matches.
    """
    key = _key(tree)
    if any(entry[1:] == _MASKED for entry in key):
        for whole, plans in reversed(_MEMO.items()):
            plan = next((p for o, p in plans if o == options), None)
            if plan is not None and _covers(whole, key):
                return plan
        raise ValueError("rowgeom: a group's view of a tree no plan was made for; the group "
                         "transforms of lm_optimizer run inside its partition only")
    plans = _MEMO.pop(key, [])
    plan = next((p for o, p in plans if o == options), None)
    if plan is None:
        plan = _plan(tree, options)
        plans = [(options, plan), *plans][:8]
    _MEMO[key] = plans  # most recently used last
    if len(_MEMO) > _MEMO_SIZE:
        del _MEMO[next(iter(_MEMO))]
    return plan


def labels_of(options: PlanOptions) -> Callable[[Any], dict[str, str]]:
    """The partition's labels: ``tree -> {path: label}`` of its plan."""
    return lambda tree: plan_of(tree, options).labels


def per_leaf(options: PlanOptions, label: str, fact: Callable[[PlanRow], Any]
             ) -> Callable[[Any], dict[str, Any]]:
    """A per-leaf option of a group's transform (the callables they accept): ``tree ->
    {path: fact(row)}`` of the `label` leaves of the tree's plan."""
    return lambda tree: {path: fact(row)
                         for path, row in plan_of(tree, options).by_label(label).items()}


def make_plan(params: Any, *, head: str | HeadOptions = "rownorm",
              muon: MuonOptions | None = None, router: str | RouterOptions = "muon",
              labels: Any = None, tied: str | None = None) -> Plan:
    """The `Plan` `lm_optimizer` with these options builds its chains from on `params`: a pure
    function of the tree's paths, shapes and dtypes and the options, memoised on them.

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
      >>> params = {"embed": {"embedding": S(100, 16)}, "lm_head": {"kernel": S(16, 100)}}
      >>> rowgeom.make_plan(params).by_label("head")["lm_head/kernel"].vocab_axis
      1
      >>> rowgeom.make_plan(params) is rowgeom.make_plan(params)     # memoised
      True
    """
    return plan_of(params, plan_options(head=head, muon=muon, router=router, labels=labels,
                                        tied=tied))


def describe(params: Any, learning_rate: Any = None, *, head: str | HeadOptions = "rownorm",
             muon: MuonOptions | None = None, adam: Any = None,
             router: str | RouterOptions = "muon",
             labels: Any = None, tied: str | None = None, weight_decay: Any = 0.1,
             groups: Mapping[str, Any] | None = None) -> Plan:
    """What `lm_optimizer` with the same arguments does to each leaf of `params`.

    The same `make_plan` result `lm_optimizer` builds its chains from at ``init`` and
    ``update`` (labels with their shape cross-checks, Muon's matrix axes, the head's vocabulary
    axis), with every group's `GroupOptions` (`group_options`), so what is printed is what
    will run. Errors are those `lm_optimizer` would raise, naming the leaf.

    Args:
      params: the parameter tree (arrays, ``jax.ShapeDtypeStruct`` or Flax boxes).
      learning_rate: `lm_optimizer`'s base rate; None leaves the rate columns empty.
      head: as in `lm_optimizer`.
      muon: as in `lm_optimizer`.
      adam: as in `lm_optimizer`.
      router: as in `lm_optimizer`.
      labels: as in `lm_optimizer`.
      tied: as in `lm_optimizer`.
      weight_decay: as in `lm_optimizer`.
      groups: as in `lm_optimizer`.

    Returns:
      A `Plan`: a tuple of `PlanRow` whose ``str()`` is an aligned table.

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
    options = plan_options(head=head, muon=muon, router=router, labels=labels, tied=tied)
    return plan_of(params, options).with_groups(group_options(
        learning_rate, head=options.head, muon=options.muon, adam=adam, router=options.router,
        weight_decay=weight_decay, groups=groups))
