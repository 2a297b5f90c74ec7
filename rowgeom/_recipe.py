"""`lm_optimizer`: one call for a language model, each parameter block in its own geometry.

=============  =========================================================================
label          chain (each group's step is ``-lr · (direction + wd · W)``, decoupled decay)
=============  =========================================================================
``hidden``     ``trace(momentum, nesterov)`` → ``muon_orthogonalize`` (RMS-matched) →
               ``add_decayed_weights`` → ``scale_by_learning_rate``
``head``       ``head="rownorm"``: ``ema(head_momentum)`` → ``projected_rownorm`` →
               ``add_decayed_weights`` → ``scale_by_learning_rate`` → ``track_row_diameter``;
               ``head="adamw"``: ``adamw`` → ``track_row_diameter``;
               ``head="muon"``: the hidden chain with ``head_momentum`` →
               ``track_row_diameter``
``embedding``  ``adamw``
``vector``     ``adamw`` (no weight decay by default)
=============  =========================================================================

Contract: `lm_optimizer` is an ``optax.partition`` over these four labels (`label_params` by
default), each group reading the model layout (``V``, ``d``, layer stacks) from the whole tree;
`lm_optimizer_hparams` returns every group's resolved rate, decay and momentum, and `describe`
prints them per parameter.

Why the defaults follow from one learning rate (RMS-matched Muon, the head rate as a radius, the
head study's multipliers, EMA head momentum in float32): docs/guides/learning-rates.md. How the
head's vocabulary axis and Muon's matrix axes are read from the shapes:
docs/guides/labels.md. The RowNorm step itself: docs/geometry.md ("The reference step").

`track_row_diameter` ends the head chain so it measures the step the softmax sees; it measures
the first step and every ``track_every_k_steps``-th (default 10): docs/guides/diagnostics.md.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rowgeom._diagnostics import track_row_diameter
from rowgeom._labels import label_table, make_labeler, model_layout, partition_by_label
from rowgeom._layout import LayoutError, muon_axes, vocab_axis_of
from rowgeom._muon import MuonDimensionNumbers, as_dimension_numbers, muon_orthogonalize
from rowgeom._rownorm import projected_rownorm
from rowgeom._tree import (
    is_masked,
    leaf_shape,
    lookup_prefix,
    map_with_paths,
    path_str,
    tree_paths,
)

HEADS = ("rownorm", "adamw", "muon")
HEAD_LR_MULTIPLIERS = types.MappingProxyType({"rownorm": 5.0, "adamw": 3.0, "muon": 3.0})
"""Default head learning rate per head optimizer, as a multiple of the base rate.

From the head study's sweep (docs/results/head_study.md): at base rate 0.006 the lowest final
validation loss was at head rate 0.03 for projected RowNorm and 0.018 for AdamW and Muon heads.

Examples:
    >>> import rowgeom
    >>> dict(rowgeom.HEAD_LR_MULTIPLIERS)   # read-only
    {'rownorm': 5.0, 'adamw': 3.0, 'muon': 3.0}
"""
ROWNORM_HEAD_LR_MULTIPLIER = HEAD_LR_MULTIPLIERS["rownorm"]
DEFAULT_NS_STEPS = 5
# lm_optimizer's track_every_k_steps: head stats on steps 1, 10, 20, ... (10 divides the usual
# logging intervals) and no O(Vd) tracker pass in between.
DEFAULT_TRACK_EVERY_K_STEPS = 10
STATIC_ARGS = ("ns_steps", "ns_coeffs", "head_vocab_axis", "labels", "muon_dimension_numbers",
               "head_num_valid", "track_every_k_steps")
"""For ``optax.inject_hyperparams(lm_optimizer, static_args=STATIC_ARGS)``.

Needed only when one of these is passed explicitly as a number, an array, a callable or a
tree (their defaults are never injected).

Examples:
    >>> import optax, rowgeom
    >>> tx = optax.inject_hyperparams(rowgeom.lm_optimizer, static_args=rowgeom.STATIC_ARGS)(
    ...     learning_rate=1e-3, ns_steps=6)
