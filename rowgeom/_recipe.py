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

Why these defaults follow from one learning rate ``lr``:

- Muon's step is scaled to RMS ``0.2`` (``scale="rms"``: ``0.2·sqrt(max(m, n))`` times the polar
  factor), the typical RMS of an AdamW step, so Muon and AdamW groups share ``lr`` (Liu et al.,
  "Muon is Scalable for LLM Training", arXiv 2502.16982).
- The RowNorm head moves every token row by ``r = head_lr`` (``D(step) <= 2·head_lr``, spec §5),
  so its per-entry RMS is ``head_lr/sqrt(d)``. ``head_lr = 5·lr`` (`ROWNORM_HEAD_LR_MULTIPLIER`)
  is the ratio of the head learning rates Lau & Su (arXiv 2605.18106) report: RowNorm head
  2.5e-3..5e-3 against an AdamW head 5e-4..1e-3. It is also the RMS match:
  ``5/sqrt(d) ≈ 0.2`` at ``d ≈ 625``. Heads much narrower or wider may want
  ``head_learning_rate`` set directly.
- The head momentum is an EMA ``M = β M + (1-β) G`` in float32, without Nesterov, before the
  normalisation, exactly the reference step of spec §5 and Lau & Su's ``RowNormM``. Hidden
  momentum is ``optax.trace`` (``M = β M + G``) with Nesterov as in Muon; the two forms differ
  by the factor ``1/(1-β)``, which the normalisation after them removes (up to eps).
- The head momentum and step stay float32 whatever the parameter dtype (spec §6: means and
  norms never in bf16); ``optax.apply_updates`` casts the step to the parameter's dtype.
- Weight decay 0.1 for the matrices (hidden, head, embedding), 0 for vectors. The head's decay per
  step is ``head_lr·wd``, and `track_row_diameter` sits at the very end of the head chain so it
  measures the step the softmax sees, weight decay included (spec §6).

The head's vocabulary axis is ``head_vocab_axis`` if given, else inferred from the parameter's
name: ``kernel`` (Flax ``Linear``/``Dense``, ``(d, V)``) → 1; ``embedding`` (a tied ``Embed``
table, ``(V, d)``) or ``weight`` (PyTorch layout, ``(V, d)``) → 0; anything else raises.
With ``tied="head"`` the tied table is trained by RowNorm *without* centring (spec §6: the
shift is no symmetry of an input embedding and its gradient is not zero-sum).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import optax

from rowgeom._diagnostics import track_row_diameter
from rowgeom._labels import leaf_shape, make_labeler, map_with_paths, partition_by_label
from rowgeom._muon import muon_orthogonalize
from rowgeom._rownorm import projected_rownorm

ROWNORM_HEAD_LR_MULTIPLIER = 5.0
HEADS = ("rownorm", "adamw", "muon")
DEFAULT_NS_STEPS = 5
STATIC_ARGS = ("ns_steps", "ns_coeffs", "head_vocab_axis", "labels", "muon_dimension_numbers")
"""For ``optax.inject_hyperparams(lm_optimizer, static_args=STATIC_ARGS)``: needed only when
one of these is passed explicitly as a number, an array or a callable (their defaults are
never injected)."""

_VOCAB_AXIS_BY_NAME = {"kernel": 1, "embedding": 0, "weight": 0}
_INJECT_HINT = ("under optax.inject_hyperparams list it in static_args "
                "(rowgeom._recipe.STATIC_ARGS)")


