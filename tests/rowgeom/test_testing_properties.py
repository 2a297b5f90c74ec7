"""rowgeom's own head transforms, property-tested with rowgeom.testing the way users will.

Strategies from `rowgeom.testing.strategies` draw the inputs (cross-entropy head gradients with
Zipf targets, adversarial token rows; both layouts, float32/bfloat16, padded vocabularies);
`rowgeom.testing` assertions check the properties; `chex.variants` runs each transform with and
without `jax.jit` and on device. Every assertion is checked against an independent float64
numpy measurement in tests/rowgeom/test_testing.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import Phase, assume, find, given, settings

import rowgeom
import rowgeom.testing as rt
from rowgeom.testing import strategies

# One shape, two layouts, two dtypes, two paddings: each combination is an XLA compile per
# variant (`num_valid` is static), and compiles dominate the run time.
SHAPES = dict(vocab_sizes=(12,), feature_sizes=(8,), padded=(0, 3))
# The `ci` profile's 20 examples per property would be mostly compiles here; 6 keep the file
# within its time budget. A larger profile (HYPOTHESIS_PROFILE=thorough) runs its full count.
EXAMPLES = 6 if settings.default.max_examples <= 20 else settings.default.max_examples


def _rownorm(u, *, vocab_axis, num_valid):
    return rowgeom.rownorm_direction(u, vocab_axis=vocab_axis, num_valid=num_valid)


def _clip(u, *, vocab_axis, max_diameter):
    tx = rowgeom.clip_row_diameter(max_diameter, vocab_axis=vocab_axis)
    return tx.update({"head": u}, tx.init({"head": u}))[0]["head"]


def _rounding(dtype) -> float:
    """Relative error of one rounding of a float32 result to `dtype` (0 for float32)."""
    return 0.0 if jnp.dtype(dtype) == jnp.float32 else float(jnp.finfo(dtype).eps)


def _check_rownorm_step(step, ex):
    """The properties of projected RowNorm's step (radius 1) on one example."""
    assert step.shape == ex.update.shape and step.dtype == ex.update.dtype
    # On the host: eager jnp checks and transposes would compile per shape and dtype.
    assert np.all(np.isfinite(np.asarray(step, np.float32))), ex.kind
    slack = 1e-5 + _rounding(step.dtype)
    rt.assert_row_diameter_at_most(step, 2.0, vocab_axis=ex.vocab_axis, rtol=slack)
    rt.assert_rows_zero_sum(step, vocab_axis=ex.vocab_axis, num_valid=ex.num_valid)
    # hilbert_perturbation takes (V, d) or (d, V)
    head = step if ex.vocab_axis == 0 else jax.device_put(np.asarray(step).T)
    rt.assert_hilbert_perturbation_at_most(head, ex.hidden, 2.0, vocab_axis=0, rtol=slack)


class ProjectedRowNormProperties(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True, with_device=True)
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(ex=strategies.lm_head_gradients(**SHAPES))
    def test_cross_entropy_gradients(self, ex):
        fn = self.variant(_rownorm, static_argnames=("vocab_axis", "num_valid"))
        _check_rownorm_step(fn(ex.update, vocab_axis=ex.vocab_axis, num_valid=ex.num_valid), ex)

    @chex.variants(with_jit=True, without_jit=True, with_device=True)
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(ex=strategies.token_row_patterns(**SHAPES))
    def test_adversarial_rows(self, ex):
        fn = self.variant(_rownorm, static_argnames=("vocab_axis", "num_valid"))
        _check_rownorm_step(fn(ex.update, vocab_axis=ex.vocab_axis, num_valid=ex.num_valid), ex)


class ClipRowDiameterProperties(chex.TestCase):

    @chex.variants(with_jit=True)
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(ex=strategies.token_row_patterns(**{**SHAPES, "padded": False},
                                            dtypes=("float32",)))
    def test_clipped_update_is_within_the_cap(self, ex):
        cap = 0.5
        fn = self.variant(_clip, static_argnames=("vocab_axis",))
        clipped = fn(ex.update, vocab_axis=ex.vocab_axis, max_diameter=cap)
        # The O(Vd) bracket (exact only where it cannot decide), as at a real vocabulary.
        rt.assert_row_diameter_at_most(clipped, cap, vocab_axis=ex.vocab_axis, exact_max_vocab=1)


@settings(max_examples=EXAMPLES, deadline=None)
@given(ex=strategies.lm_head_gradients(**{**SHAPES, "padded": False}, dtypes=("float32",)))
def test_cross_entropy_gradients_are_in_the_gauge(ex):
    # Softmax minus one-hot sums to zero over the vocabulary, hence so do the gradient rows.
    rt.assert_rows_zero_sum(ex.update, vocab_axis=ex.vocab_axis)
    assert ex.update.shape[ex.vocab_axis] in SHAPES["vocab_sizes"]
    assert ex.hidden.shape[-1] == ex.update.shape[1 - ex.vocab_axis]


@settings(max_examples=EXAMPLES, deadline=None)
@given(ex=strategies.token_row_patterns(**SHAPES, dtypes=("float32",)))
def test_assert_row_diameter_agrees_with_float64_brute_force(ex):
    rows = np.moveaxis(np.asarray(ex.update, np.float64), ex.vocab_axis, 0)
    exact = np.linalg.norm(rows[:, None] - rows[None], axis=-1).max()
    assume(exact > 0)  # (all rows equal: nothing below D = 0 to trip on)
    for kwargs in ({"method": "exact"}, {"method": "auto", "exact_max_vocab": 1}):
        rt.assert_row_diameter_at_most(ex.update, exact * (1 + 1e-4), vocab_axis=ex.vocab_axis,
                                       **kwargs)
        with np.testing.assert_raises(AssertionError):
            rt.assert_row_diameter_at_most(ex.update, exact * (1 - 1e-3),
                                           vocab_axis=ex.vocab_axis, **kwargs)


def test_strategies_draw_every_layout_dtype_padding_and_pattern():
    seen = set()
    collect = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                       phases=[Phase.generate])

    for strategy in (strategies.lm_head_gradients(**SHAPES),
                     strategies.token_row_patterns(**SHAPES)):
        @collect
        @given(ex=strategy)
        def draw(ex):
            assert ex.update.shape[ex.vocab_axis] == 12 and ex.hidden.shape[-1] == 8
            assert ex.num_valid in (None, 9)
            seen.add((ex.kind == "cross_entropy", ex.vocab_axis, str(ex.update.dtype),
                      ex.num_valid))
            seen.add(ex.kind)

        draw()
    combos = {(ce, axis, dtype, nv) for ce in (True, False) for axis in (0, 1)
              for dtype in ("float32", "bfloat16") for nv in (None, 9)}
    assert combos <= seen, combos - seen
    assert set(strategies.PATTERNS) <= seen, set(strategies.PATTERNS) - seen
    with np.testing.assert_raises_regex(ValueError, "vocab_axes must be 0"):
        find(strategies.token_row_patterns(vocab_axes=[2]), lambda ex: True)


@settings(max_examples=EXAMPLES, deadline=None)
@given(tokens=strategies.zipf_token_batches(vocab_size=50, shape=(64, 64)))
def test_zipf_token_batches_are_skewed(tokens):
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=50)
    assert tokens.dtype == jnp.int32 and counts.sum() == 64 * 64
    # Exponent >= 0.8 over 50 tokens: the top token has >= 10% of the mass (uniform: 2%).
    assert counts.max() >= 0.07 * counts.sum()
