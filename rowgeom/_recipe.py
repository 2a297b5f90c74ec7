"""`lm_optimizer`: one call for a language model, each parameter block in its own geometry.

=============  =========================================================================
label          chain (each group's step is ``-lr · (direction + wd · W)``, decoupled decay)
=============  =========================================================================
``hidden``     ``trace(momentum, nesterov)`` → ``muon_orthogonalize`` (RMS-matched) →
               ``add_decayed_weights`` → ``scale_by_learning_rate``
``head``       ``"rownorm"``: ``ema(momentum)`` → ``projected_rownorm`` →
               ``add_decayed_weights`` → ``scale_by_learning_rate`` → ``track_row_diameter``;
               ``"adamw"``: ``adamw`` → ``track_row_diameter``;
               ``"muon"``: the hidden chain with the head's momentum → ``track_row_diameter``
``embedding``  ``adamw``
``vector``     ``adamw`` (no weight decay by default)
``router``     ``"muon"`` (default): the hidden chain, per layer; ``"rownorm"``:
               ``ema(momentum)`` → projected RowNorm over the expert axis, per layer →
               ``add_decayed_weights`` → ``scale_by_learning_rate``; ``"adamw"``: ``adamw``
=============  =========================================================================

Contract: data flows one way, and the optimizer is built when `lm_optimizer` is called, as
optax's aliases are: the options are checked and resolved (every group's `GroupOptions`,
`rowgeom._options.group_options`), and the ``optax.partition`` of the group chains is written.
Every per-leaf fact the chains need (labels, vocabulary and expert axes, Muon's dimension
numbers) they receive as the per-leaf callables the transforms accept, each reading the one
plan of the tree (`rowgeom._plan.plan_of`: pure, memoised on paths, shapes and dtypes); a
group's rate, decay and momentum are its `GroupOptions`. Nothing is kept between calls but the
plan's memo.

`track_row_diameter` ends the head chain so it measures the step the softmax sees
(docs/guides/diagnostics.md).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from rowgeom._diagnostics import track_row_diameter
from rowgeom._muon import MuonOptions
from rowgeom._names import LABELS
from rowgeom._options import (
    AdamOptions,
    GroupOptions,
    HeadOptions,
    Rate,
    RouterOptions,
    group_options,
)
from rowgeom._plan import (
    PlanOptions,
    centred,
    labels_of,
    optimizer_of,
    per_leaf,
    plan_of,
    plan_options,
)
from rowgeom._router import rownorm_per_matrix
from rowgeom._rownorm import projected_rownorm
from rowgeom._tree import Path, lookup_prefix, map_with_paths, path_str, prefix_entries, tree_paths

STATIC_ARGS = ("labels",)
"""For ``optax.inject_hyperparams(lm_optimizer, static_args=STATIC_ARGS)``.

A callable ``labels`` would otherwise be taken for a schedule. The option objects and strings
are never injected; the float rates ``learning_rate`` and ``weight_decay`` are.

Examples:
    >>> import optax, rowgeom
    >>> tx = optax.inject_hyperparams(rowgeom.lm_optimizer, static_args=rowgeom.STATIC_ARGS)(
    ...     learning_rate=1e-3, labels=rowgeom.Labeler(), muon=rowgeom.MuonOptions(ns_steps=6))
"""


def _given(**options: Any) -> dict[str, Any]:
    """The options that are set: a None leaves the transform's own default."""
    return {k: v for k, v in options.items() if v is not None}


def _muon_chain(group: GroupOptions, muon: MuonOptions, dims: Any
                ) -> optax.GradientTransformation:
    return optax.chain(
        optax.trace(decay=group.momentum, nesterov=muon.nesterov, accumulator_dtype=muon.mu_dtype),
        muon.orthogonalize(dims),
        optax.add_decayed_weights(group.weight_decay),
        optax.scale_by_learning_rate(group.learning_rate),
    )


def _adamw(group: GroupOptions, adam: AdamOptions) -> optax.GradientTransformation:
    return optax.adamw(group.learning_rate, b1=group.momentum, b2=adam.b2, eps=adam.eps,
                       eps_root=adam.eps_root, mu_dtype=adam.mu_dtype,
                       weight_decay=group.weight_decay, nesterov=adam.nesterov)


def _rownorm_chain(group: GroupOptions, direction, *, debias: bool = False
                   ) -> optax.GradientTransformation:
    """EMA momentum (float32, before the normalisation; debiased where the head's options say)
    -> RowNorm -> decay -> rate."""
    return optax.chain(
        optax.ema(decay=group.momentum, debias=debias, accumulator_dtype=jnp.float32),
        direction,
        optax.add_decayed_weights(group.weight_decay),
        optax.scale_by_learning_rate(group.learning_rate),
    )


def _group_chain(label: str, group: GroupOptions, hp: PlanOptions, adam: AdamOptions
                 ) -> optax.GradientTransformation:
    """One group's chain, by the optimizer the plan gives its leaves; every per-leaf fact a
    callable of the tree (`rowgeom._plan.per_leaf`)."""
    optimizer = optimizer_of(label, hp)
    if optimizer == "muon":
        return _muon_chain(group, hp.muon, per_leaf(hp, label, lambda row: row.muon_dims))
    if optimizer != "rownorm":
        return _adamw(group, adam)
    center = centred(label, optimizer, hp)
    if label == "router":
        direction = rownorm_per_matrix(
            axes=per_leaf(hp, label, lambda row: (row.vocab_axis, row.batch_axes)),
            center_input=center, center_output=center, **_given(eps=hp.router.eps))
        return _rownorm_chain(group, direction)
    head = hp.head
    direction = projected_rownorm(
        vocab_axis=per_leaf(hp, label, lambda row: row.vocab_axis), center_input=center,
        center_output=center, rescale=head.rescale, num_valid=head.num_valid, impl=head.impl,
        **_given(eps=head.eps))
    return _rownorm_chain(group, direction, debias=head.bias_correction)