"""

_VOCAB_AXIS_BY_NAME = {"kernel": 1, "embedding": 0, "weight": 0}
_INJECT_HINT = ("under optax.inject_hyperparams list it in static_args "
                "(rowgeom.STATIC_ARGS)")


def infer_head_vocab_axis(path: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """The vocabulary axis of a rank-2 head parameter from its name: ``kernel`` ``(d, V)`` -> 1,
    ``embedding`` or ``weight`` ``(V, d)`` -> 0; anything else raises naming the leaf."""
    name = path[-1].lower() if path else ""
    if name in _VOCAB_AXIS_BY_NAME and len(shape) == 2:
        return _VOCAB_AXIS_BY_NAME[name]
    raise ValueError(
        f"cannot infer the vocabulary axis of head parameter {path_str(path) or '<root>'!r} "
        f"(shape {tuple(shape)}): it has not exactly one axis of the vocabulary size, and only "
        "rank-2 leaves named 'kernel' ((d, V) -> 1), 'embedding' or 'weight' ((V, d) -> 0) are "
        "recognised by name. Pass head_vocab_axis=<int>")


def _scaled(learning_rate, factor: float):
    """`factor` times a learning rate; a schedule stays a schedule."""
    if factor == 1:
        return learning_rate
    if callable(learning_rate):
        return lambda count: factor * learning_rate(count)
    return factor * learning_rate


def _or(value, fallback):
    return fallback if value is None else value


def _static_int(value, argname: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{argname} must be a Python int, got {value!r}; {_INJECT_HINT}")
    return int(value)


def _muon_chain(learning_rate, weight_decay, *, momentum, nesterov, ns_steps, ns_coeffs,
                scale, dimension_numbers):
    return optax.chain(
        optax.trace(decay=momentum, nesterov=nesterov),
        muon_orthogonalize(ns_steps=ns_steps, ns_coeffs=ns_coeffs, scale=scale,
                           dimension_numbers=dimension_numbers),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


class GroupHyperparams(NamedTuple):
    """One optimizer group's resolved settings, as `lm_optimizer` uses them.

    ``optimizer``: ``"muon"``, ``"rownorm"``, ``"rownorm (uncentred)"`` (a tied table) or
    ``"adamw"``; ``learning_rate``: float or schedule; ``weight_decay``: decoupled, per step
    times the learning rate; ``momentum``: Muon/RowNorm momentum or AdamW's ``b1``.

    Examples:
      >>> import rowgeom
      >>> rowgeom.lm_optimizer_hparams(1e-3)["head"]
      GroupHyperparams(optimizer='rownorm', learning_rate=0.005, weight_decay=0.1, momentum=0.95)
    """

    optimizer: str
    learning_rate: Any
    weight_decay: Any
    momentum: Any


def lm_optimizer_hparams(
    learning_rate: float | Callable[[Any], Any],
    *,
    head: str = "rownorm",
    tied: str | None = None,
    hidden_learning_rate: float | Callable[[Any], Any] | None = None,
    head_learning_rate: float | Callable[[Any], Any] | None = None,
    embedding_learning_rate: float | Callable[[Any], Any] | None = None,
    vector_learning_rate: float | Callable[[Any], Any] | None = None,
    weight_decay: float = 0.1,
    hidden_weight_decay: float | None = None,
    head_weight_decay: float | None = None,
    embedding_weight_decay: float | None = None,
    vector_weight_decay: float = 0.0,
    momentum: float = 0.95,
    head_momentum: float = 0.95,
    adam_b1: float = 0.9,
) -> dict[str, GroupHyperparams]:
    """Every group's resolved learning rate, weight decay and momentum, as `lm_optimizer` uses.

    The one source of truth for the defaults: `lm_optimizer` calls it, so a training script
    that needs a group's rate (e.g. to measure the head step) reads it here instead of
    re-deriving it. The arguments are `lm_optimizer`'s of the same names.

    Returns:
      ``{"hidden", "head", "embedding", "vector"} -> GroupHyperparams``. The head's default rate
      is ``HEAD_LR_MULTIPLIERS[head] * learning_rate`` (a schedule stays a schedule).

    Examples:
      >>> import rowgeom
      >>> hp = rowgeom.lm_optimizer_hparams(6e-3, head="adamw")
      >>> round(hp["head"].learning_rate, 6), hp["hidden"].learning_rate, hp["vector"].weight_decay
      (0.018, 0.006, 0.0)
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if tied not in (None, "embedding", "head"):
        raise ValueError(f"tied must be None, 'embedding' or 'head', got {tied!r}")
    head_lr = _or(head_learning_rate, _scaled(learning_rate, HEAD_LR_MULTIPLIERS[head]))
    head_opt = head
    if head == "rownorm" and tied == "head":
        head_opt = "rownorm (uncentred)"
    head_mom = adam_b1 if head == "adamw" else head_momentum
    return {
        "hidden": GroupHyperparams("muon", _or(hidden_learning_rate, learning_rate),
                                   _or(hidden_weight_decay, weight_decay), momentum),
        "head": GroupHyperparams(head_opt, head_lr, _or(head_weight_decay, weight_decay),
                                 head_mom),
        "embedding": GroupHyperparams("adamw", _or(embedding_learning_rate, learning_rate),
                                      _or(embedding_weight_decay, weight_decay), adam_b1),
        "vector": GroupHyperparams("adamw", _or(vector_learning_rate, learning_rate),
                                   vector_weight_decay, adam_b1),
    }


