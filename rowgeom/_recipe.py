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

Contract: data flows one way. `lm_optimizer_hparams` resolves the options into an
`LMHyperparams`; for each tree `lm_optimizer` is given (paths, shapes and dtypes),
`rowgeom._plan.make_plan` reads it into an `OptimizerPlan` once (`rowgeom._plan.PlanCache`), and
`optimizer_from_plan` writes the ``optax.partition`` of the group chains from it. It decides
nothing: each group's optimizer, centring, axes, rate, decay and momentum are the plan's, each
transform's other options the option objects'.

`track_row_diameter` ends the head chain so it measures the step the softmax sees
(docs/guides/diagnostics.md).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax.numpy as jnp
import optax

from rowgeom._diagnostics import track_row_diameter
from rowgeom._hparams import hparams_of, lm_optimizer_hparams
from rowgeom._muon import muon_orthogonalize
from rowgeom._options import AdamOptions, MuonOptions
from rowgeom._partition import partition_by_label
from rowgeom._plan import GroupPlan, OptimizerPlan, PlanCache
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


def _muon_chain(group: GroupPlan, muon: MuonOptions) -> optax.GradientTransformation:
    dims = {path: leaf.muon_dims for path, leaf in group.leaves.items()}
    return optax.chain(
        optax.trace(decay=group.momentum, nesterov=muon.nesterov, accumulator_dtype=muon.mu_dtype),
        muon_orthogonalize(ns_steps=muon.ns_steps, ns_coeffs=muon.ns_coeffs, eps=muon.eps,
                           compute_dtype=muon.compute_dtype, scale=muon.scale,
                           rms_scale=muon.rms_scale, shard_matrices=muon.shard_matrices,
                           dimension_numbers=dims),
        optax.add_decayed_weights(group.weight_decay),
        optax.scale_by_learning_rate(group.learning_rate),
    )


def _adamw(group: GroupPlan, adam: AdamOptions) -> optax.GradientTransformation:
    return optax.adamw(group.learning_rate, b1=adam.b1, b2=adam.b2, eps=adam.eps,
                       eps_root=adam.eps_root, mu_dtype=adam.mu_dtype,
                       weight_decay=group.weight_decay, nesterov=adam.nesterov)


def _rownorm_chain(group: GroupPlan, direction, *, debias: bool = False
                   ) -> optax.GradientTransformation:
    """EMA momentum (float32, before the normalisation; debiased where the head's options say)
    -> RowNorm -> decay."""
    return optax.chain(
        optax.ema(decay=group.momentum, debias=debias, accumulator_dtype=jnp.float32),
        direction,
        optax.add_decayed_weights(group.weight_decay),
        optax.scale_by_learning_rate(group.learning_rate),
    )


def _rownorm_direction(plan: OptimizerPlan, label: str, group: GroupPlan):
    """The RowNorm transform of the head (its vocabulary axes) or of the routers (each
    matrix over its expert axis)."""
    center = group.centred is not False  # an empty group's chain never runs
    if label == "router":
        return rownorm_per_matrix(
            axes={p: (leaf.vocab_axis, leaf.batch_axes) for p, leaf in group.leaves.items()},
            center_input=center, center_output=center, **_given(eps=plan.hparams.router.eps))
    head = plan.hparams.head
    return projected_rownorm(
        vocab_axis={p: leaf.vocab_axis for p, leaf in group.leaves.items()},
        center_input=center, center_output=center, rescale=head.rescale,
        num_valid=head.num_valid, impl=head.impl, **_given(eps=head.eps))


def _group_chain(plan: OptimizerPlan, label: str) -> optax.GradientTransformation:
    """One group's chain, by the optimizer the plan gives its leaves."""
    group = plan.group(label)
    if group.optimizer == "muon":
        return _muon_chain(group, plan.hparams.muon)
    if group.optimizer == "adamw":
        return _adamw(group, plan.hparams.adam)
    debias = label == "head" and plan.hparams.head.bias_correction
    return _rownorm_chain(group, _rownorm_direction(plan, label, group), debias=debias)


def _head_chain(plan: OptimizerPlan) -> optax.GradientTransformation:
    """The head group's chain, the tracker last: it sees ``-lr·(U + wd·W)``, the step the
    softmax sees."""
    head = plan.hparams.head
    if not head.track:
        return _group_chain(plan, "head")
    axes = {path: leaf.vocab_axis for path, leaf in plan.by_label("head").items()}
    return optax.chain(_group_chain(plan, "head"),
                       track_row_diameter(vocab_axis=axes, every_k_steps=head.track_every_k_steps,
                                          impl=head.impl))


def optimizer_from_plan(plan: OptimizerPlan) -> optax.GradientTransformationExtraArgs:
    """The ``optax.partition`` over the plan's labels, each group's chain written from it."""
    # The router group only where the tree has routers: a dense model's state stays as it was.
    labels = ("hidden", "head", "embedding", "vector") + (
        ("router",) if plan.by_label("router") else ())
    transforms = {label: _head_chain(plan) if label == "head" else _group_chain(plan, label)
                  for label in labels}
    return partition_by_label(transforms, {leaf.path: leaf.label for leaf in plan})


def lm_optimizer(learning_rate: Any, **options: Any) -> optax.GradientTransformationExtraArgs:
    """Muon for hidden matrices, projected RowNorm (or AdamW / Muon) for the head, AdamW else.

    Args:
      learning_rate: float or schedule; every group's default derives from it (the guide
        "Learning rates and radii"): hidden, embedding and vector use it as is, the head
        ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (RowNorm 5, AdamW 3, Muon 3: the head
        study's sweep). Or an `LMHyperparams` from `lm_optimizer_hparams` (then no options).
      **options: `lm_optimizer_hparams`' keywords, each one field said once: ``head`` (a head
        optimizer name or `HeadOptions`), ``labels`` (None, a tree, a callable or a
        `Labeler`), ``tied`` (None, ``"embedding"`` or ``"head"``), ``weight_decay`` (the
        matrix groups'), ``groups`` (``{group: GroupOptions(learning_rate=...,
        weight_decay=...)}``), ``muon`` (`MuonOptions`), ``adam`` (`AdamOptions`), ``router``
        (a router optimizer name or `RouterOptions`). The flat keywords of 0.1.0
        (`FLAT_KEYWORDS`) still work, deprecated.

    Returns:
      An ``optax.partition`` over ``"hidden"``, ``"head"``, ``"embedding"``, ``"vector"`` and,
      where the tree has routers, ``"router"``, built from the plan (`describe` prints it) of
      each tree it is given at ``init`` and ``update``, planned once per paths, shapes and
      dtypes (a callable ``labels`` is called then).

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
    hp = hparams_of(learning_rate, options, caller="lm_optimizer", stacklevel=2)
    plans = PlanCache(hp, optimizer_from_plan)

    def init_fn(params):
        return plans.built(params).init(params)

    def update_fn(updates, state, params=None, **extra_args):
        return plans.built(updates).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _lm_optimizer_signature() -> inspect.Signature:
    """`lm_optimizer_hparams`' signature, written once, with `lm_optimizer`'s rate and result
    (so that ``inspect.signature`` and ``optax.inject_hyperparams`` see every keyword)."""
    sig = inspect.signature(lm_optimizer_hparams)
    rate = sig.parameters["learning_rate"].replace(annotation="Rate | LMHyperparams")
    return sig.replace(parameters=[rate, *list(sig.parameters.values())[1:]],
                       return_annotation="optax.GradientTransformationExtraArgs")


lm_optimizer.__signature__ = _lm_optimizer_signature()  # type: ignore[attr-defined]
