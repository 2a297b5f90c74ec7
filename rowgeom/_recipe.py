"""`lm_optimizer`: one call for a language model, each parameter block in its own geometry.

Each group's step is ``-lr · (direction + wd · W)``, decoupled decay: Muon (``trace`` →
``muon_orthogonalize``) for ``hidden`` and, by default, ``router``; for the ``head``, ``ema`` →
``projected_rownorm`` (or AdamW, or the Muon chain), then ``track_row_diameter``; AdamW for
``embedding`` and ``vector``. `_group_chain` writes each chain; docs/guides/learning-rates.md
tabulates them with their rates.

Three sections, data flowing one way (docs/architecture.md): the options and every group's
`GroupOptions` (`group_options`); the plan (`plan_of`, pure and memoised); `lm_optimizer`, which
writes the group chains, reading the plan through `per_leaf`, and their ``optax.partition``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from rowgeom import _messages  # the text of a plan's errors
from rowgeom._cpu import IMPLS
from rowgeom._diagnostics import track_row_diameter
from rowgeom._labels import labelled_leaves, labels_option
from rowgeom._muon import MuonDimensionNumbers, MuonOptions
from rowgeom._names import HEAD_OPTIMIZERS, LABELS, ROUTER_OPTIMIZERS
from rowgeom._router import rownorm_per_matrix
from rowgeom._rownorm import _RESCALE_MODES, EPS, _check_eps, projected_rownorm
from rowgeom._structure import (
    ModelStructure,
    batch_axes,
    batch_roles,
    head_leaf_axes,
    hidden_muon_dims,
    model_structure,
    router_leaf_axes,
)
from rowgeom._tree import (
    check_bool,
    check_int,
    check_momentum,
    check_real,
    flatten_with_paths,
    leaf_shape,
    map_with_paths,
    one_of,
    path_str,
    prefixed,
    unbox,
)

# --- `lm_optimizer`'s options as frozen objects: each field of each transform it builds, one home,
# checked on creation. A field only one optimizer reads is None by default and an error given to
# another. Why the defaults follow from one rate: docs/guides/learning-rates.md.

Rate = Any  # a float, a traced scalar (optax.inject_hyperparams) or a schedule count -> rate

HEAD_LR_MULTIPLIERS = types.MappingProxyType({"rownorm": 5.0, "adamw": 3.0, "muon": 3.0})
"""Default head learning rate per head optimizer, as a multiple of the base rate.

From the head study's sweep (docs/results/head_study.md): at base rate 0.006 the lowest final
validation loss was at head rate 0.03 for projected RowNorm and 0.018 for AdamW and Muon heads.

Examples:
    >>> import rowgeom
    >>> dict(rowgeom.HEAD_LR_MULTIPLIERS)   # read-only
    {'rownorm': 5.0, 'adamw': 3.0, 'muon': 3.0}