# --- What lm_optimizer reads from the whole parameter tree -----------------------------------


class LeafPlan(NamedTuple):
    """How `lm_optimizer` treats one parameter (what `describe` prints)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    label: str
    muon_dims: MuonDimensionNumbers | None  # hidden leaves (and a Muon head)
    vocab_axis: int | None  # head leaves


def _is_dims_override(dims) -> bool:
    """A mapping ``{"/"-joined path: dimension numbers}`` (overrides of the inference)."""
    return (isinstance(dims, Mapping) and bool(dims)
            and all(isinstance(k, str) for k in dims)
            and all(as_dimension_numbers(v) is not None for v in dims.values()))


def plan_leaves(params: Any, *, labels: Any = None, tied: str | None = None,
                head: str = "rownorm", head_vocab_axis: int | None = None,
                muon_dimension_numbers: Any = None) -> list[LeafPlan]:
    """Label, Muon matrix axes and head vocabulary axis of every leaf (raises naming a leaf)."""
    table = label_table(make_labeler(tied=tied) if labels is None else labels, params)
    leaves = []
    for path, x in tree_paths(params):
        found, label = lookup_prefix(table, path)
        leaves.append((path, leaf_shape(x), label if found else None))
    missing = [path_str(p) for p, _, lab in leaves if lab is None]
    if missing:
        raise ValueError(f"lm_optimizer: no label for parameter(s) {', '.join(missing)}")
    layout = model_layout(leaves)
    group = [p for p, _, lab in leaves if lab == "head"]
    if not group and tied is None:
        raise ValueError(
            f"lm_optimizer(head={head!r}): no parameter is labelled 'head' by the given labels. "
            "Label the output matrix 'head', or pass tied='embedding' if the logits reuse the "
            "embedding table (tied='head' trains that table with the head optimizer: label it "
            "'head')")
    if not group and tied == "head":
        raise ValueError("lm_optimizer(tied='head'): no parameter is labelled 'head'; label the "
                         "tied embedding table 'head'")
    infer = muon_dimension_numbers is None or _is_dims_override(muon_dimension_numbers)
    overrides = {}
    if infer and muon_dimension_numbers is not None:
        overrides = {k: as_dimension_numbers(v) for k, v in muon_dimension_numbers.items()}
        hidden = [p for p, _, lab in leaves if lab == "hidden"]
        unknown = sorted(k for k in overrides
                         if not any(_under(p, k) for p in hidden))
        if unknown:
            raise ValueError(f"muon_dimension_numbers names {unknown}, which are not hidden "
                             "parameters (or their parents); hidden parameters are "
                             f"{sorted(path_str(p) for p in hidden)}")
    plans = []
    for path, shape, label in leaves:
        dims = axis = None
        if label == "hidden" and infer:
            given = [k for k in overrides if _under(path, k)]
            dims = (overrides[max(given, key=len)] if given
                    else _infer_dims(path, shape, layout))
        elif label == "head" and head == "muon" and len(shape) != 2:
            raise ValueError(f"head={head!r}: the head {path_str(path)} {shape} must be a "
                             "single matrix (rank 2)")
        if label == "head":
            axis = head_vocab_axis
            if axis is None:
                axis = vocab_axis_of(shape, layout.vocab_size)
            if axis is None:
                axis = infer_head_vocab_axis(path, shape)
        plans.append(LeafPlan(path, shape, label, dims, axis))
    return plans


def _under(path: tuple[str, ...], key: str) -> bool:
    """Whether the "/"-joined `key` names `path` or one of its parents."""
    parts = tuple(key.split("/"))
    return path[:len(parts)] == parts


def _infer_dims(path, shape, layout) -> MuonDimensionNumbers:
    try:
        red, out = muon_axes(path, shape, layout.width, layout.stacks)
    except LayoutError as err:
        key = path_str(path)
        raise ValueError(
            f"lm_optimizer: cannot infer Muon's matrix axes of a hidden parameter: {err}. "
            f"Say them with muon_dimension_numbers={{{key!r}: rowgeom.MuonDimensionNumbers("
            "reduction_axis=..., output_axis=...)} (other axes are batch axes; leaves not "
            "named there are still inferred)") from None
    unwrap = lambda axes: axes[0] if len(axes) == 1 else axes
    return MuonDimensionNumbers(unwrap(red), unwrap(out))


class _Plans:
    """The leaf plans of the tree being processed, for the group transforms that see only
    their masked share of it (set around each init/update by `_with_plans`)."""

    def __init__(self):
        self.stack: list[dict] = []

    def get(self, path):
        return self.stack[-1].get(path) if self.stack else None


def _with_plans(inner, plans: _Plans, make) -> optax.GradientTransformationExtraArgs:
    def run(tree, fn):
        plans.stack.append({p.path: p for p in make(tree)})
        try:
            return fn()
        finally:
            plans.stack.pop()

    def init_fn(params):
        return run(params, lambda: inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        return run(updates, lambda: inner.update(updates, state, params, **extra_args))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def lm_optimizer(
    learning_rate: float | Callable[[Any], Any],
    *,
    head: str = "rownorm",
    labels: Any = None,
    tied: str | None = None,
    hidden_learning_rate: float | Callable[[Any], Any] | None = None,
    head_learning_rate: float | Callable[[Any], Any] | None = None,
    embedding_learning_rate: float | Callable[[Any], Any] | None = None,
    vector_learning_rate: float | Callable[[Any], Any] | None = None,
    weight_decay: float = 0.1,
    hidden_weight_decay: float | None = None,
    head_weight_decay: float | None = None,
    embedding_weight_decay: float | None = None,
    vector_weight_decay: float = 0.0,
    momentum: float = 0.95,
    nesterov: bool = True,
    head_momentum: float = 0.95,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    ns_steps: int | None = None,
    ns_coeffs: Any = "keller",
    muon_scale: str | None = "rms",
    muon_dimension_numbers: Any = None,
    head_vocab_axis: int | None = None,
    head_rescale: str | None = None,
    head_num_valid: int | None = None,
    track_head: bool = True,
    track_every_k_steps: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Muon for hidden matrices, projected RowNorm (or AdamW / Muon) for the head, AdamW else.

    Args:
      learning_rate: float or schedule; every group's default derives from it
        (`lm_optimizer_hparams`; the guide "Learning rates and radii"): hidden, embedding and
        vector use it as is, the head ``HEAD_LR_MULTIPLIERS[head]`` times it (RowNorm 5, AdamW
        3, Muon 3: the head study's sweep). Derived rates of a schedule are schedules.
      head: ``"rownorm"`` (projected RowNorm, arXiv 2608.22253), ``"adamw"`` or ``"muon"``.
      labels: None (``rowgeom.label_params`` defaults with `tied`), a tree of labels or a
        callable ``params -> labels`` (e.g. ``rowgeom.make_labeler(...)``); labels must be in
        ``rowgeom.LABELS``. An empty head group raises unless `tied` is given.
      tied: None, ``"embedding"`` or ``"head"``: how a head tied to the embedding is trained
        (``rowgeom.label_params``). ``"head"`` also turns off RowNorm's centring.
      hidden_learning_rate: override of the hidden group's rate (float or schedule).
      head_learning_rate: override of the head's rate (float or schedule).
      embedding_learning_rate: override of the embedding group's rate (float or schedule).
      vector_learning_rate: override of the vector group's rate (float or schedule).
      weight_decay: decoupled weight decay of the matrix groups (hidden, head, embedding).
      hidden_weight_decay: overrides ``weight_decay`` for the hidden group.
      head_weight_decay: overrides ``weight_decay`` for the head.
      embedding_weight_decay: overrides ``weight_decay`` for the embedding group.
      vector_weight_decay: weight decay of the vector group (default 0).
      momentum: Muon momentum (``optax.trace`` decay) of the hidden group.
      nesterov: Nesterov momentum for the hidden group and a Muon head.
      head_momentum: EMA momentum of a RowNorm head (no Nesterov, float32, before the
        normalisation) and the trace momentum of a Muon head.
      adam_b1: AdamW ``b1`` of the embedding and vector groups and an AdamW head.
      adam_b2: AdamW ``b2`` of the same groups.
      adam_eps: AdamW ``eps`` of the same groups.
      ns_steps: Newton–Schulz steps (static int; None means 5, so that the default is never
        injected by ``optax.inject_hyperparams``).
      ns_coeffs: Newton–Schulz preset name, triple or table (``rowgeom.ns_coefficients``).
      muon_scale: ``rowgeom.muon_orthogonalize`` ``scale`` (``"rms"``: step RMS 0.2).
      muon_dimension_numbers: None (inferred per hidden leaf from the model layout: rank 2 is
        ``(in, out)``; scanned layers' layer axis and rank 3–4 attention/einsum kernels as in
        the guide "Labels and partitioning"; an ambiguous leaf raises, naming it); a mapping
        ``{"/"-joined path: MuonDimensionNumbers}`` overriding the inference for those leaves or
        subtrees (rowgeom's or ``optax.contrib``'s type); or, as in
        ``rowgeom.muon_orthogonalize``, one ``MuonDimensionNumbers`` for every hidden leaf, a
        tree or a callable (no inference).
      head_vocab_axis: int vocabulary axis of every head leaf; None: the one axis of size ``V``,
        else by name (``kernel`` -> 1, ``embedding``/``weight`` -> 0).
      head_rescale: ``None``, ``"exact"`` or ``"bound"``: ``projected_rownorm``'s ``rescale`` for
        a RowNorm head: ``"exact"`` multiplies the direction by ``2/D(S*)`` so that the step
        (before weight decay) has ``D = 2·head_lr`` exactly, the whole diameter budget
        (``O(V²d)`` per step); ``"bound"`` uses the ``O(Vd)`` upper bound. Only valid with
        ``head="rownorm"``.
      head_num_valid: the number of real tokens when the vocabulary is padded (e.g. to a
        multiple of 128): token rows ``>= head_num_valid`` are padding, left out of RowNorm's
        means and given a zero step (``projected_rownorm``'s ``num_valid``; static int). The
        AdamW and Muon heads need no option: padding rows (logits masked out of the loss) get
        a zero gradient and hence a zero step.
      track_head: record ``RowDiameterStats`` of the full head step (``read_row_diameter``).
      track_every_k_steps: measure them on the first step and every k-th (steps ``1, k, 2k,
        ...`` counted from ``init``; ``track_row_diameter``'s ``every_k_steps``), keeping them
        unchanged at no cost in between; their ``measured_at`` field says which step they
        describe. None means 10 (never injected by ``optax.inject_hyperparams``); pass
        your logging interval, or 1 for every step (a static int).

    Returns:
      An ``optax.partition`` over ``"hidden"``, ``"head"``, ``"embedding"`` and ``"vector"``,
      wrapped so that each group sees the layout read from the whole tree (its state is the
      partition's state).

    Works under ``optax.inject_hyperparams(lm_optimizer)(learning_rate=...)``: float arguments
    become (possibly traced) arrays and nothing here branches on their values. Integers, arrays
    of coefficients, trees and callables other than schedules must then be listed in
    ``static_args`` (`STATIC_ARGS`) when passed explicitly, or they would be injected.

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> params = {"embed": {"embedding": jnp.zeros((100, 16))},
      ...           "layers": {"0": {"mlp": {"up": {"kernel": jnp.zeros((16, 64))}}}},
      ...           "norm": {"scale": jnp.ones(16)},
      ...           "lm_head": {"kernel": jnp.zeros((16, 100))}}          # Flax (d, V) head
      >>> tx = rowgeom.lm_optimizer(1e-3)                                   # head lr 5e-3
      >>> grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(0), p.shape), params)
      >>> updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
      >>> stats = rowgeom.read_row_diameter(state)                          # the head's step
      >>> bool(stats.lower["lm_head/kernel"] <= 2 * 5e-3 * (1 + 1e-5))  # D <= 2 head_lr
      True
    """
    if head_rescale is not None and head != "rownorm":
        raise ValueError(f"head_rescale applies to head='rownorm' only, got head={head!r} with "
                         f"head_rescale={head_rescale!r}")
    hp = lm_optimizer_hparams(
        learning_rate, head=head, tied=tied, hidden_learning_rate=hidden_learning_rate,
        head_learning_rate=head_learning_rate, embedding_learning_rate=embedding_learning_rate,
        vector_learning_rate=vector_learning_rate, weight_decay=weight_decay,
        hidden_weight_decay=hidden_weight_decay, head_weight_decay=head_weight_decay,
        embedding_weight_decay=embedding_weight_decay, vector_weight_decay=vector_weight_decay,
        momentum=momentum, head_momentum=head_momentum, adam_b1=adam_b1)
    ns_steps, head_num_valid, head_vocab_axis, track_every_k_steps = _static_options(
        ns_steps, head_num_valid, head_vocab_axis, track_every_k_steps, ns_coeffs,
        muon_dimension_numbers)
    labels = _labeler(labels, tied)

    # The whole tree's plan (labels, layout) is made once per init/update; the group
    # transforms, which see only their masked share of the tree, read it by path.
    plans = _Plans()
    infer_dims = muon_dimension_numbers is None or _is_dims_override(muon_dimension_numbers)
    head_axes = _planned_head_axes(plans, head_vocab_axis)
    muon = dict(ns_steps=ns_steps, ns_coeffs=ns_coeffs, scale=muon_scale)
    adam = dict(b1=adam_b1, b2=adam_b2, eps=adam_eps)
    h, g, e, v = hp["hidden"], hp["head"], hp["embedding"], hp["vector"]
    transforms = {
        "hidden": _muon_chain(
            h.learning_rate, h.weight_decay, momentum=momentum, nesterov=nesterov,
            dimension_numbers=_planned_muon_dims(plans) if infer_dims else muon_dimension_numbers,
            **muon),
        "head": _head_chain(
            head, g, head_axes=head_axes, tied=tied, head_momentum=head_momentum,
            nesterov=nesterov, head_rescale=head_rescale, head_num_valid=head_num_valid,
            track_head=track_head, track_every_k_steps=track_every_k_steps, muon=muon,
            adam=adam),
        "embedding": optax.adamw(e.learning_rate, weight_decay=e.weight_decay, **adam),
        "vector": optax.adamw(v.learning_rate, weight_decay=v.weight_decay, **adam),
    }
    make = lambda tree: plan_leaves(
        tree, labels=labels, tied=tied, head=head, head_vocab_axis=head_vocab_axis,
        muon_dimension_numbers=muon_dimension_numbers if infer_dims else _NO_INFERENCE)
    return _with_plans(partition_by_label(transforms, labels), plans, make)


