"""Evaluation: the geometry of the last head update as the softmax sees it (the README's "head
diagnostics" lists every key).

Two changes: the full head change `ΔW = W_new - W_old`, decay included (`head_diameter`,
`hilbert_*`), and the head step `-lr·U` without the decay term (`head_step_*`; for projected
RowNorm `head_step_diameter <= 2·lr`). For each, the row diameter `D` (exact up to
`exact_diameter_max_elements` elements, else the O(Vd) bracket's upper end) and the Hilbert
perturbation `δ_n = range_v((ΔW·h_n)_v)` over fixed validation hidden states: RMS, max and the
tightness `max_n δ_n / (||h_n||·D)` <= 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rowgeom
from examples.lm.model import head_matrix


def _diameter(delta, *, vocab_axis, exact: bool):
    lower, upper = rowgeom.row_diameter_bounds(delta, vocab_axis=vocab_axis)
    d = rowgeom.row_diameter(delta, vocab_axis=vocab_axis) if exact else upper
    return d, lower, upper


def _change(graphdef, params, rest, head_old, head_lr, head_wd):
    """(model, vocab axis, full change, step without decay) of the update just applied, float32.
    The step adds the decay term back: `W <- (1 - lr·wd)·W - lr·U` gives `-lr·U = ΔW + lr·wd·W`."""
    model = nnx.merge(graphdef, params, rest)
    head_new, vocab_axis = head_matrix(model)
    head_old = head_old.astype(jnp.float32)
    delta = head_new.astype(jnp.float32) - head_old
    step = delta + (head_lr * head_wd) * head_old
    return model, vocab_axis, delta, step


def head_probe(graphdef, params, rest, head_old, inputs, head_lr, head_wd, *, exact: bool):
    """The diameters and Hilbert perturbations of the full change and of the step, over the final
    hidden states of `inputs` under the updated model."""
    model, vocab_axis, delta, step = _change(graphdef, params, rest, head_old, head_lr, head_wd)
    hidden = model.hidden(inputs).astype(jnp.float32)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    out = {}
    for prefix, change in (("head", delta), ("head_step", step)):
        d, lower, upper = _diameter(change, vocab_axis=vocab_axis, exact=exact)
        delta_n = rowgeom.hilbert_perturbation(change, hidden, vocab_axis=vocab_axis)
        bound = jnp.linalg.norm(hidden, axis=-1) * d
        tight = jnp.where(bound > 0, delta_n / jnp.where(bound > 0, bound, 1.0), 0.0)
        name = "hilbert" if prefix == "head" else "head_step_hilbert"
        out |= {f"{prefix}_diameter": d, f"{prefix}_diameter_lower": lower,
                f"{prefix}_diameter_upper": upper,
                f"{name}_rms": jnp.sqrt(jnp.mean(jnp.square(delta_n))),
                f"{name}_max": jnp.max(delta_n), f"{name}_tightness": jnp.max(tight)}
    return out


def step_diameter(graphdef, params, rest, head_old, head_lr, head_wd, *, exact: bool):
    """{"head_step_diameter": D} alone (no forward pass)."""
    _, vocab_axis, _, step = _change(graphdef, params, rest, head_old, head_lr, head_wd)
    return {"head_step_diameter": _diameter(step, vocab_axis=vocab_axis, exact=exact)[0]}


def head_ema(opt_state, head_shape: tuple[int, ...]):
    """`(ema, count)` of the one `optax.EmaState` moment in `opt_state` shaped like the head
    (a projected RowNorm head's EMA, `rowgeom.lm_optimizer`), else None. The same lookup serves
    an abstract state (is there one?) and a traced one (inside jit)."""
    found = []
    is_ema = lambda x: isinstance(x, optax.EmaState)
    for leaf in jax.tree.leaves(opt_state, is_leaf=is_ema):
        if is_ema(leaf):
            found += [(v, leaf.count) for v in jax.tree.leaves(leaf.ema)
                      if tuple(v.shape) == tuple(head_shape)]
    return found[0] if len(found) == 1 else None


def centring_probe(graphdef, params, rest, opt_state, head_old, head_lr, head_wd, *,
                   head_shape, momentum: float, debias: bool, eps: float, exact: bool) -> dict:
    """How far projected RowNorm's step of the update just applied (`-step / head_lr`,
    real-token rows) is from the uncentred one of arXiv 2608.22253's code: each (debiased) row
    of the head's EMA (`head_ema`, all rows) divided by its norm + eps."""
    _, vocab_axis, _, step = _change(graphdef, params, rest, head_old, head_lr, head_wd)
    ema, count = head_ema(opt_state, head_shape)
    num = step.shape[vocab_axis]
    b = jax.lax.slice_in_dim(ema.astype(jnp.float32), 0, num, axis=vocab_axis)
    if debias:  # optax.ema(debias=True): divide by 1 - momentum^count
        b = b / (1.0 - momentum ** count.astype(jnp.float32))
    feature_axes = tuple(a for a in range(b.ndim) if a != vocab_axis)
    norms = jnp.sqrt(jnp.sum(b * b, axis=feature_axes, keepdims=True))
    uncentred = b / (norms + eps)
    ours = -step.astype(jnp.float32) / head_lr
    ratio = jnp.linalg.norm(ours - uncentred) / jnp.linalg.norm(ours)
    mean_row = jnp.linalg.norm(jnp.mean(b, axis=vocab_axis))
    rms_row = jnp.sqrt(jnp.mean(jnp.sum(b * b, axis=feature_axes)))
    d = _diameter(head_lr * uncentred, vocab_axis=vocab_axis, exact=exact)[0]
    return {"centring_ratio": ratio, "ema_mean_row_ratio": mean_row / rms_row,
            "uncentred_step_diameter": d}


def tracked_head_stats(opt_state) -> dict:
    """rowgeom's O(Vd) RowDiameterStats of the last head step (max over head leaves) as
    `tracked_lower`, `tracked_upper` and `tracked_row_sum_residual`; empty without a head group
    (a tied table) or when the tracker did not measure the last step."""
    stats = rowgeom.read_row_diameter(opt_state)
    host = lambda x: float(np.asarray(jax.device_get(x)))
    fresh = [host(m) == host(c) for m, c in zip(jax.tree.leaves(stats.measured_at),
                                                jax.tree.leaves(stats.count), strict=True)]
    if not all(fresh):  # measured on an earlier step (track_every_k_steps): not this step's
        return {}
    out = {}
    for field in ("lower", "upper", "row_sum_residual"):
        leaves = jax.tree.leaves(getattr(stats, field))
        if leaves:
            out[f"tracked_{field}"] = max(host(v) for v in leaves)
    return out