def _head_chain(group: GroupOptions, hp: PlanOptions, adam: AdamOptions
                ) -> optax.GradientTransformation:
    """The head group's chain, the tracker last: it sees ``-lr·(U + wd·W)``, the step the
    softmax sees."""
    chain = _group_chain("head", group, hp, adam)
    if not hp.head.track:
        return chain
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
        (`group_options`; the guide "Learning rates and radii"): hidden, embedding and vector
        use it as is, the head ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (RowNorm 5, AdamW
        3, Muon 3: the head study's sweep), the router the hidden group's.
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
    adam = adam if adam is not None else AdamOptions()
    if not isinstance(adam, AdamOptions):
        raise TypeError(f"adam must be a rowgeom.AdamOptions, got {adam!r}")
    resolved = group_options(learning_rate, head=hp.head, muon=hp.muon, adam=adam,
                             router=hp.router, weight_decay=weight_decay, groups=groups)

    transforms = {label: _head_chain(resolved[label], hp, adam) if label == "head" else
                  _group_chain(label, resolved[label], hp, adam) for label in LABELS}
    labels = labels_of(hp)
    # The router group only where the tree has routers: a dense model's state (so its
    # checkpoints) has none.
    dense = partition_by_label({k: v for k, v in transforms.items() if k != "router"}, labels)
    routed = partition_by_label(transforms, labels)

    def partition(tree: Any) -> optax.GradientTransformationExtraArgs:
        return routed if plan_of(tree, hp).by_label("router") else dense

    def init_fn(params):
        return partition(params).init(params)

    def update_fn(updates, state, params=None, **extra_args):
        return partition(updates).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def label_table(labels: Any, params: Any) -> dict[Path, Any]:
    """``{path: label}`` of a labels tree (or of ``labels(params)`` for a callable).

    Labels boxed in Variables (a ``jax.tree.map`` over an ``nnx.State`` without ``is_leaf``) are
    unboxed to their strings. Look a parameter up with ``lookup_prefix``: a labels tree may be a
    prefix of the parameters.
    """
    return prefix_entries(labels(params) if callable(labels) else labels)


def partition_by_label(
    transforms: Mapping[str, optax.GradientTransformation], labels: Any,
) -> optax.GradientTransformationExtraArgs:
    """``optax.partition`` with labels checked and matched to the tree by path.

    `labels` is a tree of label strings (the same structure as the params or a prefix of
    it) or a callable ``params -> such a tree``. Labels are looked up by normalised key
    path, not by tree structure, so one labels tree serves both calls ``nnx.Optimizer``
    makes: ``tx.init`` with an ``nnx.State`` of ``nnx.Variable`` and ``tx.update`` with the
    plain arrays. (Plain ``optax.partition`` fails on the update when the labels tree still
    holds Variables, e.g. ``jax.tree.map(f, state)`` without ``is_leaf``, or when the labels
    are a dict but the params an ``nnx.State``.)

    Every parameter needs a label and every label a transform; otherwise a ValueError at
    init (and update) lists the missing labels and their paths.

    Returns:
      The ``optax.partition`` transformation.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, rowgeom
      >>> params = {"mlp": {"kernel": jnp.zeros((8, 8))}, "lm_head": {"kernel": jnp.zeros((8, 32))}}
      >>> head = optax.chain(rowgeom.projected_rownorm(vocab_axis=1),
      ...                    optax.scale_by_learning_rate(1e-2))
      >>> tx = rowgeom.partition_by_label({"hidden": optax.sgd(1e-2), "head": head},
      ...                                 rowgeom.label_params)
      >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
      >>> rowgeom.partition_by_label({"hidden": optax.sgd(1e-2)}, rowgeom.label_params).init(params)
      Traceback (most recent call last):
      ...
      ValueError: partition_by_label: no transform for label(s) 'head' (used by lm_head/kernel). ...
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(f"transforms must be a mapping label -> transformation, got "
                        f"{type(transforms).__name__}")
    for name, tx in transforms.items():
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"transforms[{name!r}] must be an optax GradientTransformation, "
                            f"got {type(tx).__name__}")

    return optax.partition(dict(transforms),
                           functools.partial(_checked_labels, labels, transforms))


def _checked_labels(labels: Any, transforms: Mapping, params: Any) -> Any:
    """The labels tree of `params` (`label_table`), or a ValueError listing the parameters
    without a label and the labels without a transform."""
    table = label_table(labels, params)
    found = [(path, lookup_prefix(table, path)) for path, _ in tree_paths(params)]
    missing = [path_str(path) for path, (ok, _) in found if not ok]
    if missing:
        raise ValueError("partition_by_label: no label for parameter(s) " + ", ".join(missing))
    no_tx: dict[str, list[str]] = {}
    for path, (_, label) in found:
        if label not in transforms:
            no_tx.setdefault(label, []).append(path_str(path))
    if no_tx:
        detail = "; ".join(f"{lab!r} (used by {', '.join(paths)})" for lab, paths in no_tx.items())
        raise ValueError(f"partition_by_label: no transform for label(s) {detail}. "
                         f"transforms has {sorted(map(str, transforms))}")
    by_path = {path: label for path, (_, label) in found}
    return map_with_paths(lambda path, _: by_path[path], params)