def _static_options(ns_steps, head_num_valid, head_vocab_axis, track_every_k_steps, ns_coeffs,
                    muon_dimension_numbers) -> tuple[int, int | None, int | None, int]:
    """The options that must be static (not injected): checked, with defaults filled in."""
    ns_steps = _static_int(_or(ns_steps, DEFAULT_NS_STEPS), "ns_steps")
    if head_num_valid is not None:
        head_num_valid = _static_int(head_num_valid, "head_num_valid")
    if head_vocab_axis is not None:
        head_vocab_axis = _static_int(head_vocab_axis, "head_vocab_axis")
    track_every_k_steps = _static_int(_or(track_every_k_steps, DEFAULT_TRACK_EVERY_K_STEPS),
                                      "track_every_k_steps")
    if track_every_k_steps < 1:
        raise ValueError(f"track_every_k_steps must be >= 1 (1: every step), got "
                         f"{track_every_k_steps}")
    if isinstance(ns_coeffs, jax.Array):
        raise TypeError(f"ns_coeffs must be a preset name, a tuple or a numpy table, got a "
                        f"jax array; {_INJECT_HINT}")
    if isinstance(muon_dimension_numbers, jax.Array):
        raise TypeError(f"muon_dimension_numbers must not be an array; {_INJECT_HINT}")
    return ns_steps, head_num_valid, head_vocab_axis, track_every_k_steps