def infer_head_vocab_axis(path: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """The vocabulary axis of a rank-2 head parameter from its name (see module docstring)."""
    name = path[-1].lower() if path else ""
    if name in _VOCAB_AXIS_BY_NAME and len(shape) == 2:
        return _VOCAB_AXIS_BY_NAME[name]
    raise ValueError(
        f"cannot infer the vocabulary axis of head parameter {'/'.join(path) or '<root>'!r} "
        f"(shape {tuple(shape)}): only rank-2 leaves named 'kernel' ((d, V) -> 1), 'embedding' "
        "or 'weight' ((V, d) -> 0) are recognised. Pass head_vocab_axis=<int>")


def _head_vocab_axes(head_vocab_axis: int | None):
    """`vocab_axis` for the head transforms: tree -> tree of ints (head leaves) / None."""
    masked = lambda x: x is None or isinstance(x, optax.MaskedNode)

    def axis(path, leaf):
        if masked(leaf):
            return None  # not a head parameter: the partition masked it out
        if head_vocab_axis is not None:
            return head_vocab_axis
        return infer_head_vocab_axis(path, leaf_shape(leaf))

    return lambda tree: map_with_paths(axis, tree, is_leaf=masked)


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


def lm_optimizer(
    learning_rate,
    *,
    head: str = "rownorm",
    labels=None,
    tied: str | None = None,
    hidden_learning_rate=None,
    head_learning_rate=None,
    embedding_learning_rate=None,
    vector_learning_rate=None,
    weight_decay=0.1,
    hidden_weight_decay=None,
    head_weight_decay=None,
    embedding_weight_decay=None,
    vector_weight_decay=0.0,
    momentum=0.95,
    nesterov: bool = True,
    head_momentum=0.95,
    adam_b1=0.9,
    adam_b2=0.95,
    adam_eps=1e-8,
    ns_steps: int | None = None,
    ns_coeffs="keller",
    muon_scale: str | None = "rms",
    muon_dimension_numbers=None,
    head_vocab_axis: int | None = None,
    head_rescale: str | None = None,
    track_head: bool = True,
) -> optax.GradientTransformation:
    """Muon for hidden matrices, projected RowNorm (or AdamW / Muon) for the head, AdamW else.

    Args:
      learning_rate: float or schedule; every group's default derives from it (module docstring):
        hidden, embedding, vector and an AdamW or Muon head use it as is, a RowNorm head
        ``ROWNORM_HEAD_LR_MULTIPLIER`` (5) times it. Derived rates of a schedule are schedules.
      head: ``"rownorm"`` (projected RowNorm, arXiv 2608.22253), ``"adamw"`` or ``"muon"``.
      labels: None (``rowgeom.label_params`` defaults with `tied`), a tree of labels or a
        callable ``params -> labels`` (see `rowgeom.partition_by_label`); labels must be in
        ``rowgeom.LABELS``.
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
      muon_dimension_numbers: ``dimension_numbers`` of the hidden group's Muon (e.g. for
        stacked ``(L, in, out)`` layers); a Muon head is always a single matrix.
      head_vocab_axis: int vocabulary axis of every head leaf; None infers it from the name.
      head_rescale: ``None``, ``"exact"`` or ``"bound"``: ``projected_rownorm``'s ``rescale`` for
        a RowNorm head (spec §4, "Beyond the paper"): ``"exact"`` multiplies the direction by
        ``2/D(S*)`` so that the step (before weight decay) has ``D = 2·head_lr`` exactly, the
        whole diameter budget (``O(V²d)`` per step); ``"bound"`` uses the ``O(Vd)`` upper bound.
        Only valid with ``head="rownorm"``.
      track_head: record ``RowDiameterStats`` of the full head step (``read_row_diameter``).

    Returns:
      The ``optax.partition`` transformation over ``"hidden"``, ``"head"``, ``"embedding"``
      and ``"vector"``.

    Works under ``optax.inject_hyperparams(lm_optimizer)(learning_rate=...)``: float arguments
    become (possibly traced) arrays and nothing here branches on their values. Integers, arrays
    of coefficients and callables other than schedules must then be listed in ``static_args``
    (`STATIC_ARGS`) when passed explicitly, or they would be injected.

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
      >>> bool(stats.lower["lm_head"]["kernel"] <= 2 * 5e-3 * (1 + 1e-5))  # D <= 2 head_lr
      True
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if tied not in (None, "embedding", "head"):
        raise ValueError(f"tied must be None, 'embedding' or 'head', got {tied!r}")
    if head_rescale is not None and head != "rownorm":
        raise ValueError(f"head_rescale applies to head='rownorm' only, got head={head!r} with "
                         f"head_rescale={head_rescale!r}")
    ns_steps = _static_int(_or(ns_steps, DEFAULT_NS_STEPS), "ns_steps")
    if head_vocab_axis is not None:
        head_vocab_axis = _static_int(head_vocab_axis, "head_vocab_axis")
    if isinstance(ns_coeffs, jax.Array):
        raise TypeError(f"ns_coeffs must be a preset name, a tuple or a numpy table, got a "
                        f"jax array; {_INJECT_HINT}")
    if labels is None:
        labels = make_labeler(tied=tied)
    elif isinstance(labels, (str, jax.Array)):
        # A callable `labels` passed to inject_hyperparams arrives here evaluated as a schedule.
        raise TypeError(f"labels must be None, a tree of labels or a callable, got {labels!r}; "
                        f"{_INJECT_HINT}")

    hidden_lr = _or(hidden_learning_rate, learning_rate)
    head_factor = ROWNORM_HEAD_LR_MULTIPLIER if head == "rownorm" else 1.0
    head_lr = _or(head_learning_rate, _scaled(learning_rate, head_factor))
    embedding_lr = _or(embedding_learning_rate, learning_rate)
    vector_lr = _or(vector_learning_rate, learning_rate)
    hidden_wd = _or(hidden_weight_decay, weight_decay)
    head_wd = _or(head_weight_decay, weight_decay)
    embedding_wd = _or(embedding_weight_decay, weight_decay)

    muon = dict(ns_steps=ns_steps, ns_coeffs=ns_coeffs, scale=muon_scale)
    adam = dict(b1=adam_b1, b2=adam_b2, eps=adam_eps)
    vocab_axes = _head_vocab_axes(head_vocab_axis)

    if head == "rownorm":
        center = tied != "head"  # spec §6: no centring for a tied table
        head_tx = [
            optax.ema(decay=head_momentum, debias=False, accumulator_dtype=jnp.float32),
            projected_rownorm(vocab_axis=vocab_axes, center_input=center, center_output=center,
                              rescale=head_rescale),
            optax.add_decayed_weights(head_wd),
            optax.scale_by_learning_rate(head_lr),
        ]
    elif head == "adamw":
        head_tx = [optax.adamw(head_lr, weight_decay=head_wd, **adam)]
    else:
        head_tx = [_muon_chain(head_lr, head_wd, momentum=head_momentum, nesterov=nesterov,
                               dimension_numbers=None, **muon)]
    if track_head:
        # Last, so it sees -lr·(U + wd·W): the step the softmax sees (spec §6).
        head_tx.append(track_row_diameter(vocab_axis=vocab_axes))

    transforms = {
        "hidden": _muon_chain(hidden_lr, hidden_wd, momentum=momentum, nesterov=nesterov,
                              dimension_numbers=muon_dimension_numbers, **muon),
        "head": optax.chain(*head_tx),
        "embedding": optax.adamw(embedding_lr, weight_decay=embedding_wd, **adam),
        "vector": optax.adamw(vector_lr, weight_decay=vector_weight_decay, **adam),
    }
    return partition_by_label(transforms, labels)
