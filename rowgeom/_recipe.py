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
`LMHyperparams`; on every ``init`` and ``update``, `rowgeom._plan.make_plan` reads the whole tree
into an `OptimizerPlan` (each leaf's label, Muon axes or vocabulary axis, rate and decay) and
`optimizer_from_plan` builds the ``optax.partition`` from it. The group transforms receive
their axes as per-path mappings from the plan: no state is kept between calls.

`track_row_diameter` ends the head chain so it measures the step the softmax sees
(docs/guides/diagnostics.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rowgeom._diagnostics import track_row_diameter
from rowgeom._labels import partition_by_label
from rowgeom._muon import muon_orthogonalize
from rowgeom._options import (
    DEFAULT_ADAM,
    DEFAULT_MUON,
    DEFAULT_ROUTER,
    AdamOptions,
    GroupOptions,
    HeadOptions,
    LMHyperparams,
    MuonOptions,
    RouterOptions,
    lm_optimizer_hparams,
)
from rowgeom._plan import OptimizerPlan, infers_muon_dims, make_plan
from rowgeom._rownorm import projected_rownorm, rownorm_direction
from rowgeom._tree import flatten_with_paths, is_masked, path_str

STATIC_ARGS = ("labels",)
"""For ``optax.inject_hyperparams(lm_optimizer, static_args=STATIC_ARGS)``.

A callable ``labels`` would otherwise be taken for a schedule. The option objects, strings and
flat keywords are never injected; the float rates (``learning_rate``, ``head_learning_rate``,
``weight_decay``) are.

Examples:
    >>> import optax, rowgeom
    >>> tx = optax.inject_hyperparams(rowgeom.lm_optimizer, static_args=rowgeom.STATIC_ARGS)(
    ...     learning_rate=1e-3, labels=rowgeom.Labeler(), muon=rowgeom.MuonOptions(ns_steps=6))
"""


def _muon_chain(learning_rate, weight_decay, *, momentum, muon: MuonOptions, dimension_numbers):
    return optax.chain(
        optax.trace(decay=momentum, nesterov=muon.nesterov),
        muon_orthogonalize(ns_steps=muon.ns_steps, ns_coeffs=muon.ns_coeffs, scale=muon.scale,
                           shard_matrices=muon.shard_matrices,
                           dimension_numbers=dimension_numbers),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def _head_chain(plan: OptimizerPlan) -> optax.GradientTransformation:
    """The head group's chain (the module docstring's table), the tracker last."""
    hp = plan.hparams
    head, group = hp.head, hp["head"]
    axes = {path: leaf.vocab_axis for path, leaf in plan.by_label("head").items()}
    if head.optimizer == "rownorm":
        center = hp.tied != "head"  # an input embedding has no shift symmetry: no centring
        chain = [
            optax.ema(decay=head.momentum, debias=False, accumulator_dtype=jnp.float32),
            projected_rownorm(vocab_axis=axes, center_input=center, center_output=center,
                              rescale=head.rescale, num_valid=head.num_valid),
            optax.add_decayed_weights(group.weight_decay),
            optax.scale_by_learning_rate(group.learning_rate),
        ]
    elif head.optimizer == "adamw":
        chain = [optax.adamw(group.learning_rate, weight_decay=group.weight_decay,
                             b1=hp.adam.b1, b2=hp.adam.b2, eps=hp.adam.eps)]
    else:
        chain = [_muon_chain(group.learning_rate, group.weight_decay, momentum=head.momentum,
                             muon=hp.muon, dimension_numbers=None)]
    if head.track:
        # Last, so it sees -lr·(U + wd·W): the step the softmax sees.
        chain.append(track_row_diameter(vocab_axis=axes,
                                        every_k_steps=head.track_every_k_steps))
    return optax.chain(*chain)


def _rownorm_per_matrix(axes: Mapping[str, tuple[int | None, tuple[int, ...]]]):
    """Projected RowNorm of each leaf along its expert axis, one matrix per batch index.

    `axes`: ``{path: (expert axis, batch axes)}``; a scanned router ``(d, L, E)`` is ``L``
    independent ``(d, E)`` matrices, so the row norms and means never mix layers.
    """

    def one(u, axis, batch):
        assert axis is not None  # the plan gives every RowNorm router its expert axis
        if not batch:
            return rownorm_direction(u, vocab_axis=axis)
        front = jnp.moveaxis(u, batch, tuple(range(len(batch))))
        rest = [a for a in range(u.ndim) if a not in batch]
        flat = front.reshape((-1,) + front.shape[len(batch):])
        out = jax.vmap(lambda m: rownorm_direction(m, vocab_axis=rest.index(axis)))(flat)
        return jnp.moveaxis(out.reshape(front.shape), tuple(range(len(batch))), batch)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = flatten_with_paths(updates, open_boxes=True, is_leaf=is_masked)
        out = [u if is_masked(u) or path_str(p) not in axes else one(u, *axes[path_str(p)])
               for p, u in leaves]
        return jax.tree_util.tree_unflatten(treedef, out), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _router_chain(plan: OptimizerPlan) -> optax.GradientTransformation:
    """The router group's chain (the module docstring's table)."""
    hp = plan.hparams
    group, leaves = hp["router"], plan.by_label("router")
    if hp.router.optimizer == "adamw":
        return optax.adamw(group.learning_rate, weight_decay=group.weight_decay, b1=hp.adam.b1,
                           b2=hp.adam.b2, eps=hp.adam.eps)
    if hp.router.optimizer == "muon":
        return _muon_chain(group.learning_rate, group.weight_decay, momentum=group.momentum,
                           muon=hp.muon, dimension_numbers={
                               path: leaf.muon_dims for path, leaf in leaves.items()})
    axes = {path: (leaf.vocab_axis, leaf.batch_axes) for path, leaf in leaves.items()}
    return optax.chain(
        optax.ema(decay=group.momentum, debias=False, accumulator_dtype=jnp.float32),
        _rownorm_per_matrix(axes),
        optax.add_decayed_weights(group.weight_decay),
        optax.scale_by_learning_rate(group.learning_rate),
    )


def optimizer_from_plan(plan: OptimizerPlan) -> optax.GradientTransformationExtraArgs:
    """The ``optax.partition`` over the plan's labels, each group's chain built from the plan."""
    hp = plan.hparams
    hidden_dims = hp.muon.dimension_numbers
    if infers_muon_dims(hidden_dims):
        hidden_dims = {path: leaf.muon_dims for path, leaf in plan.by_label("hidden").items()}
    adam = dict(b1=hp.adam.b1, b2=hp.adam.b2, eps=hp.adam.eps)
    h, e, v = hp["hidden"], hp["embedding"], hp["vector"]
    transforms = {
        "hidden": _muon_chain(h.learning_rate, h.weight_decay, momentum=h.momentum, muon=hp.muon,
                              dimension_numbers=hidden_dims),
        "head": _head_chain(plan),
        "embedding": optax.adamw(e.learning_rate, weight_decay=e.weight_decay, **adam),
        "vector": optax.adamw(v.learning_rate, weight_decay=v.weight_decay, **adam),
    }
    if plan.by_label("router"):  # only then: a dense model's optimizer state stays as it was
        transforms["router"] = _router_chain(plan)
    return partition_by_label(transforms, {leaf.path: leaf.label for leaf in plan})


def lm_optimizer(
    learning_rate: float | Callable[[Any], Any] | LMHyperparams,
    *,
    head: str | HeadOptions = "rownorm",
    labels: Any = None,
    tied: str | None = None,
    head_learning_rate: float | Callable[[Any], Any] | None = None,
    weight_decay: float = 0.1,
    groups: Mapping[str, GroupOptions] | None = None,
    muon: MuonOptions = DEFAULT_MUON,
    adam: AdamOptions = DEFAULT_ADAM,
    router: str | RouterOptions = DEFAULT_ROUTER,
    **flat: Any,
) -> optax.GradientTransformationExtraArgs:
    """Muon for hidden matrices, projected RowNorm (or AdamW / Muon) for the head, AdamW else.

    Args:
      learning_rate: float or schedule; every group's default derives from it (the guide
        "Learning rates and radii"): hidden, embedding and vector use it as is, the head
        ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (RowNorm 5, AdamW 3, Muon 3: the head
        study's sweep). Or an `LMHyperparams` from `lm_optimizer_hparams` (then no options).
      head: a head optimizer name (``"rownorm"``, ``"adamw"``, ``"muon"``) or `HeadOptions`
        (momentum, vocabulary axis, padding ``num_valid``, ``rescale``, the tracker).
      labels: None (``rowgeom.label_params`` defaults with `tied`), a tree of labels, a callable
        ``params -> labels`` or a `Labeler`; labels must be in ``rowgeom.LABELS``. An empty head
        group raises unless `tied` is given.
      tied: None, ``"embedding"`` or ``"head"``: how a head tied to the embedding is trained
        (``rowgeom.label_params``). ``"head"`` also turns off RowNorm's centring.
      head_learning_rate: the head's rate (float or schedule) instead of the multiple.
      weight_decay: decoupled weight decay of the matrix groups (hidden, head, embedding).
      groups: per-group overrides ``{group: GroupOptions(learning_rate=..., weight_decay=...)}``.
      muon: `MuonOptions` of the hidden group (momentum, Nesterov, Newton–Schulz, scale, matrix
        axes; by default inferred per leaf from the model structure, see the labels guide).
      adam: `AdamOptions` of the AdamW groups.
      router: how mixture-of-experts routers (label ``"router"``) are trained: ``"muon"``
        (default), ``"rownorm"`` (projected RowNorm over the expert axis, for softmax routers)
        or ``"adamw"``, or a `RouterOptions` (the labels guide says which routers are
        shift-invariant).
      **flat: shorthands, each one field of the objects above (`rowgeom.FLAT_KEYWORDS`:
        ``ns_steps=6``, ``head_num_valid=50257``, ``vector_learning_rate=...``).

    Returns:
      An ``optax.partition`` over ``"hidden"``, ``"head"``, ``"embedding"``, ``"vector"`` and,
      where the tree has routers, ``"router"``, rebuilt from the plan of the tree it is given at
      each ``init`` and ``update`` (`describe` prints that plan).

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
    if isinstance(learning_rate, LMHyperparams):
        given = {k: v for k, v in dict(head=head, labels=labels, tied=tied,
                                       head_learning_rate=head_learning_rate,
                                       weight_decay=weight_decay, groups=groups, muon=muon,
                                       adam=adam, router=router).items()
                 if v is not _DEFAULTS[k]} | flat
        if given:
            raise TypeError(f"lm_optimizer: options are part of the LMHyperparams already; got "
                            f"{sorted(given)} too")
        hp = learning_rate
    else:
        hp = lm_optimizer_hparams(
            learning_rate, head=head, labels=labels, tied=tied,
            head_learning_rate=head_learning_rate, weight_decay=weight_decay, groups=groups,
            muon=muon, adam=adam, router=router, **flat)

    def init_fn(params):
        return optimizer_from_plan(make_plan(params, hp)).init(params)

    def update_fn(updates, state, params=None, **extra_args):
        tx = optimizer_from_plan(make_plan(updates, hp))
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# lm_optimizer's keyword defaults: an LMHyperparams comes with its options, so any other value
# passed next to it is a conflict.
_DEFAULTS = {name: param.default
             for name, param in inspect.signature(lm_optimizer).parameters.items()
             if param.kind == param.KEYWORD_ONLY}
