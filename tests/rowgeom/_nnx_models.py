"""A tiny NNX language model with the example model's parameter paths (shared test fixture),
and `unflatten`, a nested tree from ``"/"``-joined paths.

Embedding ``(V, d)``, two blocks of attention (``q_proj`` ... ``o_proj``) and a gated MLP with
RMSNorms, a final norm and an untied ``(d, V)`` head: the layout most users' models have.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

V, D, LAYERS = 64, 16, 2


def unflatten(flat: dict, leaf=lambda x: x, key=lambda part: part) -> dict:
    """A nested dict from ``{"a/b": value}``, each value passed through `leaf` and each path
    part through `key`."""
    out: dict = {}
    for path, value in flat.items():
        *parents, name = (key(part) for part in path.split("/"))
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf(value)
    return out


class _Attn(nnx.Module):
    def __init__(self, rngs):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nnx.Linear(D, D, use_bias=False, rngs=rngs))


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.attn, self.mlp = _Attn(rngs), _Mlp(rngs)
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        h = self.attn_norm(x)
        q, k, v = self.attn.q_proj(h), self.attn.k_proj(h), self.attn.v_proj(h)
        s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
        causal = np.tril(np.ones((x.shape[1], x.shape[1]), bool))[None]
        p = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
        x = x + self.attn.o_proj(jnp.einsum("bts,bsd->btd", p, v))
        h = self.mlp_norm(x)
        return x + self.mlp.down_proj(jax.nn.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class TinyLM(nnx.Module):
    """The example model's parameter paths, at test size."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([_Block(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.final_norm(x))
