"""Interim plain cross entropy (to be replaced by the chunked implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def logits(hidden_BTD, head, *, vocab_axis: int, num_valid: int | None = None):
    spec = "btd,dv->btv" if vocab_axis == 1 else "btd,vd->btv"
    out = jnp.einsum(spec, hidden_BTD, head, preferred_element_type=jnp.float32)
    if num_valid is not None:
        valid_V = jnp.arange(out.shape[-1]) < num_valid
        out = jnp.where(valid_V, out, jnp.finfo(jnp.float32).min / 2)
    return out


def cross_entropy(hidden_BTD, head, targets_BT, *, vocab_axis: int, num_valid=None,
                  chunk_size=None, constrain_logits=None) -> jax.Array:
    z = logits(hidden_BTD, head, vocab_axis=vocab_axis, num_valid=num_valid)
    if constrain_logits is not None:
        z = constrain_logits(z)
    return optax.softmax_cross_entropy_with_integer_labels(z, targets_BT).mean()
