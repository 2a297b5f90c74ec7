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

Contract: data flows one way. `lm_optimizer` checks and resolves its options when called:
every group's `GroupOptions` (`rowgeom._options.group_options`) and the options a plan depends
on (`rowgeom._plan.plan_options`). At ``init`` and ``update`` the tree's per-leaf facts come from
`rowgeom._plan.plan_of` (pure, memoised on paths, shapes and dtypes), and `_partition` writes
the ``optax.partition`` of the group chains from them. It decides nothing: each group's
optimizer, centring and axes are the plan's, its rate, decay and momentum its `GroupOptions`,
every other option the options objects'. No optimizer is kept between calls: the chains are
closures, written again for each call (once per trace under ``jax.jit``) from the same plan.

`track_row_diameter` ends the head chain so it measures the step the softmax sees
(docs/guides/diagnostics.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from rowgeom._diagnostics import track_row_diameter
from rowgeom._muon import MuonOptions
from rowgeom._options import (
    AdamOptions,
    GroupOptions,
    HeadOptions,
    Rate,
    RouterOptions,
    group_options,
)
from rowgeom._partition import partition_by_label
from rowgeom._plan import Plan, PlanOptions, plan_of, plan_options
from rowgeom._rownorm import projected_rownorm, rownorm_per_matrix

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


def _muon_chain(group: GroupOptions, muon: MuonOptions, dims: Mapping[str, Any]
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


def _group_chain(plan: Plan, label: str, group: GroupOptions, hp: PlanOptions,
                 adam: AdamOptions) -> optax.GradientTransformation:
    """One group's chain, by the optimizer the plan gives its leaves."""
    rows = plan.by_label(label)
    optimizer = {"hidden": "muon", "head": hp.head.optimizer, "router": hp.router.optimizer}.get(
        label, "adamw")
    if optimizer == "muon":
        return _muon_chain(group, hp.muon, {p: r.muon_dims for p, r in rows.items()})
    if optimizer == "adamw":
        return _adamw(group, adam)
    centred = {r.centred for r in rows.values()}
    if len(centred) > 1:  # one chain per group: make_plan never mixes them
        raise AssertionError(f"group {label!r} mixes centred and uncentred RowNorm leaves")
    center = centred.pop() is not False if centred else True  # an empty group never runs
    if label == "router":
        direction = rownorm_per_matrix(
            axes={p: (r.vocab_axis, r.batch_axes) for p, r in rows.items()},
            center_input=center, center_output=center, **_given(eps=hp.router.eps))
        return _rownorm_chain(group, direction)
    head = hp.head
    direction = projected_rownorm(
        vocab_axis={p: r.vocab_axis for p, r in rows.items()}, center_input=center,
        center_output=center, rescale=head.rescale, num_valid=head.num_valid, impl=head.impl,
        **_given(eps=head.eps))
    return _rownorm_chain(group, direction, debias=head.bias_correction)


def _head_chain(plan: Plan, group: GroupOptions, hp: PlanOptions,
                adam: AdamOptions) -> optax.GradientTransformation:
    """The head group's chain, the tracker last: it sees ``-lr·(U + wd·W)``, the step the
    softmax sees."""
    chain = _group_chain(plan, "head", group, hp, adam)
    if not hp.head.track:
        return chain
    axes = {path: row.vocab_axis for path, row in plan.by_label("head").items()}
    return optax.chain(chain, track_row_diameter(
        vocab_axis=axes, every_k_steps=hp.head.track_every_k_steps, impl=hp.head.impl))


def optimizer_from_plan(plan: Plan, groups: Mapping[str, GroupOptions], hp: PlanOptions,
                        adam: AdamOptions) -> optax.GradientTransformationExtraArgs:
    """The ``optax.partition`` over the plan's labels, each group's chain written from it."""
    # The router group only where the tree has routers: a dense model's state stays as it was.
    labels = ("hidden", "head", "embedding", "vector") + (
        ("router",) if plan.by_label("router") else ())
    transforms = {label: _head_chain(plan, groups[label], hp, adam) if label == "head" else
                  _group_chain(plan, label, groups[label], hp, adam) for label in labels}
    return partition_by_label(transforms, plan.labels)


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
      where the tree has routers, ``"router"``, written at ``init`` and ``update`` from the
      tree's plan (`describe` prints it; a callable ``labels`` is called when a tree's paths,
      shapes or dtypes are first planned).

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

    def built(tree: Any) -> optax.GradientTransformationExtraArgs:
        return optimizer_from_plan(plan_of(tree, hp), resolved, hp, adam)

    def init_fn(params):
        return built(params).init(params)

    def update_fn(updates, state, params=None, **extra_args):
        return built(updates).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
