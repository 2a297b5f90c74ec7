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
    """`tx`'s first update of `updates` from its init (traced: call it inside a jitted
    function, one compile for all a test applies; eagerly every operation compiles)."""
    return tx.update(updates, tx.init(updates))[0]


@pytest.mark.parametrize("exact", [False, True])
def test_cap_holds_and_direction_is_kept(rng, exact):
    s = rng.normal(size=(8, 23)) + 2.0  # (d, V) Dense layout
    cap = 0.5
    tx = clip_row_diameter(cap, vocab_axis=1, exact=exact, block_size=8)
    out = np.asarray(jax.jit(lambda s: apply(tx, s))(s.astype(np.float32)), np.float64)
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
    s = rng.normal(size=(12, 4)).astype(np.float32)  # host arrays: no conversion compile
    tx = clip_row_diameter(2 * np_upper_bound(s), vocab_axis=0, exact=exact)
    constant = np.tile(s[:1], (12, 1))  # D = 0: no 0/0
    zero = clip_row_diameter(0.1, vocab_axis=0, exact=exact)
    inside, flat = jax.jit(lambda s, c: (apply(tx, s), apply(zero, c)))(s, constant)  # 1 compile
    chex.assert_trees_all_equal(inside, s)
    chex.assert_trees_all_equal(flat, constant)


def test_exact_mode_uses_the_whole_budget_where_the_bound_overshoots(rng):
    s = rng.normal(size=(30, 5)).astype(np.float32)
    cap = 0.9 * np_diameter(s)
    by_bound, by_exact = (clip_row_diameter(cap, vocab_axis=0, exact=exact)
                          for exact in (False, True))
    bound_out, exact_out = jax.jit(lambda s: (apply(by_bound, s), apply(by_exact, s)))(s)
    assert np_diameter(bound_out) < np_diameter(exact_out)
    np.testing.assert_allclose(np_diameter(exact_out), cap, rtol=1e-5)


def test_in_chain_with_tree_prefix_partition_and_bf16(rng):
    params = {  # host arrays (bf16 through ml_dtypes): no compile per shape and dtype
        "head": {"kernel": np.zeros((6, 40), np.float32), "bias": np.zeros(40, np.float32)},
        "embed": np.zeros((40, 6), jnp.bfloat16),
        "unused": None,
    }
    grads = jax.tree.map(lambda p: (rng.normal(size=p.shape) * 10).astype(p.dtype), params)
    clip = clip_row_diameter(0.25, vocab_axis={"head": {"kernel": 1, "bias": None},
                                               "embed": 0, "unused": None})
    tx = optax.chain(optax.scale(-1.0), clip)
    # Inside optax.partition the other label's leaves arrive as MaskedNode.
    labels = {"head": {"kernel": "head", "bias": "other"}, "embed": "other", "unused": None}
    part = optax.partition({"head": clip_row_diameter(0.25, vocab_axis=1),
                            "other": optax.identity()}, labels)
    alone = clip_row_diameter(0.25, vocab_axis=1)
    out, parted, kernel = jax.jit(lambda g: (  # the three transforms: one compile
        apply(tx, g), apply(part, g), apply(alone, g["head"]["kernel"])))(grads)
    assert out["unused"] is None
    chex.assert_trees_all_equal(out["head"]["bias"], -grads["head"]["bias"])
    assert out["embed"].dtype == jnp.bfloat16
    assert np_diameter(out["head"]["kernel"], 1) <= 0.25
    assert np_diameter(out["embed"], 0) <= 0.25 * (1 + 2**-7)  # bf16 output rounding
    chex.assert_trees_all_close(parted["head"]["kernel"], kernel)
    chex.assert_trees_all_equal(parted["embed"], grads["embed"])


def test_callable_vocab_axis_and_inject_hyperparams(rng):
    params = {"head": rng.normal(size=(20, 4)).astype(np.float32), "bias": np.ones(3, np.float32)}
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
        clip_row_diameter(np.ones(2, np.float32), vocab_axis=0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        clip_row_diameter(1.0, vocab_axis=0, block_size=0)
    with pytest.raises(TypeError, match="exact must be a bool"):
        clip_row_diameter(1.0, vocab_axis=0, exact="yes")
    tx = clip_row_diameter(1.0, vocab_axis=0)
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731  (host arrays: no compile)
    with pytest.raises(ValueError, match=r"leaf \['b'\]: updates must have rank >= 2"):
        tx.update({"w": ones(3, 2), "b": ones(3)}, tx.init(None))
    with pytest.raises(ValueError, match=r"vocab_axis names \[.x.\], which are not in the tree"):
        tx = clip_row_diameter(1.0, vocab_axis={"w": 0, "x": None})
        tx.update({"w": ones(3, 2), "b": ones(3)}, tx.init(None))