"""

EMA_MOMENTUM = 0.95
"""The EMA momentum of a RowNorm head or router and the trace momentum of a Muon head when
their options leave it None."""


def _only_for(owner: str, optimizer: str, needs: str, **fields) -> None:
    """Raises when a field that only the `needs` optimizer reads is given to another."""
    given = [name for name, value in fields.items() if value is not None]
    if given and optimizer != needs:
        raise ValueError(f"{owner}.{given[0]} applies to optimizer={needs!r} only, got "
                         f"optimizer={optimizer!r} with {given[0]}={fields[given[0]]!r}")


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """How `lm_optimizer` trains the LM head.

    Attributes:
      optimizer: ``"rownorm"`` (projected RowNorm, arXiv 2608.22253), ``"adamw"`` or ``"muon"``.
      momentum: EMA momentum of a RowNorm head (no Nesterov, float32, before the normalisation)
        and the trace momentum of a Muon head; None: 0.95. An AdamW head uses `AdamOptions.b1`
        (giving it here is an error).
      vocab_axis: the vocabulary axis of every head leaf; None: the one axis of size ``V``, else
        by name (``kernel`` -> 1, ``embedding``/``weight`` -> 0).
      eps: RowNorm only: rows shorter than it are divided by it (`rownorm_direction`); None:
        `rownorm_direction`'s default (``1e-8``).
      bias_correction: RowNorm only: divide the EMA ``B_t = m·B_{t-1} + (1 - m)·G_t`` by
        ``1 - m^t`` before the normalisation (``optax.ema(debias=True)``), as the paper's recipe
        does. It changes only how the rows compare with ``eps`` in the first updates.
      rescale: RowNorm only: None, ``"exact"`` (multiply the direction by ``2/D(S*)``, the whole
        diameter budget, ``O(V²d)`` per step) or ``"bound"`` (divide by the ``O(Vd)`` upper
        bound instead).
      num_valid: the number of real tokens of a padded vocabulary: token rows ``>= num_valid``
        are left out of RowNorm's means and get no RowNorm step (their weight decay still
        applies: ``-lr·wd·W_pad``, zero while those rows are zero). The other heads need no
        mask: a padding row's gradient is zero, and so is its AdamW or Muon step.
      track: record `rowgeom.RowDiameterStats` of the full head step (`read_row_diameter`).
      track_every_k_steps: measure them on the first step and every k-th (1: every step).
      impl: the formulation of RowNorm and of the tracker's bracket (`rownorm_direction`'s
        ``impl``): ``"auto"`` (decided per head leaf when traced: the XLA:CPU formulation for
        an array on one CPU device, the masked one elsewhere), ``"xla"`` or ``"cpu"``.

    Examples:
      >>> import rowgeom
      >>> rowgeom.HeadOptions(optimizer="adamw").optimizer
      'adamw'
      >>> rowgeom.HeadOptions(track_every_k_steps=0)
      Traceback (most recent call last):
      ...
      ValueError: HeadOptions.track_every_k_steps must be >= 1, got 0
    """

    optimizer: str = "rownorm"
    momentum: float | None = None
    vocab_axis: int | None = None
    eps: float | None = None
    bias_correction: bool = False
    rescale: str | None = None
    num_valid: int | None = None
    track: bool = True
    track_every_k_steps: int = 10
    impl: str = "auto"

    def __post_init__(self):
        one_of(self.optimizer, HEAD_OPTIMIZERS, "HeadOptions.optimizer")
        one_of(self.rescale, _RESCALE_MODES, "HeadOptions.rescale")
        one_of(self.impl, IMPLS, "HeadOptions.impl")
        _only_for("HeadOptions", self.optimizer, "rownorm", rescale=self.rescale, eps=self.eps,
                  bias_correction=self.bias_correction or None)
        check_bool(self.bias_correction, "HeadOptions.bias_correction")
        if self.optimizer == "adamw" and self.momentum is not None:
            raise ValueError("HeadOptions.momentum: an AdamW head's momentum is AdamOptions.b1, "
                             f"got momentum={self.momentum!r}")
        check_momentum(self.momentum, "HeadOptions.momentum")
        if self.eps is not None:
            prefixed("HeadOptions", _check_eps, self.eps)
        if self.vocab_axis is not None:
            check_int(self.vocab_axis, argname="HeadOptions.vocab_axis", minimum=-(2**31))
        if self.num_valid is not None:
            check_int(self.num_valid, argname="HeadOptions.num_valid", minimum=1)
        check_bool(self.track, "HeadOptions.track")
        check_int(self.track_every_k_steps, argname="HeadOptions.track_every_k_steps",
                  minimum=1)


@dataclasses.dataclass(frozen=True)
class RouterOptions:
    """How `lm_optimizer` trains mixture-of-experts routers (the ``"router"`` group).

    A softmax router's expert rows play the part of the head's token rows (shift-invariant
    logits); a sigmoid router's do not, and the tree cannot tell which a model has: the guide
    "Labels and partitioning" (docs/guides/labels.md, "Mixture of experts").

    Attributes:
      optimizer: ``"muon"`` (default: the hidden group's Muon chain, `MuonOptions`, per layer,
        right for every score function), ``"rownorm"`` (projected RowNorm over the expert axis,
        per layer: centred expert rows, each of norm ``<= 1``, so ``D(step) <= 2·lr``; for
        softmax routers only, since the centring drops a shift a sigmoid router does see) or
        ``"adamw"`` (`AdamOptions`).
      momentum: RowNorm only: the EMA momentum before the normalisation (no Nesterov,
        float32); None: 0.95.
      eps: RowNorm only: rows shorter than it are divided by it; None: `rownorm_direction`'s
        default (``1e-8``).

    Examples:
      >>> import rowgeom
      >>> rowgeom.RouterOptions(optimizer="rownorm").optimizer
      'rownorm'
      >>> rowgeom.group_options(1e-3, router="rownorm")["router"].momentum
      0.95
    """

    optimizer: str = "muon"
    momentum: float | None = None
    eps: float | None = None

    def __post_init__(self):
        one_of(self.optimizer, ROUTER_OPTIMIZERS, "RouterOptions.optimizer")
        _only_for("RouterOptions", self.optimizer, "rownorm", momentum=self.momentum,
                  eps=self.eps)
        check_momentum(self.momentum, "RouterOptions.momentum")
        if self.eps is not None:
            prefixed("RouterOptions", _check_eps, self.eps)


@dataclasses.dataclass(frozen=True)
class AdamOptions:
    """``optax.adamw``'s options for the embedding and vector groups, an AdamW head and an
    AdamW router (the rate and decay are the group's).

    Examples:
      >>> import rowgeom
      >>> rowgeom.AdamOptions()
      AdamOptions(b1=0.9, b2=0.95, eps=1e-08, eps_root=0.0, mu_dtype=None, nesterov=False)
    """

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    eps_root: float = 0.0
    mu_dtype: Any = None
    nesterov: bool = False

    def __post_init__(self):
        check_real(self.b1, "AdamOptions.b1", low=0.0, high=1.0, high_open=True)
        check_real(self.b2, "AdamOptions.b2", low=0.0, high=1.0, high_open=True)
        check_real(self.eps, "AdamOptions.eps", low=0.0)
        check_real(self.eps_root, "AdamOptions.eps_root", low=0.0)
        check_bool(self.nesterov, "AdamOptions.nesterov")


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    """One group's learning rate, weight decay and momentum: what `lm_optimizer` trains the
    group with, and what ``groups={group: GroupOptions(...)}`` overrides (None: derived, see
    `group_options`).

    ``learning_rate``: float or schedule ``count -> rate``; ``weight_decay``: decoupled, per
    step times the rate; ``momentum``: Muon's ``optax.trace`` decay, RowNorm's EMA decay or
    AdamW's ``b1``.

    Examples:
      >>> import rowgeom
      >>> groups = rowgeom.group_options(
      ...     1e-3, groups={"vector": rowgeom.GroupOptions(learning_rate=3e-4)})
      >>> groups["vector"].learning_rate, groups["hidden"].learning_rate
      (0.0003, 0.001)
    """

    learning_rate: Rate = None
    weight_decay: Rate = None
    momentum: float | None = None

    def __post_init__(self):
        check_momentum(self.momentum, "GroupOptions.momentum")


def as_options(value, kind: type, names: tuple[str, ...], argname: str):
    """An options object from its keyword: None -> the defaults, a name -> its optimizer."""
    if value is None:
        return kind()
    if names and isinstance(value, str):
        return kind(optimizer=one_of(value, names, argname))
    if not isinstance(value, kind):
        allowed = f"one of {names} or " if names else ""
        raise TypeError(f"{argname} must be {allowed}a rowgeom.{kind.__name__}, got {value!r}")
    return value


def _scaled(rate: Rate, factor: float) -> Rate:
    """`factor` times a learning rate; a schedule stays a schedule, None stays None."""
    if rate is None or factor == 1:
        return rate
    if callable(rate):
        return lambda count: factor * rate(count)
    return factor * rate


def group_options(
    learning_rate: Rate,
    *,
    head: str | HeadOptions = "rownorm",
    muon: MuonOptions | None = None,
    adam: AdamOptions | None = None,
    router: str | RouterOptions = "muon",
    weight_decay: Rate = 0.1,
    groups: Mapping[str, GroupOptions] | None = None,
) -> Mapping[str, GroupOptions]:
    """Every group's `GroupOptions`, resolved: the rates, decays and momenta `lm_optimizer`
    (with the same keywords) trains with, and `describe` prints.

    Defaults (the guide "Learning rates and radii"): hidden, embedding and vector use
    `learning_rate` as is, the head ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (a schedule
    stays a schedule), the router the hidden group's rate and decay; `weight_decay` for the
    matrix groups, 0 for vectors; momentum `MuonOptions.momentum` (Muon), `HeadOptions.momentum`
    or `RouterOptions.momentum` (RowNorm, None: 0.95) or `AdamOptions.b1` (AdamW). A field of
    ``groups[group]`` that is not None replaces the derived one.

    Examples:
      >>> import rowgeom
      >>> no_decay = {"head": rowgeom.GroupOptions(weight_decay=0.0)}
      >>> rowgeom.group_options(1e-3, groups=no_decay)["head"]
      GroupOptions(learning_rate=0.005, weight_decay=0.0, momentum=0.95)
      >>> warm = lambda count: 1e-3 * count / 100
      >>> round(float(rowgeom.group_options(warm, head="adamw")["head"].learning_rate(50)), 6)
      0.0015
    """
    head_: HeadOptions = as_options(head, HeadOptions, HEAD_OPTIMIZERS, "head")
    router_: RouterOptions = as_options(router, RouterOptions, ROUTER_OPTIMIZERS, "router")
    muon_: MuonOptions = as_options(muon, MuonOptions, (), "muon")
    adam_: AdamOptions = as_options(adam, AdamOptions, (), "adam")
    overrides = dict(groups or {})
    unknown = sorted(set(overrides) - set(LABELS))
    if unknown:
        raise ValueError(f"groups: unknown group(s) {unknown}; groups are {LABELS}")
    for name, value in overrides.items():
        if not isinstance(value, GroupOptions):
            raise TypeError(f"groups[{name!r}] must be a rowgeom.GroupOptions, got {value!r}")

    def group(name: str, rate: Rate, decay: Rate, mom: float) -> GroupOptions:
        given = vars(overrides.get(name, GroupOptions()))
        return dataclasses.replace(GroupOptions(rate, decay, mom),
                                   **{k: v for k, v in given.items() if v is not None})

    hidden = group("hidden", learning_rate, weight_decay, muon_.momentum)
    head_momentum = (adam_.b1 if head_.optimizer == "adamw" else
                     EMA_MOMENTUM if head_.momentum is None else head_.momentum)
    router_momentum = {"muon": muon_.momentum, "adamw": adam_.b1,
                       "rownorm": EMA_MOMENTUM if router_.momentum is None else router_.momentum}
    return types.MappingProxyType({
        "hidden": hidden,
        "head": group("head", _scaled(learning_rate, HEAD_LR_MULTIPLIERS[head_.optimizer]),
                      weight_decay, head_momentum),
        "embedding": group("embedding", learning_rate, weight_decay, adam_.b1),
        "vector": group("vector", learning_rate, 0.0, adam_.b1),
        "router": group("router", hidden.learning_rate, hidden.weight_decay,
                        router_momentum[router_.optimizer]),
    })


# --- The plan: every per-leaf fact `lm_optimizer` builds from, read from the whole tree (labels:
# `_labels`; axes: `_structure`). Decided here only: `optimizer_of`, `centred`, every label is a
# group's, a model has a head unless tied. The build (the last section) decides nothing.

class PlanRow(NamedTuple):
    """One parameter as `lm_optimizer` trains it (a row of `describe`): every per-leaf fact.

    ``path``: ``"/"``-joined key path; ``label``: its group (its rate, decay and momentum are
    the group's `GroupOptions`); ``optimizer``: ``"muon"``, ``"rownorm"`` or ``"adamw"``;
    ``centred``: whether RowNorm centres the rows (None: no RowNorm leaf); ``muon_dims``:
    Muon's matrix axes (hidden leaves, a Muon head or router); ``vocab_axis``: the head's
    vocabulary axis (a RowNorm router's expert axis); ``batch_axes``: the axes Muon or a
    router's RowNorm takes as a batch of matrices; ``note``: what a reader should check (an
    expert stack's axes, a head that is probably unused); ``reason``: why the leaf has its
    label (``"name"``, ``"rule"``, ``"shape"``, ``"block"``, ``"tied"``, ...; ``"given"`` for
    labels given as a tree or callable). ``geometry``: the update rule with its axes, as text.

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
    optimizer: str
    centred: bool | None = None
    muon_dims: MuonDimensionNumbers | None = None
    vocab_axis: int | None = None
    batch_axes: tuple[int, ...] = ()
    note: str = ""
    reason: str = ""

    @property
    def geometry(self) -> str:
        from rowgeom._describe import geometry  # text for a reader: not on the optimizer's path

        return geometry(self)


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

    def by_label(self, label: str) -> dict[str, PlanRow]:
        """``{path: PlanRow}`` of the leaves with this label."""
        return {row.path: row for row in self if row.label == label}

    @property
    def labels(self) -> dict[str, str]:
        """``{path: label}`` of every leaf (the labels ``optax.partition`` reads)."""
        return {row.path: row.label for row in self}

    def __str__(self) -> str:
        from rowgeom._describe import table  # printing only: not on the optimizer's path

        return table(self)


class PlanOptions(NamedTuple):
    """The options a plan depends on (the others, rates and AdamW's, do not change a leaf's
    treatment)."""

    head: HeadOptions
    muon: MuonOptions
    router: RouterOptions
    labels: Any
    tied: str | None


def optimizer_of(label: str, hp: PlanOptions) -> str:
    """The optimizer of a label's leaves."""
    return {"hidden": "muon", "head": hp.head.optimizer, "router": hp.router.optimizer,
            "embedding": "adamw", "vector": "adamw"}[label]


def centred(label: str, optimizer: str, hp: PlanOptions) -> bool | None:
    """Whether RowNorm centres a leaf's rows: a head unless it is the tied input table (an
    input embedding has no shift symmetry), a router always; None for other geometries."""
    if optimizer != "rownorm":
        return None
    return label == "router" or hp.tied != "head"


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
        dims, axis, batch = router_leaf_axes(path, shape, structure, optimizer)
    elif label == "head":
        dims, axis = head_leaf_axes(path, shape, structure, hp.head.optimizer,
                                    hp.head.vocab_axis)
    centre = centred(label, optimizer, hp)
    return PlanRow(path_str(path), tuple(shape), label, optimizer, centre, dims, axis, batch,
                   _note(path, shape, label, structure, reason), reason or "")


def _plan(tree: Any, hp: PlanOptions) -> Plan:
    """The plan of `tree` (module docstring); raises naming every undecided leaf."""
    labelled, router_names = labelled_leaves(hp.labels, tree)
    if any(leaf.label not in LABELS for leaf in labelled):  # a rule's or a given tree's
        raise ValueError(_messages.not_a_group(labelled))
    # A model has a head unless its head is tied and trained as the embedding.
    if hp.tied != "embedding" and not any(leaf.label == "head" for leaf in labelled):
        raise ValueError(_messages.no_head_group(labelled, hp.head.optimizer, hp.tied))
    structure = model_structure(labelled, router_names=router_names)
    hidden_dims = hidden_muon_dims(labelled, structure, hp.muon.dimension_numbers, tree)
    return Plan([_row(*leaf, hp, structure, hidden_dims) for leaf in labelled], structure)


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
    """Whether `view` (a partition's masked view) is `key` with some leaves masked; dtypes are
    not compared (a chain reads params beside updates, and no fact of a plan reads a dtype)."""
    return len(key) == len(view) and all(
        a[0] == b[0] and (b[1:] == _MASKED or a[1] == b[1]) for a, b in zip(key, view, strict=True))


def plan_options(*, head: Any = "rownorm", muon: MuonOptions | None = None,
                 router: Any = "muon", labels: Any = None, tied: str | None = None
                 ) -> PlanOptions:
    """The options objects a plan depends on, from `lm_optimizer`'s keywords; the tied policy
    said once (here or in the `Labeler` given as `labels`)."""
    labels, tied = labels_option(labels, tied)
    return PlanOptions(as_options(head, HeadOptions, HEAD_OPTIMIZERS, "head"),
                       as_options(muon, MuonOptions, (), "muon"),
                       as_options(router, RouterOptions, ROUTER_OPTIMIZERS, "router"),
                       labels, tied)


def _memoised(key: tuple, tree: Any, options: PlanOptions) -> Plan:
    plans = _MEMO.pop(key, [])
    plan = next((p for o, p in plans if o == options), None)
    if plan is None:
        plan = _plan(tree, options)
        plans = [(options, plan), *plans][:8]
    _MEMO[key] = plans  # most recently used last
    if len(_MEMO) > _MEMO_SIZE:
        del _MEMO[next(iter(_MEMO))]
    return plan


def plan_of(tree: Any, options: PlanOptions) -> Plan:
    """Every leaf's `PlanRow` on `tree` (arrays, ``jax.ShapeDtypeStruct`` or Flax boxes): a pure
    function of its paths, shapes and dtypes and `options` (`plan_options`), memoised on them."""
    return _memoised(_key(tree), tree, options)


def view_plan(tree: Any, options: PlanOptions) -> Plan:
    """The plan a chain reads: `plan_of`'s for a whole tree; for one group's masked view (from
    ``optax.partition``), the most recently used plan of a whole tree the view `_covers`."""
    key = _key(tree)
    if not any(entry[1:] == _MASKED for entry in key):
        return _memoised(key, tree, options)
    for whole, plans in reversed(_MEMO.items()):
        plan = next((p for o, p in plans if o == options), None)
        if plan is not None and _covers(whole, key):
            return plan
    raise ValueError("rowgeom: a group's view of a tree no plan was made for; the group "
                     "transforms of lm_optimizer run inside its partition only")


def per_leaf(options: PlanOptions, label: str, fact: Callable[[PlanRow], Any]
             ) -> Callable[[Any], dict[str, Any]]:
    """A per-leaf option of a group's transform (the callables they accept): ``tree ->
    {path: fact(row)}`` of the `label` leaves of the tree's plan."""
    return lambda tree: {path: fact(row)
                         for path, row in view_plan(tree, options).by_label(label).items()}


# --- `lm_optimizer`: one call for a language model, each parameter block in its own geometry.

STATIC_ARGS = ("labels",)
"""For ``optax.inject_hyperparams(lm_optimizer, static_args=STATIC_ARGS)``.

A callable ``labels`` would otherwise be taken for a schedule. The option objects and strings
are never injected; the float rates ``learning_rate`` and ``weight_decay`` are.

Examples:
    >>> import optax, rowgeom
    >>> tx = optax.inject_hyperparams(rowgeom.lm_optimizer, static_args=rowgeom.STATIC_ARGS)(
    ...     learning_rate=1e-3, labels=rowgeom.Labeler(), muon=rowgeom.MuonOptions(ns_steps=6))
"""


def _group_chain(label: str, group: GroupOptions, hp: PlanOptions, adam: AdamOptions
                 ) -> optax.GradientTransformation:
    """One group's chain (the module docstring), by the optimizer the plan gives its leaves;
    every per-leaf fact a callable of the tree (`per_leaf`)."""
    optimizer = optimizer_of(label, hp)
    if optimizer == "adamw":
        chain = optax.adamw(group.learning_rate, b1=group.momentum, b2=adam.b2, eps=adam.eps,
                            eps_root=adam.eps_root, mu_dtype=adam.mu_dtype,
                            weight_decay=group.weight_decay, nesterov=adam.nesterov)
    else:
        if optimizer == "muon":
            momentum = optax.trace(decay=group.momentum, nesterov=hp.muon.nesterov,
                                   accumulator_dtype=hp.muon.mu_dtype)
            direction = hp.muon.orthogonalize(per_leaf(hp, label, lambda row: row.muon_dims))
        else:  # RowNorm: EMA momentum in float32, before the normalisation
            center = centred(label, optimizer, hp) is not False
            options = hp.router if label == "router" else hp.head
            eps = EPS if options.eps is None else options.eps
            debias = label == "head" and hp.head.bias_correction
            momentum = optax.ema(decay=group.momentum, debias=debias,
                                 accumulator_dtype=jnp.float32)
            if label == "router":
                direction = rownorm_per_matrix(
                    axes=per_leaf(hp, label, lambda row: (row.vocab_axis, row.batch_axes)),
                    eps=eps, center_input=center, center_output=center)
            else:
                direction = projected_rownorm(
                    vocab_axis=per_leaf(hp, label, lambda row: row.vocab_axis), eps=eps,
                    center_input=center, center_output=center, rescale=hp.head.rescale,
                    num_valid=hp.head.num_valid, impl=hp.head.impl)
        chain = optax.chain(
            momentum,
            direction,
            optax.add_decayed_weights(group.weight_decay),
            optax.scale_by_learning_rate(group.learning_rate),
        )
    if label != "head" or not hp.head.track:
        return chain
    # The tracker last: it sees -lr·(U + wd·W), the step the softmax sees.
    return optax.chain(chain, track_row_diameter(
        vocab_axis=per_leaf(hp, "head", lambda row: row.vocab_axis),
        every_k_steps=hp.head.track_every_k_steps, impl=hp.head.impl))


def lm_optimizer(
    learning_rate: Rate,
    *,
    head: str | HeadOptions = "rownorm",
    muon: MuonOptions | None = None,
    adam: AdamOptions | None = None,
    router: str | RouterOptions = "muon",
    labels: Any = None,
    tied: str | None = None,
    weight_decay: Rate = 0.1,
    groups: Mapping[str, GroupOptions] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Muon for hidden matrices, projected RowNorm (or AdamW / Muon) for the head, AdamW else.

    Args:
      learning_rate: float or schedule; every group's default derives from it
        (`group_options`): the head's is ``HEAD_LR_MULTIPLIERS[optimizer]`` times it.
      head: a head optimizer name (``"rownorm"``, ``"adamw"``, ``"muon"``) or `HeadOptions`.
      muon: `MuonOptions` of the hidden group (and a Muon head or router); None: defaults.
      adam: `AdamOptions` of every AdamW group; None: the defaults.
      router: a router optimizer name (``"muon"``, ``"rownorm"``, ``"adamw"``) or
        `RouterOptions`.
      labels: None (`rowgeom.label_params`' defaults), a tree of labels, a callable ``params ->
        labels`` or a `Labeler`; labels must be in ``rowgeom.LABELS``.
      tied: None, ``"embedding"`` or ``"head"``: how a head tied to the embedding is trained
        (``"head"``: with the head optimizer, RowNorm uncentred). Said here or in the
        `Labeler` given as `labels`, not both.
      weight_decay: decoupled weight decay of the matrix groups (hidden, head, embedding; the
        router group takes the hidden group's); the vector group's default is 0.
      groups: per-group overrides ``{"hidden" | "head" | "embedding" | "vector" | "router":
        GroupOptions(learning_rate=..., weight_decay=..., momentum=...)}``; a schedule is a
        rate.

    Returns:
      An ``optax.partition`` over ``"hidden"``, ``"head"``, ``"embedding"``, ``"vector"`` and,
      where the tree has routers, ``"router"``, built now; each chain reads the tree's plan
      (`describe` prints it; a callable ``labels`` is called when a tree's paths, shapes or
      dtypes are first planned).

    Works under ``optax.inject_hyperparams(lm_optimizer)(learning_rate=...)``: the float rates
    become (possibly traced) arrays and nothing here branches on their values; a callable
    ``labels`` must then be listed in ``static_args`` (`STATIC_ARGS`).

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> params = {"embed": {"embedding": jnp.zeros((100, 16))},
      ...           "layers": {"0": {"mlp": {"up": {"kernel": jnp.zeros((16, 64))}}}},
      ...           "norm": {"scale": jnp.ones(16)},
      ...           "lm_head": {"kernel": jnp.zeros((16, 100))}}          # Flax (d, V) head
      >>> tx = rowgeom.lm_optimizer(1e-3)                                   # head lr 5e-3
      >>> grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(0), p.shape), params)
      >>> updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
      >>> exact = rowgeom.row_diameter(updates["lm_head"]["kernel"], vocab_axis=1)
      >>> bool(exact <= 2 * 5e-3 * (1 + 1e-5))                    # D(step) <= 2 head_lr
      True
      >>> stats = rowgeom.read_row_diameter(state)                # the in-chain bracket
      >>> bool(stats.lower["lm_head/kernel"] <= exact * (1 + 1e-5) <= stats.upper["lm_head/kernel"])
      True
    """
    hp = plan_options(head=head, muon=muon, router=router, labels=labels, tied=tied)
    adam = as_options(adam, AdamOptions, (), "adam")
    resolved = group_options(learning_rate, head=hp.head, muon=hp.muon, adam=adam,
                             router=hp.router, weight_decay=weight_decay, groups=groups)

    transforms = {label: _group_chain(label, resolved[label], hp, adam) for label in LABELS}

    def plan_labels(tree: Any) -> Any:  # on the tree's own paths, Flax boxes as leaves
        by_path = view_plan(tree, hp).labels
        return map_with_paths(lambda path, _: by_path[path_str(path)], tree)

    # The router group only where the tree has routers: a dense model's state (so its
    # checkpoints) has none.
    dense = optax.partition({k: v for k, v in transforms.items() if k != "router"}, plan_labels)
    routed = optax.partition(transforms, plan_labels)

    def partition(tree: Any) -> optax.GradientTransformationExtraArgs:
        return routed if plan_of(tree, hp).by_label("router") else dense

    def init_fn(params):
        return partition(params).init(params)

    def update_fn(updates, state, params=None, **extra_args):
        return partition(updates).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