def _labeler(labels, tied):
    """`labels` as given, or `label_params`' defaults with `tied` when None."""
    if labels is None:
        return make_labeler(tied=tied)
    if isinstance(labels, (str, jax.Array)):
        # A callable `labels` passed to inject_hyperparams arrives here evaluated as a schedule.
        raise TypeError(f"labels must be None, a tree of labels or a callable, got {labels!r}; "
                        f"{_INJECT_HINT}")
    return labels


def _planned_muon_dims(plans: _Plans):
    """Muon's ``dimension_numbers`` callable: each hidden leaf's inferred axes, by path."""
    return lambda tree: map_with_paths(
        lambda p, x: None if is_masked(x) else _planned(plans, p, x).muon_dims, tree,
        is_leaf=is_masked)


def _planned_head_axes(plans: _Plans, head_vocab_axis: int | None):
    """The head transforms' ``vocab_axis`` callable: each head leaf's planned axis, by path."""
    def axis(path, leaf):
        if is_masked(leaf):
            return None  # not a head parameter: the partition masked it out
        plan = plans.get(path)
        if plan is not None:
            return plan.vocab_axis
        if head_vocab_axis is not None:
            return head_vocab_axis
        return infer_head_vocab_axis(path, leaf_shape(leaf))

    return lambda tree: map_with_paths(axis, tree, is_leaf=is_masked)


