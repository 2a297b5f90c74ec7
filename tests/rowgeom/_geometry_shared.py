"""Programs and trees shared by several test modules, so that a process running them compiles
each once (the suite is compile-bound: CONTRIBUTING.md).

- `tracker_hlo`: the compiled HLO of the row-diameter tracker's measured step on one head
  (test_diagnostics.py and test_tracker_passes.py count its passes over the update).
- `tinylm_params` / `tinylm_model`: the test model's parameters with values drawn on the host,
  and a model holding them: no initializer runs, so nothing compiles (``nnx.jit`` of the model's
  initializers is a program of its own, and eagerly every initializer's operations compile).
- `SMALL_LM_PATHS`, `small_lm_tree`, `SmallLM` and `shared_lm_optimizer`: the small LM tree
  the lm_optimizer tests step, as plain trees and as an NNX model of one tree structure, and one
  `lm_optimizer` per options whose jitted update those tests share.

Import this module as ``_geometry_shared`` (the test directory is on ``sys.path``), never by
another name: a second module object would hold a second cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _nnx_models import TinyLM, V, unflatten
from flax import nnx

import rowgeom


def differs_on_cpu(shape, axis) -> bool:
    """Whether the bracket's CPU formulation traces another program than the masked one for an
    input of `shape` with tokens along `axis`: only for a leading feature axis of more than one
    row (`rowgeom._geometry._sq_dists`)."""
    return int(np.prod(shape[:axis % len(shape)])) > 1


def _tracker(shape, axis, impl):
    tx = rowgeom.track_row_diameter(vocab_axis=axis, impl=impl)
    return jax.jit(lambda u: tx.update(u, tx.init(u))[1])  # the stats; the update passes through


def tracker_hlo(shape: tuple[int, ...], axis: int, impl: str) -> str:
    """Optimized HLO of the tracker's measured step (`track_row_diameter(vocab_axis=axis,
    impl=impl)`, its state from ``init``) on a float32 update of `shape`. The "cpu" formulation
    traces the masked one's very program unless the tokens have a leading feature axis (checked
    here on the jaxprs, which compiles nothing): then both read one compile."""
    if impl == "cpu" and not differs_on_cpu(shape, axis):
        spec = jax.ShapeDtypeStruct(shape, jnp.float32)
        jaxprs = {i: str(jax.make_jaxpr(_tracker(shape, axis, i))(spec)) for i in ("cpu", "xla")}
        assert jaxprs["cpu"] == jaxprs["xla"], (shape, axis)
        impl = "xla"
    return _tracker_hlo(tuple(shape), axis, impl)


@functools.cache
def _tracker_hlo(shape, axis, impl):
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    return _tracker(shape, axis, impl).lower(spec).compile().as_text()


@functools.cache
def _tinylm_values(seed: int) -> dict:
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: TinyLM(nnx.Rngs(seed))),
                                          nnx.Param))
    rng = np.random.default_rng(seed)

    def draw(x):  # norm scales start at one, matrices as lecun_normal / nnx.Embed draw them
        if len(x.shape) == 1:
            return np.ones(x.shape, np.float32)
        scale = 1.0 if x.shape[0] == V else 1.0 / np.sqrt(x.shape[0])
        return (rng.standard_normal(x.shape) * scale).astype(np.float32)

    return jax.tree.map(draw, abstract)


def tinylm_params(seed: int = 0) -> dict:
    """`TinyLM`'s parameters as a plain dict (its `nnx.to_pure_dict` layout) of float32 device
    arrays, drawn on the host from `seed` (placed with `jax.device_put`: no compile)."""
    return jax.device_put(_tinylm_values(seed))


def tinylm_model(seed: int = 0) -> TinyLM:
    """A `TinyLM` holding `tinylm_params(seed)`, built without running its initializers."""
    model = nnx.eval_shape(lambda: TinyLM(nnx.Rngs(seed)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, tinylm_params(seed))
    nnx.update(model, state)
    return model


# --- the small LM tree the lm_optimizer tests step --------------------------------------------

# An embedding, one block (an attention and an MLP kernel, a norm), a final norm and an untied
# (d, V) head: every group of the recipe at the least size (TinyLM's update compiles ~1.7x
# longer). test_recipe_defaults.py's tree; test_recipe.py and test_options_plan.py step it too.
SMALL_V, SMALL_D, SMALL_FF = 32, 8, 16
SMALL_LM_PATHS = {
    "embed/embedding": (SMALL_V, SMALL_D),
    "layers/0/attn/q_proj/kernel": (SMALL_D, SMALL_D),
    "layers/0/mlp/up_proj/kernel": (SMALL_D, SMALL_FF),
    "layers/0/mlp_norm/scale": (SMALL_D,),
    "final_norm/scale": (SMALL_D,),
    "lm_head/kernel": (SMALL_D, SMALL_V),
}


def small_lm_tree(values: dict) -> dict:
    """The nested dict of float32 device arrays from ``{"a/b": array}`` (converted on the host
    and placed: no compile), in `nnx.to_pure_dict`'s layout (a layer index is an int key), so
    that a plain tree and `SmallLM`'s pure dict have one tree structure and share programs."""
    return unflatten(values, lambda value: jax.device_put(np.asarray(value, np.float32)),
                     key=lambda part: int(part) if part.isdigit() else part)


def small_lm_values(seed: int, scale: float = 1.0) -> dict:
    """``{path: float64 array}`` of SMALL_LM_PATHS' shapes, standard normal times `scale`."""
    rng = np.random.default_rng(seed)
    return {p: scale * rng.standard_normal(shape) for p, shape in SMALL_LM_PATHS.items()}


class _SmallBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.Module()
        self.attn.q_proj = nnx.Linear(SMALL_D, SMALL_D, use_bias=False, rngs=rngs)
        self.mlp = nnx.Module()
        self.mlp.up_proj = nnx.Linear(SMALL_D, SMALL_FF, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(SMALL_D, rngs=rngs)


class SmallLM(nnx.Module):
    """An NNX model whose parameters are SMALL_LM_PATHS (no forward pass: a parameter tree)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(SMALL_V, SMALL_D, rngs=rngs)
        self.layers = nnx.List([_SmallBlock(rngs)])
        self.final_norm = nnx.RMSNorm(SMALL_D, rngs=rngs)
        self.lm_head = nnx.Linear(SMALL_D, SMALL_V, use_bias=False, rngs=rngs)


def small_lm_model(values: dict) -> SmallLM:
    """A `SmallLM` holding `small_lm_tree(values)`, built without running its initializers."""
    model = nnx.eval_shape(lambda: SmallLM(nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, small_lm_tree(values))
    nnx.update(model, state)
    return model


@functools.cache
def shared_lm_optimizer(learning_rate: float, head: str | None = None):
    """`rowgeom.lm_optimizer(learning_rate)` (with ``head=head`` when given) and every other
    option at its default, one object per call for the process: ``jax.jit(tx.update)`` of the
    same transform shares its compiles (jit caches by function), so the tests that step the
    small LM tree with it compile each update once (test_recipe.py, test_recipe_defaults.py,
    test_options_plan.py's nnx reference, test_diagnostics.py's NaN test)."""
    if head is None:
        return rowgeom.lm_optimizer(learning_rate)
    return rowgeom.lm_optimizer(learning_rate, head=head)
