"""The LM head's logits and the mean next-token cross-entropy, optionally without ever holding the
whole `(B, T, V)` float32 logits.

`logits` is the one place the logits are made (float32 accumulation; padding ids `>= num_valid`
floored at a finite `PADDING_LOGIT`, so never predicted and with zero gradient). With
`chunk_size = c < T`, `cross_entropy` cuts the sequence axis into chunks of `c` positions (the
batch stays whole, so a sharded batch stays sharded; a ragged end is padded with zero-weight
positions) and a `jax.custom_vjp` runs two `lax.scan`s, each holding one `(B, c, V)` chunk:

- forward: each chunk's per-token `lse` and target logit; the residuals hold nothing of size V·T;
- backward: each chunk's logits again (one more matmul than autodiff: the price of not storing
  them), `dz = (softmax(z) - onehot(y)) / N`, `dh = dz · head` and `dhead = Σ dz · h` in float32,
  as autodiff of the plain path computes them, so the two agree to accumulation order.

On a mesh, `dhead` sums over rows on different data-parallel devices: one accumulator would be a
head-sized all-reduce per chunk. With `batch_groups = G` (the batch shards) it is `(G, D, V)`,
summed once after the scan. MaxText's vocabulary tiling recomputes the logits the same way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

# The logit of a padding id: far below any real logit, yet finite, so that exp(floor - lse) is
# exactly 0 and no inf - inf appears in the softmax or its gradient.
PADDING_LOGIT = float(jnp.finfo(jnp.float32).min) / 2


def _valid_mask(num_valid: int | None, vocab_size: int) -> jax.Array | None:
    """(1, 1, V) bool, True for real tokens; None when every id is a token."""
    if num_valid is None or num_valid >= vocab_size:
        return None
    return (jnp.arange(vocab_size) < num_valid)[None, None, :]


def logits(hidden_BcD: jax.Array, head: jax.Array, *, vocab_axis: int,
           num_valid: int | None = None) -> jax.Array:
    """Float32 logits `(B, c, V)` of hidden states `(B, c, D)` against `head`, a `(D, V)` kernel
    (`vocab_axis` 1) or a tied `(V, D)` table (0), accumulated in float32; ids `>= num_valid`
    get `PADDING_LOGIT`."""
    dims = (((2,), (1 - vocab_axis,)), ((), ()))  # the head's model-width axis: 1 - vocab_axis
    z_BcV = jax.lax.dot_general(hidden_BcD, head, dims, preferred_element_type=jnp.float32)
    valid_11V = _valid_mask(num_valid, head.shape[vocab_axis])
    if valid_11V is not None:
        z_BcV = jnp.where(valid_11V, z_BcV, PADDING_LOGIT)
    return z_BcV


def _check(hidden_BTD, head, targets_BT, vocab_axis, num_valid, chunk_size, batch_groups,
           constrain_logits):
    shape = lambda x: getattr(x, "shape", type(x).__name__)
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    if not is_int(vocab_axis) or vocab_axis not in (0, 1):
        raise ValueError("vocab_axis must be 1 (a (D, V) kernel) or 0 (a tied (V, D) table), "
                         f"got {vocab_axis!r}")
    if getattr(hidden_BTD, "ndim", None) != 3:
        raise ValueError("hidden_BTD must have shape (batch, seq, d_model), got shape "
                         f"{shape(hidden_BTD)}")
    if getattr(head, "ndim", None) != 2:
        raise ValueError("head must be a matrix ((D, V) with vocab_axis=1, (V, D) with "
                         f"vocab_axis=0), got shape {shape(head)}")
    d, width = hidden_BTD.shape[-1], head.shape[1 - vocab_axis]
    if width != d:
        raise ValueError(
            f"head {head.shape} with vocab_axis={vocab_axis} has model width {width} on axis "
            f"{1 - vocab_axis}, but hidden_BTD {hidden_BTD.shape} has d_model {d}: is "
            "vocab_axis the right one?")
    for name, x in (("hidden_BTD", hidden_BTD), ("head", head)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating, got dtype {x.dtype}")
    if hidden_BTD.dtype != head.dtype:
        raise ValueError(
            f"hidden_BTD ({hidden_BTD.dtype}) and head ({head.dtype}) must share the compute "
            "dtype (cast the head's master weights to it, as the model does)")
    if getattr(targets_BT, "shape", None) != hidden_BTD.shape[:2]:
        raise ValueError(f"targets_BT must have shape {hidden_BTD.shape[:2]} (hidden_BTD's batch "
                         f"and seq), got {shape(targets_BT)}")
    if not jnp.issubdtype(targets_BT.dtype, jnp.integer):
        raise ValueError(f"targets_BT must hold integer token ids, got dtype {targets_BT.dtype}")
    vocab, B = head.shape[vocab_axis], hidden_BTD.shape[0]
    if num_valid is not None and not (is_int(num_valid) and 1 <= num_valid <= vocab):
        raise ValueError(f"num_valid must be an int in [1, V = {vocab}] or None, "
                         f"got {num_valid!r}")
    if chunk_size is not None and not (is_int(chunk_size) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if not (is_int(batch_groups) and batch_groups >= 1 and B % batch_groups == 0):
        raise ValueError(f"batch_groups must be a positive int dividing the batch B = {B}, "
                         f"got {batch_groups!r}")
    if constrain_logits is not None and not callable(constrain_logits):
        raise ValueError(f"constrain_logits must be a callable or None, got {constrain_logits!r}")


def cross_entropy(hidden_BTD: jax.Array, head: jax.Array, targets_BT: jax.Array, *,
                  vocab_axis: int, num_valid: int | None = None, chunk_size: int | None = None,
                  batch_groups: int = 1, constrain_logits=None) -> jax.Array:
    """Mean next-token cross-entropy (a float32 scalar) of `logits(hidden_BTD, head)`.
    hidden_BTD and head share the compute dtype; targets_BT are integer ids. chunk_size: None or
    `>= T`, the whole logits and plain autodiff; smaller, the chunked custom VJP (module
    docstring). batch_groups: the batch shards (dividing B), which the chunked backward reduces
    over once. constrain_logits: applied to every logits chunk and its gradient (a sharding)."""
    _check(hidden_BTD, head, targets_BT, vocab_axis, num_valid, chunk_size, batch_groups,
           constrain_logits)
    constrain = constrain_logits or (lambda z: z)
    T = hidden_BTD.shape[1]
    if chunk_size is None or chunk_size >= T:
        z_BTV = constrain(logits(hidden_BTD, head, vocab_axis=vocab_axis, num_valid=num_valid))
        return optax.softmax_cross_entropy_with_integer_labels(z_BTV, targets_BT).mean()
    return _chunked(hidden_BTD, head, targets_BT, vocab_axis, num_valid, chunk_size,
                    batch_groups, constrain)


def _chunks(x_BT, chunk_size: int):
    """`x_BT...` zero-padded along axis 1 to a multiple of `chunk_size`, and the chunk count."""
    num_chunks = math.ceil(x_BT.shape[1] / chunk_size)
    pad = num_chunks * chunk_size - x_BT.shape[1]
    if pad:
        x_BT = jnp.pad(x_BT, [(0, 0), (0, pad)] + [(0, 0)] * (x_BT.ndim - 2))
    return x_BT, num_chunks


def _chunk(x_BT, i, chunk_size: int):
    return jax.lax.dynamic_slice_in_dim(x_BT, i * chunk_size, chunk_size, axis=1)


def _unchunk(x_KBc, T: int):
    """Scan outputs `(K, B, c, ...)` -> `(B, T, ...)` (the padding positions dropped)."""
    K, B, c = x_KBc.shape[:3]
    return jnp.moveaxis(x_KBc, 0, 1).reshape(B, K * c, *x_KBc.shape[3:])[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _chunked(hidden_BTD, head, targets_BT, vocab_axis, num_valid, chunk_size, batch_groups,
             constrain):
    return _chunked_fwd(hidden_BTD, head, targets_BT, vocab_axis, num_valid, chunk_size,
                        batch_groups, constrain)[0]


def _chunked_fwd(hidden_BTD, head, targets_BT, vocab_axis, num_valid, chunk_size, batch_groups,
                 constrain):
    """Per-token `lse` and target logits, one logits chunk at a time: the same per-token values
    and the same mean as optax's loss on the whole logits."""
    del batch_groups  # the backward's
    T = hidden_BTD.shape[1]
    hidden_cut, num_chunks = _chunks(hidden_BTD, chunk_size)
    targets_cut, _ = _chunks(targets_BT, chunk_size)

    def step(carry, i):
        z_BcV = constrain(logits(_chunk(hidden_cut, i, chunk_size), head, vocab_axis=vocab_axis,
                                 num_valid=num_valid))
        t_Bc = _chunk(targets_cut, i, chunk_size)
        target_Bc = jnp.take_along_axis(z_BcV, t_Bc[..., None], axis=-1)[..., 0]
        return carry, (jax.nn.logsumexp(z_BcV, axis=-1), target_Bc)

    _, (lse_KBc, target_KBc) = jax.lax.scan(step, None, jnp.arange(num_chunks))
    lse_BT, target_BT = _unchunk(lse_KBc, T), _unchunk(target_KBc, T)
    return (lse_BT - target_BT).mean(), (hidden_BTD, head, targets_BT, lse_BT)


