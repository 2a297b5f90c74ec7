"""The public transforms the battery (test_transform_battery.py) runs, and their inputs.

One entry per public ``GradientTransformation`` configuration, in the spirit of optax's
``contrib/_common_test.py``. Shared with the 8-device tests (`sharded`), so this
module only builds trees and transforms; it never sets up devices. Public API only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rowgeom

# V is deliberately not divisible by 8 (a real vocabulary rarely is); VPAD is V padded to a
# multiple of 8 with `num_valid=V`, the usual way a vocabulary is sharded.
V, VPAD, D, HIDDEN = 100, 104, 16, 64


@dataclasses.dataclass(frozen=True)
class Case:
    """One public transform configuration.

    make(**kwargs) builds it (so it can be wrapped by ``optax.inject_hyperparams``);
    ``static_args`` are the arguments that must stay static under ``inject_hyperparams``;
    ``inject`` is ``(name, other_value, factor)``: setting that numeric hyperparameter in the
    injected state multiplies the next update by ``factor`` (None: nothing to inject);
    ``tree`` names the parameter tree it acts on.
    """

    name: str
    make: Callable[..., optax.GradientTransformation]
    kwargs: dict[str, Any]
    tree: str  # "head" (D, V) kernel, "padded" (D, VPAD) kernel, "hidden" matrix, "lm" model
    static_args: tuple[str, ...] = ()
    inject: tuple[str, float, float] | None = None

    def build(self, **overrides) -> optax.GradientTransformation:
        return self.make(**{**self.kwargs, **overrides})


_ROWNORM_STATIC = ("vocab_axis", "eps", "num_valid", "rescale")
# lm_optimizer's options are objects and strings, never injected; only `labels` (a callable)
# must be named, which rowgeom.STATIC_ARGS does.
_LM_STATIC = rowgeom.STATIC_ARGS


CASES = [
    Case("projected_rownorm", rowgeom.projected_rownorm, dict(vocab_axis=1), "head",
         _ROWNORM_STATIC),
    Case("projected_rownorm_num_valid", rowgeom.projected_rownorm,
         dict(vocab_axis=1, num_valid=V), "padded", _ROWNORM_STATIC),
    Case("projected_rownorm_exact", rowgeom.projected_rownorm,
         dict(vocab_axis=1, rescale="exact"), "head", _ROWNORM_STATIC),
    Case("projected_rownorm_bound", rowgeom.projected_rownorm,
         dict(vocab_axis=1, rescale="bound", num_valid=V), "padded", _ROWNORM_STATIC),
    # The test gradients' diameters are far above 0.5: the clip is active, halving the cap
    # halves the step.
    Case("clip_row_diameter", rowgeom.clip_row_diameter, dict(max_diameter=0.5, vocab_axis=1),
         "head", ("vocab_axis", "exact", "block_size"), ("max_diameter", 0.25, 0.5)),
    Case("clip_row_diameter_exact", rowgeom.clip_row_diameter,
         dict(max_diameter=0.5, vocab_axis=1, exact=True, block_size=32), "head",
         ("vocab_axis", "exact", "block_size"), ("max_diameter", 0.25, 0.5)),
    Case("track_row_diameter", rowgeom.track_row_diameter, dict(vocab_axis=1), "head",
         ("vocab_axis",)),
    Case("muon_orthogonalize", rowgeom.muon_orthogonalize, dict(), "hidden",
         ("ns_steps", "ns_coeffs", "compute_dtype", "scale", "dimension_numbers"),
         ("rms_scale", 0.1, 0.5)),
    # Every group's step (decoupled decay included) is linear in the learning rate, and no
    # state depends on it: tripling it triples the next update.
    *(Case(f"lm_optimizer_{head}", rowgeom.lm_optimizer, dict(learning_rate=1e-2, head=head),
           "lm", _LM_STATIC, ("learning_rate", 3e-2, 3.0))
      for head in ("rownorm", "adamw", "muon")),
]
CASE_NAMES = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}


def lm_params(dtype=jnp.float32, vocab: int = V) -> dict:
    """A language model's parameter tree in Flax's naming (Dense kernels (d, V)). Drawn with
    numpy, converted on the host and put on the device: eager jax.random ops, and jnp.asarray,
    would each compile per shape and dtype."""
    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)  # (bfloat16 through ml_dtypes) converted on the host
    draw = lambda shape, scale=1.0: jax.device_put(
        (rng.standard_normal(shape) * scale).astype(dtype))
    return {
        "embed": {"embedding": draw((vocab, D))},
        "layers": {0: {"mlp": {"up": {"kernel": draw((D, HIDDEN), 0.25)}}}},
        "norm": {"scale": jax.device_put(np.ones((D,), dtype))},
        "lm_head": {"kernel": draw((D, vocab), 0.25)},
    }


def params_for(case: Case, dtype=jnp.float32) -> dict:
    lm = lm_params(dtype, VPAD if case.tree == "padded" else V)
    if case.tree == "lm":
        return lm
    if case.tree == "hidden":
        return {"layers": lm["layers"]}
    return {"lm_head": lm["lm_head"]}


@functools.cache
def _noise(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows that are not zero-sum and of unequal size: a real head gradient is neither.
    g = rng.standard_normal(shape) * rng.uniform(0.2, 3.0, size=shape[-1:]) + 0.3
    return g.astype(np.float32)


def grads_for(params, seed: int = 0):
    """A deterministic gradient tree with the params' structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [  # put, not jnp.asarray: no compile per shape
        jax.device_put(_noise(p.shape, seed + i).astype(p.dtype)) for i, p in enumerate(leaves)])


def step(tx: optax.GradientTransformation, traces: list | None = None):
    """``jit((grads, state, params) -> (updates, state))``; appends to `traces` per trace."""
    def update(g, s, p):
        if traces is not None:
            traces.append(1)
        return tx.update(g, s, p)

    return jax.jit(update)
