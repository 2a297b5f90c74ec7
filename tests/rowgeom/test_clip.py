"""clip_row_diameter: the cap holds, inside updates are untouched, and it composes with optax."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rowgeom import clip_row_diameter


def np_diameter(s, axis=0):
    x = np.moveaxis(np.asarray(s, np.float64), axis, 0).reshape(np.shape(s)[axis], -1)
    return float(np.sqrt(np.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)).max())


def np_upper_bound(s, axis=0):
    x = np.moveaxis(np.asarray(s, np.float64), axis, 0).reshape(np.shape(s)[axis], -1)
    return 2 * float(np.linalg.norm(x - x.mean(axis=0), axis=1).max())


def apply(tx, updates):
    state = tx.init(updates)
    return jax.jit(tx.update)(updates, state)[0]


@pytest.mark.parametrize("exact", [False, True])
def test_cap_holds_and_direction_is_kept(rng, exact):
    s = rng.normal(size=(8, 23)) + 2.0  # (d, V) Dense layout
    cap = 0.5
    out = np.asarray(apply(clip_row_diameter(cap, vocab_axis=1, exact=exact, block_size=8),
                           jnp.asarray(s, jnp.float32)), np.float64)
    ratio = out / s
    np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-6)  # one positive scale
    assert 0 < ratio.flat[0] < 1
    if exact:
        np.testing.assert_allclose(np_diameter(out, 1), cap, rtol=1e-5)
        assert np_diameter(out, 1) <= cap * (1 + 1e-6)
    else:
        np.testing.assert_allclose(np_upper_bound(out, 1), cap, rtol=1e-5)
        assert np_diameter(out, 1) <= cap


@pytest.mark.parametrize("exact", [False, True])
def test_inside_updates_and_zero_diameter_unchanged(rng, exact):
    s = jnp.asarray(rng.normal(size=(12, 4)), jnp.float32)
    tx = clip_row_diameter(2 * np_upper_bound(s), vocab_axis=0, exact=exact)
    chex.assert_trees_all_equal(apply(tx, s), s)
    constant = jnp.tile(s[:1], (12, 1))  # D = 0: no 0/0
    chex.assert_trees_all_equal(apply(clip_row_diameter(0.1, vocab_axis=0, exact=exact),
                                      constant), constant)


def test_exact_mode_uses_the_whole_budget_where_the_bound_overshoots(rng):
    s = jnp.asarray(rng.normal(size=(30, 5)), jnp.float32)
    cap = 0.9 * np_diameter(s)
    bound_out = apply(clip_row_diameter(cap, vocab_axis=0), s)
    exact_out = apply(clip_row_diameter(cap, vocab_axis=0, exact=True), s)
    assert np_diameter(bound_out) < np_diameter(exact_out)
    np.testing.assert_allclose(np_diameter(exact_out), cap, rtol=1e-5)


def test_in_chain_with_tree_prefix_partition_and_bf16(rng):
    params = {
        "head": {"kernel": jnp.zeros((6, 40)), "bias": jnp.zeros(40)},
        "embed": jnp.zeros((40, 6), jnp.bfloat16),
        "unused": None,
    }
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10, p.dtype), params)
    clip = clip_row_diameter(0.25, vocab_axis={"head": {"kernel": 1, "bias": None},
                                               "embed": 0, "unused": None})
    tx = optax.chain(optax.scale(-1.0), clip)
    out = apply(tx, grads)
    assert out["unused"] is None
    chex.assert_trees_all_equal(out["head"]["bias"], -grads["head"]["bias"])
    assert out["embed"].dtype == jnp.bfloat16
    assert np_diameter(out["head"]["kernel"], 1) <= 0.25
    assert np_diameter(out["embed"], 0) <= 0.25 * (1 + 2**-7)  # bf16 output rounding
    # Inside optax.partition the other label's leaves arrive as MaskedNode.
    labels = {"head": {"kernel": "head", "bias": "other"}, "embed": "other", "unused": None}
    part = optax.partition({"head": clip_row_diameter(0.25, vocab_axis=1),
                            "other": optax.identity()}, labels)
    out = apply(part, grads)
    chex.assert_trees_all_close(out["head"]["kernel"],
                                apply(clip_row_diameter(0.25, vocab_axis=1),
                                      grads["head"]["kernel"]))
    chex.assert_trees_all_equal(out["embed"], grads["embed"])


def test_callable_vocab_axis_and_inject_hyperparams(rng):
    params = {"head": jnp.asarray(rng.normal(size=(20, 4)), jnp.float32),
              "bias": jnp.ones(3)}
    tx = optax.inject_hyperparams(clip_row_diameter, static_args=("vocab_axis", "block_size"))(
            max_diameter=1.0, vocab_axis=lambda p: {"head": 0, "bias": None}, exact=True)
    state = tx.init(params)
    state.hyperparams["max_diameter"] = jnp.asarray(0.5)
    out, _ = jax.jit(tx.update)(params, state)
    np.testing.assert_allclose(np_diameter(out["head"]), 0.5, rtol=1e-5)
    chex.assert_trees_all_equal(out["bias"], params["bias"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_diameter must be a finite number >= 0"):
        clip_row_diameter(-1.0, vocab_axis=0)
    with pytest.raises(TypeError, match="max_diameter must be a real scalar"):
        clip_row_diameter(jnp.ones(2), vocab_axis=0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        clip_row_diameter(1.0, vocab_axis=0, block_size=0)
    with pytest.raises(TypeError, match="exact must be a bool"):
        clip_row_diameter(1.0, vocab_axis=0, exact="yes")
    tx = clip_row_diameter(1.0, vocab_axis=0)
    with pytest.raises(ValueError, match=r"leaf \['b'\]: updates must have rank >= 2"):
        tx.update({"w": jnp.ones((3, 2)), "b": jnp.ones(3)}, tx.init(None))
    with pytest.raises(ValueError, match=r"vocab_axis names \[.x.\], which are not in the tree"):
        tx = clip_row_diameter(1.0, vocab_axis={"w": 0, "x": None})
        tx.update({"w": jnp.ones((3, 2)), "b": jnp.ones(3)}, tx.init(None))