def _chunked_bwd(vocab_axis, num_valid, chunk_size, batch_groups, constrain, residuals, g):
    hidden_BTD, head, targets_BT, lse_BT = residuals
    B, T, _ = hidden_BTD.shape
    V, G = head.shape[vocab_axis], batch_groups
    valid_11V = _valid_mask(num_valid, V)
    hidden_BTD, num_chunks = _chunks(hidden_BTD, chunk_size)
    targets_BT, _ = _chunks(targets_BT, chunk_size)
    lse_BT, _ = _chunks(lse_BT, chunk_size)
    # Every real token's weight in the mean, times the incoming cotangent; padding positions 0.
    weight_T = jnp.where(jnp.arange(num_chunks * chunk_size) < T, g / (B * T), 0.0)
    # Contract the head's gradient over each group's rows and sequence positions; G stays.
    per_group = (((1, 2), (1, 2)), ((0,), (0,)))

    def step(dhead_acc_GDV, i):
        h_BcD = _chunk(hidden_BTD, i, chunk_size)
        z_BcV = constrain(logits(h_BcD, head, vocab_axis=vocab_axis, num_valid=num_valid))
        p_BcV = jnp.exp(z_BcV - _chunk(lse_BT, i, chunk_size)[..., None])
        onehot_BcV = jnp.arange(V)[None, None, :] == _chunk(targets_BT, i, chunk_size)[..., None]
        w_c = jax.lax.dynamic_slice_in_dim(weight_T, i * chunk_size, chunk_size)
        dz_BcV = (p_BcV - onehot_BcV) * w_c[None, :, None]
        if valid_11V is not None:  # the floor is a constant: no gradient flows into padding ids
            dz_BcV = jnp.where(valid_11V, dz_BcV, 0.0)
        dz_BcV = constrain(dz_BcV)
        # As autodiff transposes the logits matmul: the float32 cotangent times the compute-dtype
        # operand, accumulated in float32.
        dh_BcD = jax.lax.dot_general(dz_BcV, head, (((2,), (vocab_axis,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        h_GbcD = h_BcD.reshape(G, B // G, *h_BcD.shape[1:])
        dz_GbcV = dz_BcV.reshape(G, B // G, *dz_BcV.shape[1:])
        # Always (G, D, V), also for a (V, D) table: transposing the head-sized sum once at the
        # end is cheaper than a chunk-sized layout change of dz in every step.
        dhead_GDV = jax.lax.dot_general(h_GbcD, dz_GbcV, per_group,
                                        preferred_element_type=jnp.float32)
        return dhead_acc_GDV + dhead_GDV, dh_BcD.astype(h_BcD.dtype)

    D = hidden_BTD.shape[-1]
    dhead_acc_GDV, dh_KBcD = jax.lax.scan(step, jnp.zeros((G, D, V), jnp.float32),
                                          jnp.arange(num_chunks))
    # The only reduction over the batch groups (across data-parallel devices): once, here.
    dhead_DV = dhead_acc_GDV.sum(0)
    dhead = dhead_DV if vocab_axis == 1 else dhead_DV.T
    return _unchunk(dh_KBcD, T), dhead.astype(head.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