def _head_chain(head: str, g: GroupHyperparams, *, head_axes, tied, head_momentum, nesterov,
                head_rescale, head_num_valid, track_head, track_every_k_steps, muon, adam):
    """The head group's chain (the module docstring's table), the tracker last."""
    if head == "rownorm":
        center = tied != "head"  # an input embedding has no shift symmetry: no centring
        head_tx = [
            optax.ema(decay=head_momentum, debias=False, accumulator_dtype=jnp.float32),
            projected_rownorm(vocab_axis=head_axes, center_input=center, center_output=center,
                              rescale=head_rescale, num_valid=head_num_valid),
            optax.add_decayed_weights(g.weight_decay),
            optax.scale_by_learning_rate(g.learning_rate),
        ]
    elif head == "adamw":
        head_tx = [optax.adamw(g.learning_rate, weight_decay=g.weight_decay, **adam)]
    else:
        head_tx = [_muon_chain(g.learning_rate, g.weight_decay, momentum=head_momentum,
                               nesterov=nesterov, dimension_numbers=None, **muon)]
    if track_head:
        # Last, so it sees -lr·(U + wd·W): the step the softmax sees.
        head_tx.append(track_row_diameter(vocab_axis=head_axes,
                                          every_k_steps=track_every_k_steps))
    return optax.chain(*head_tx)


_NO_INFERENCE = MuonDimensionNumbers()  # plan_leaves: dimension numbers given, infer nothing


def _planned(plans: _Plans, path, leaf) -> LeafPlan:
    plan = plans.get(path)
    if plan is None:  # only outside lm_optimizer's own init/update
        raise ValueError(f"no layout for {path_str(path)}: lm_optimizer's group transforms "
                         "must be used through lm_optimizer")
    return plan
