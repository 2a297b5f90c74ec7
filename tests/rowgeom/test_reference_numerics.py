"""Projected RowNorm and the row-diameter measures, each against a float64 reference of its own.

Only the public API is used (the `projected_rownorm` transform, `row_diameter`,
`row_diameter_bounds`, `track_row_diameter`, `read_row_diameter`), so whichever formulation runs
on this platform is the one compared with the reference: no test here compares two formulations
with each other. The references are written out below in numpy float64 from the definitions:

- projected RowNorm: centre the token rows over the vocabulary axis, divide each row by
  ``max(||x_i||, eps)``, centre again; rows ``>= num_valid`` are padding (left out of both means,
  zero in the result);
- the row diameter: ``max_{i<j} ||s_i - s_j||`` by brute force over every pair; its bracket:
  ``upper = 2 r_c``, the centroid lower bound ``max(r_c, sqrt(2V/(V-1)) rms_c)``, and with
  farthest-point sweeps the length of an actual pair of rows.
"""

import contextlib
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rowgeom

# float32 results against float64 references
ATOL = 2e-6
REL = 1e-5

# --- float64 references ------------------------------------------------------------------------


def _token_rows(u, vocab_axis):
    """(V, F) float64 token rows (every other axis flattened) and the moved shape."""
    moved = np.moveaxis(np.asarray(u, np.float64), vocab_axis, 0)
    return moved.reshape(moved.shape[0], -1), moved.shape


def ref_rownorm(u, vocab_axis, *, eps=1e-8, center_input=True, center_output=True,
                num_valid=None):
    x, moved_shape = _token_rows(u, vocab_axis)
    n = x.shape[0] if num_valid is None else num_valid
    rows = x[:n]
    if center_input:
        rows = rows - rows.mean(axis=0)
    y = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), eps)
    if center_output:
        y = y - y.mean(axis=0)
    out = np.zeros_like(x)
    out[:n] = y
    return np.moveaxis(out.reshape(moved_shape), 0, vocab_axis)


def pair_distances(s, vocab_axis):
    """Every ``||s_i - s_j||``, i < j, in float64 (brute force)."""
    x, _ = _token_rows(s, vocab_axis)
    return np.array([np.linalg.norm(x[i] - x[j])
                     for i, j in itertools.combinations(range(x.shape[0]), 2)])


def brute_diameter(s, vocab_axis):
    d = pair_distances(s, vocab_axis)
    return float(d.max()) if d.size else 0.0


def centroid_stats(s, vocab_axis):
    """(r_c, rms_c, V): the largest and the RMS distance of a row to the rows' mean."""
    x, _ = _token_rows(s, vocab_axis)
    dist = np.linalg.norm(x - x.mean(axis=0), axis=1)
    return float(dist.max()), float(np.sqrt(np.mean(dist**2))), x.shape[0]


# --- the transform, called as a user would -------------------------------------------------------


def _key(shape, vocab_axis, options):
    return tuple(shape), vocab_axis, tuple(sorted(options.items()))


@functools.cache
def _calls_program():
    """Every jitted call of `rownorm` in this file (CALLS), as one jitted program of one input
    per call: one compile for the file's RowNorm checks, not one per shape and options."""
    txs = [rowgeom.projected_rownorm(vocab_axis=axis, **options) for _, axis, options in CALLS]
    return jax.jit(lambda us: [tx.update(u, tx.init(u))[0] for tx, u in zip(txs, us, strict=True)])


def rownorm(u, vocab_axis, *, jit=True, **options):
    """`projected_rownorm(vocab_axis=..., **options).update(u)` as float64 (a bare-array tree):
    jitted (the call's slot of `_calls_program`, the other slots on zeros), or eagerly (each
    operation compiled on its own: a few tests only)."""
    tx = rowgeom.projected_rownorm(vocab_axis=vocab_axis, **options)
    u = np.asarray(u, np.float32)
    if jit:
        slots = [_key(shape, axis, opts) for shape, axis, opts in CALLS]
        slot = slots.index(_key(u.shape, vocab_axis, options))  # every call is in CALLS
        out = _calls_program()([u if i == slot else np.zeros(shape, np.float32)
                                for i, (shape, _, _) in enumerate(CALLS)])[slot]
    else:
        out, _ = tx.update(jnp.asarray(u, jnp.float32), tx.init(u))  # no compile: f32 in
    assert out.shape == u.shape and out.dtype == jnp.float32
    return np.asarray(out, np.float64)


# (shape, vocab_axis): (V, d) tables, Flax (d, V) kernels, rank 3 with the vocabulary first,
# in the middle and last (every other axis is a feature of the row norm).
LAYOUTS = [((37, 12), 0), ((12, 37), 1), ((37, 4, 3), 0), ((4, 37, 3), 1), ((3, 4, 37), -1)]


def gaussian(rng, shape, offset=0.5):
    """Random rows with a common offset, so the input centring is not a no-op."""
    return (rng.standard_normal(shape) + offset).astype(np.float32)


# --- projected RowNorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape, vocab_axis", LAYOUTS)
def test_rownorm_matches_the_float64_reference_in_every_layout(rng, shape, vocab_axis):
    u = gaussian(rng, shape)
    want = ref_rownorm(u, vocab_axis)
    # Eager calls too, on the rank-2 layouts (whose operations the other eager test shares).
    for jit in (False, True) if len(shape) == 2 else (True,):
        got = rownorm(u, vocab_axis, jit=jit)
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"jit={jit}")
    # The wrong vocabulary axis is far from it (so the comparison above can tell them apart).
    other = 1 if vocab_axis % len(shape) == 0 else 0
    assert np.abs(ref_rownorm(u, other) - want).max() > 1e-2


CENTRING_FLAGS = [(False, True), (True, False), (False, False)]


CENTRING_LAYOUTS = [LAYOUTS[0], LAYOUTS[1], LAYOUTS[3]]


@pytest.mark.parametrize("center_input, center_output", CENTRING_FLAGS)
@pytest.mark.parametrize("shape, vocab_axis", CENTRING_LAYOUTS)
def test_rownorm_centring_flags(shape, vocab_axis, center_input, center_output):
    u = gaussian(np.random.default_rng(0), shape, offset=1.0)
    got = rownorm(u, vocab_axis, center_input=center_input, center_output=center_output)
    want = ref_rownorm(u, vocab_axis, center_input=center_input, center_output=center_output)
    np.testing.assert_allclose(got, want, atol=ATOL)
    # Each flag changes the result by far more than the tolerance (the offset sees to that).
    default = ref_rownorm(u, vocab_axis)
    assert np.abs(want - default).max() > 1e-2
    rows, _ = _token_rows(got, vocab_axis)
    if center_output:  # the outer P: 1ᵀS = 0
        assert np.abs(rows.sum(axis=0)).max() < 1e-5
    else:  # no outer P: every row is a normalised row, of norm <= 1
        assert np.linalg.norm(rows, axis=1).max() <= 1 + 1e-6


PADDED_LAYOUTS, NUM_PADDED_VALID = [LAYOUTS[0], LAYOUTS[1], LAYOUTS[3]], 30


@pytest.mark.parametrize("shape, vocab_axis", PADDED_LAYOUTS)
def test_rownorm_padding_rows_stay_out_of_the_means(rng, shape, vocab_axis):
    num_valid = NUM_PADDED_VALID
    u = gaussian(rng, shape)
    # Padding rows hold large values (which would dominate either mean if they leaked in).
    moved = np.moveaxis(u, vocab_axis, 0)
    moved[num_valid:] = 1e3 * (1 + np.arange(moved.shape[0] - num_valid)).reshape(
        (-1,) + (1,) * (moved.ndim - 1))
    u = np.moveaxis(moved, 0, vocab_axis)
    got = rownorm(u, vocab_axis, num_valid=num_valid)
    np.testing.assert_allclose(got, ref_rownorm(u, vocab_axis, num_valid=num_valid), atol=ATOL)
    padding = np.moveaxis(got, vocab_axis, 0)[num_valid:]
    np.testing.assert_array_equal(padding, 0.0)
    # The valid rows alone give the same valid rows.
    valid = np.take(u, np.arange(num_valid), axis=vocab_axis)
    np.testing.assert_allclose(np.take(got, np.arange(num_valid), axis=vocab_axis),
                               rownorm(valid, vocab_axis), atol=ATOL)


# Row norms around eps (in units of eps): below it, at it and above it.
EPS = 1e-2
NORMS = np.array([0.0, 0.25, 0.5, 0.99, 1.0, 1.01, 1.5, 3.0, 10.0, 40.0])


def rows_with_norms(rng, norms, d, eps):
    """(2k, d) rows in +/- pairs with the given norms (times eps): their mean is zero, so the
    input centring keeps them (up to float32 rounding of a zero sum) and so does the output
    centring (the normalised rows are +/- pairs too)."""
    directions = rng.standard_normal((len(norms), d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    half = directions * (np.asarray(norms)[:, None] * eps)
    return np.concatenate([half, -half]).astype(np.float32)


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_eps_rule_near_the_row_norms(rng, vocab_axis):
    """``x / max(||x||, eps)``: rows at least eps long come out unit length, shorter ones as
    ``x / eps`` (norm ``||x|| / eps``), zero rows stay zero. An eps rule such as
    ``x / (||x|| + eps)`` is off by up to 0.5 here, where a default eps hides it."""
    rows = rows_with_norms(rng, NORMS, 6, EPS)
    u = rows if vocab_axis == 0 else rows.T
    got = rownorm(u, vocab_axis, eps=EPS)
    out_rows = got if vocab_axis == 0 else got.T
    norms = np.linalg.norm(out_rows, axis=1)
    expected = np.minimum(np.concatenate([NORMS, NORMS]), 1.0)
    np.testing.assert_allclose(norms, expected, atol=1e-5)
    np.testing.assert_allclose(got, ref_rownorm(u, vocab_axis, eps=EPS), atol=1e-5)
    # Short rows keep their direction: exactly x / eps.
    short = np.concatenate([NORMS, NORMS]) < 0.99
    np.testing.assert_allclose(out_rows[short], rows[short] / EPS, atol=1e-5)
    # The zero rows (norm 0, a +/- pair) stay (numerically) zero, never NaN.
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(out_rows[[0, len(NORMS)]], 0.0, atol=1e-5)


def test_eps_rule_without_centring_is_exact_on_zero_rows(rng):
    """Without centring the zero rows are exactly zero and every other row is exactly
    ``x / max(||x||, eps)`` (no mean to round)."""
    rows = rows_with_norms(rng, NORMS, 6, EPS)
    got = rownorm(rows, 0, eps=EPS, center_input=False, center_output=False)
    np.testing.assert_array_equal(got[[0, len(NORMS)]], 0.0)
    want = ref_rownorm(rows, 0, eps=EPS, center_input=False, center_output=False)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1),
                               np.minimum(np.concatenate([NORMS, NORMS]), 1.0), atol=1e-6)


def test_eps_scales_with_the_rows_on_the_rank3_layout(rng):
    """The eps rule on a rank-3 leaf with the vocabulary in the middle: the norm is over both
    feature axes, and a row exactly 2 eps long is unit length while one of eps / 2 is 1/2."""
    flat = rows_with_norms(rng, [0.5, 2.0, 5.0], 6, EPS)  # (6, 6) token rows
    u = np.moveaxis(flat.reshape(6, 2, 3), 0, 1)  # (2, V=6, 3)
    got = rownorm(u, 1, eps=EPS)
    norms = np.linalg.norm(np.moveaxis(got, 1, 0).reshape(6, -1), axis=1)
    np.testing.assert_allclose(norms, [0.5, 1.0, 1.0] * 2, atol=1e-5)
    np.testing.assert_allclose(got, ref_rownorm(u, 1, eps=EPS), atol=1e-5)


def test_rownorm_all_equal_rows_and_one_token_give_zero(rng):
    row = rng.standard_normal(5).astype(np.float32)
    for u, axis in ((np.tile(row, (9, 1)), 0), (np.tile(row, (9, 1)).T, 1), (row[None], 0)):
        np.testing.assert_array_equal(rownorm(u, axis), 0.0)


def test_rownorm_is_invariant_to_a_power_of_two_scale_near_float32_range(rng):
    """Entries near 2**100, whose squared norms would overflow float32: the same result as the
    reference on the unscaled input (the result is scale invariant when every row is far
    longer than eps)."""
    u = gaussian(rng, (37, 12))
    want = ref_rownorm(u, 0)
    scaled = (u.astype(np.float64) * 2.0**100).astype(np.float32)
    np.testing.assert_allclose(rownorm(scaled, 0), want, atol=ATOL)
    np.testing.assert_allclose(rownorm(scaled.T, 1), want.T, atol=ATOL)


@pytest.mark.parametrize("jit", [False, True])
def test_rownorm_of_near_identical_rows_above_the_overflow_guard(rng, jit):
    """Rows near 2**110 that differ only in their last mantissa bits (by about 2**93, so the
    centred rows' squared norms overflow and the guard rescales): its scale must be an exact
    power of two, or rounding the scaled entries changes the small differences that the
    centring leaves, and with them the whole result."""
    base = rng.standard_normal(12)
    bits = rng.integers(-8, 9, size=(37, 12))  # a few units in the last place of 2**110
    u = ((1.5 + base[None] / 8) * 2.0**110 + bits * 2.0**90).astype(np.float32)
    assert len(np.unique(u, axis=0)) > 30, "the rows must differ after rounding to float32"
    want = ref_rownorm(u, 0)
    np.testing.assert_allclose(rownorm(u, 0, jit=jit), want, atol=ATOL)
    np.testing.assert_allclose(rownorm(u.T, 1, jit=jit), want.T, atol=ATOL)


@pytest.mark.parametrize("shape, vocab_axis", [LAYOUTS[0], LAYOUTS[1]])
def test_rescale_modes_against_the_reference(rng, shape, vocab_axis):
    """``rescale="exact"``: ``2 / D`` times the reference (D = 2 exactly); ``"bound"``: divided
    by its upper bound ``2 max_i ||s_i - sbar||`` (the farthest row exactly 1 from the mean)."""
    u = gaussian(rng, shape)
    s = ref_rownorm(u, vocab_axis)
    exact = rownorm(u, vocab_axis, rescale="exact")
    np.testing.assert_allclose(exact, s * 2 / brute_diameter(s, vocab_axis), atol=1e-5)
    assert brute_diameter(exact, vocab_axis) == pytest.approx(2.0, rel=REL)
    bound = rownorm(u, vocab_axis, rescale="bound")
    r_c, _, _ = centroid_stats(s, vocab_axis)
    np.testing.assert_allclose(bound, s / r_c, atol=1e-5)
    assert centroid_stats(bound, vocab_axis)[0] == pytest.approx(1.0, rel=REL)


# Every jitted `rownorm` call above, as (shape, vocab_axis, options): `_calls_program` runs them
# all in one program.
CALLS = [
    *((shape, axis, {}) for shape, axis in LAYOUTS),  # and the scaled and near-identical rows
    *((shape, axis, {"center_input": ci, "center_output": co})
      for shape, axis in CENTRING_LAYOUTS for ci, co in CENTRING_FLAGS),
    *((shape, axis, {"num_valid": NUM_PADDED_VALID}) for shape, axis in PADDED_LAYOUTS),
    *((tuple(NUM_PADDED_VALID if i == axis else n for i, n in enumerate(shape)), axis, {})
      for shape, axis in PADDED_LAYOUTS),  # the valid rows alone
    ((20, 6), 0, {"eps": EPS}), ((6, 20), 1, {"eps": EPS}),
    ((20, 6), 0, {"eps": EPS, "center_input": False, "center_output": False}),
    ((2, 6, 3), 1, {"eps": EPS}),
    ((9, 5), 0, {}), ((5, 9), 1, {}), ((1, 5), 0, {}),  # all-equal rows, one token
    *((shape, axis, {"rescale": mode}) for shape, axis in LAYOUTS[:2]
      for mode in ("exact", "bound")),
]


# --- the row diameter and its bracket ----------------------------------------------------------

# Small arrays: (shape, vocab_axis), several sizes of V including 2 (where D = 2 r_c).
DIAMETER_CASES = [((2, 3), 0), ((7, 5), 0), ((5, 7), 1), ((2, 9, 3), 1), ((1, 4), 0)]
BLOCKED = (7, 5)  # blocks of 2 rows, smaller than V: the scan over block pairs


@functools.cache
def _measures_program():
    """For one input per DIAMETER_CASES entry: `row_diameter`, {sweeps: `row_diameter_bounds`}
    for sweeps 0 and 2, `track_row_diameter`'s update of it as an lm_head kernel (and, for the
    BLOCKED shape, `row_diameter` by blocks of 2 rows), as one jitted program: one compile for
    the file's diameter, bracket and tracker checks, not one per shape and function."""
    trackers = [rowgeom.track_row_diameter(vocab_axis=axis) for _, axis in DIAMETER_CASES]

    def run(ss):
        out = []
        for (shape, axis), s, tracker in zip(DIAMETER_CASES, ss, trackers, strict=True):
            tree = {"lm_head": {"kernel": s}}
            out.append({"diameter": rowgeom.row_diameter(s, vocab_axis=axis),
                        "brackets": {k: rowgeom.row_diameter_bounds(s, vocab_axis=axis, sweeps=k)
                                     for k in (0, 2)},
                        "tracker": tracker.update(tree, tracker.init(tree))})
            if shape == BLOCKED:
                out[-1]["blocked"] = rowgeom.row_diameter(s, vocab_axis=axis, block_size=2)
        return out

    return jax.jit(run)


def measures(s, vocab_axis):
    """The measures of `s` (its DIAMETER_CASES slot of `_measures_program`, the other slots on
    zeros): {"diameter", "brackets", "tracker": (updates, state)[, "blocked"]}."""
    slot = DIAMETER_CASES.index((np.shape(s), vocab_axis))
    return _measures_program()([np.asarray(s, np.float32) if i == slot
                                else np.zeros(shape, np.float32)
                                for i, (shape, _) in enumerate(DIAMETER_CASES)])[slot]


def diameter_input(rng, shape, vocab_axis, kind):
    if kind == "gaussian":
        return gaussian(rng, shape, offset=3.0)
    # Two tight clusters of token rows far apart: a diameter well below 2 r_c.
    x = rng.standard_normal(shape).astype(np.float32) * 0.05
    moved = np.moveaxis(x, vocab_axis, 0)  # a view: writes go to x
    moved[: (moved.shape[0] + 1) // 2] += 1.0
    return x


def check_bracket(lower, upper, s, vocab_axis, *, sweeps):
    exact = brute_diameter(s, vocab_axis)
    r_c, rms_c, vocab = centroid_stats(s, vocab_axis)
    lower, upper = float(lower), float(upper)
    assert lower <= exact * (1 + REL) + 1e-7 and exact <= upper * (1 + REL) + 1e-7, \
        (lower, exact, upper)
    assert upper == pytest.approx(2 * r_c, rel=REL, abs=1e-7)
    if vocab == 1:
        assert lower == upper == 0.0
        return
    centroid_lower = max(r_c, np.sqrt(2 * vocab / (vocab - 1)) * rms_c)
    if sweeps == 0:
        assert lower == pytest.approx(min(centroid_lower, 2 * r_c), rel=REL, abs=1e-7)
    else:
        # The length of an actual pair of rows (so never above D), and never below r_c.
        gaps = np.abs(pair_distances(s, vocab_axis) - lower)
        assert gaps.min() <= REL * max(lower, 1e-6), (lower, gaps.min())
        assert lower >= r_c * (1 - REL)


@pytest.mark.parametrize("kind", ["gaussian", "clusters"])
@pytest.mark.parametrize("shape, vocab_axis", DIAMETER_CASES)
def test_diameter_and_bracket_against_brute_force(rng, shape, vocab_axis, kind):
    s = diameter_input(rng, shape, vocab_axis, kind)
    exact = brute_diameter(s, vocab_axis)
    found = measures(s, vocab_axis)
    diameter, brackets = found["diameter"], found["brackets"]
    assert float(diameter) == pytest.approx(exact, rel=REL, abs=1e-7)
    if shape == BLOCKED:  # blocks smaller than V: the scan over block pairs covers every pair
        assert float(found["blocked"]) == pytest.approx(exact, rel=REL, abs=1e-7)
    for sweeps, (lower, upper) in brackets.items():
        assert lower.dtype == upper.dtype == jnp.float32
        check_bracket(lower, upper, s, vocab_axis, sweeps=sweeps)


@pytest.mark.parametrize("exponent", [70, -70])
@pytest.mark.parametrize("shape, vocab_axis", [((7, 5), 0), ((5, 7), 1)])
def test_bracket_and_diameter_scale_with_the_input_near_float32_range(rng, shape, vocab_axis,
                                                                      exponent):
    """Rows near 2**70 (squared distances overflow float32) and 2**-70 (they underflow): each
    measure is ``2**e`` times the unscaled one's brute-force value, and the bracket keeps its
    exact form."""
    s = diameter_input(rng, shape, vocab_axis, "clusters")
    scaled = (s.astype(np.float64) * 2.0**exponent).astype(np.float32)
    unit = 2.0**exponent
    exact = brute_diameter(s, vocab_axis)
    found = measures(scaled, vocab_axis)
    diameter, brackets = found["diameter"], found["brackets"]
    assert float(diameter) / unit == pytest.approx(exact, rel=REL)
    for sweeps, (lower, upper) in brackets.items():
        check_bracket(float(lower) / unit, float(upper) / unit, s, vocab_axis, sweeps=sweeps)


@pytest.mark.parametrize("shape, vocab_axis", [((7, 5), 0), ((5, 7), 1), ((2, 9, 3), 1)])
def test_tracker_stats_against_brute_force(rng, shape, vocab_axis):
    """`track_row_diameter` records the sweeps-2 bracket of the update it sees and
    ``||sum_i s_i||``, and passes the update through unchanged."""
    s = diameter_input(rng, shape, vocab_axis, "clusters")
    out, state = measures(s, vocab_axis)["tracker"]  # track_row_diameter(vocab_axis=vocab_axis)
    np.testing.assert_array_equal(out["lm_head"]["kernel"], s)
    stats = rowgeom.read_row_diameter(state)
    key = "lm_head/kernel"
    assert {k: int(v) for k, v in stats.measured_at.items()} == {key: 1}  # (no eager ==)
    assert {k: int(v) for k, v in stats.count.items()} == {key: 1}
    check_bracket(stats.lower[key], stats.upper[key], s, vocab_axis, sweeps=2)
    rows, _ = _token_rows(s, vocab_axis)
    assert float(stats.row_sum_residual[key]) == pytest.approx(
        np.linalg.norm(rows.sum(axis=0)), rel=REL)


def test_tracker_of_a_projected_rownorm_step(rng):
    """Chained after projected RowNorm and a learning rate: the bracket holds the brute-force
    diameter of the step, which is at most 2 lr, and the step is in the gauge 1ᵀS = 0."""
    lr = 0.03
    g = gaussian(rng, (12, 37))
    tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=1), optax.scale_by_learning_rate(lr),
                     rowgeom.track_row_diameter(vocab_axis=1))
    # init inside the jitted program: eagerly it compiles each of its zeros
    step, state = jax.jit(lambda g: tx.update(g, tx.init(g)))(g)
    np.testing.assert_allclose(step, -lr * ref_rownorm(g, 1), atol=lr * ATOL)
    stats = rowgeom.read_row_diameter(state)
    check_bracket(stats.lower, stats.upper, np.asarray(step), 1, sweeps=2)
    assert brute_diameter(np.asarray(step), 1) <= 2 * lr * (1 + REL)
    assert float(stats.row_sum_residual) < 1e-6


# --- the same references on 8 simulated devices (the mesh formulation) -------------------------

# check-name suffix -> tolerance (absolute for RowNorm entries and norms, relative otherwise)
MESH_TOLERANCES = {"rownorm": ATOL, "rownorm_uncentred_input": ATOL, "rownorm_padded": ATOL,
                   "rownorm_eps": 1e-5, "rownorm_eps_norms": 1e-5, "diameter": REL,
                   "upper": REL, "lower": REL, "order": REL, "residual": REL}
MESH_V, MESH_D, NUM_VALID = 40, 12, 30
# 20 row norms (in units of eps) around eps: 40 rows in +/- pairs.
MESH_NORMS = np.concatenate([NORMS, [0.1, 0.6, 0.75, 0.95, 1.05, 1.2, 2.0, 5.0, 7.0, 20.0]])


def rel(a, b):
    return abs(float(a) / float(b) - 1.0) if b else abs(float(a))


def bracket_errors(lower, upper, s, vocab_axis, sweeps):
    """Relative errors of the bracket against its float64 definition (0 when exact)."""
    exact = brute_diameter(s, vocab_axis)
    r_c, rms_c, vocab = centroid_stats(s, vocab_axis)
    lower, upper = float(lower), float(upper)
    errors = {"upper": rel(upper, 2 * r_c),
              "order": max(lower / exact - 1.0, exact / upper - 1.0, 0.0)}
    if sweeps == 0:
        centroid = max(r_c, np.sqrt(2 * vocab / (vocab - 1)) * rms_c)
        errors["lower"] = rel(lower, min(centroid, 2 * r_c))
    else:  # an actual pair's length, never below r_c
        errors["lower"] = max(np.abs(pair_distances(s, vocab_axis) - lower).min() / lower,
                              max(1.0 - lower / r_c, 0.0))
    return errors


def _mesh_errors(axis_type, inside: bool):
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    rng = np.random.default_rng(0)
    out = {}
    context = (lambda: jax.set_mesh(mesh)) if inside else contextlib.nullcontext
    table = gaussian(rng, (MESH_V, MESH_D))
    padded = table.copy()
    padded[NUM_VALID:] = 1e3
    eps_rows = rows_with_norms(rng, MESH_NORMS, MESH_D, EPS)
    clusters = diameter_input(rng, (MESH_V, MESH_D), 0, "clusters")
    layouts = (("table", 0, P("vocab", None), lambda a: a),
               ("kernel", 1, P(None, "vocab"), lambda a: np.ascontiguousarray(a.T)))
    variants = {
        "rownorm": (table, {}),
        "rownorm_uncentred_input": (table, {"center_input": False}),
        "rownorm_padded": (padded, {"num_valid": NUM_VALID}),
        "rownorm_eps": (eps_rows, {"eps": EPS}),
    }
    # Every check of both layouts in one jitted program, each on a sharded input of its own
    # (eagerly, each operation would compile for the 8 devices; a program per check was 20
    # compiles per context).
    checks, inputs = {}, {}
    for name, vocab_axis, spec, t in layouts:
        sharding = NamedSharding(mesh, spec)
        for check, (x, options) in variants.items():
            tx = rowgeom.projected_rownorm(vocab_axis=vocab_axis, **options)
            checks[name, check] = lambda u, tx=tx: tx.update(u, tx.init(u))[0]
            inputs[name, check] = jax.device_put(t(x), sharding)
        tracker = rowgeom.track_row_diameter(vocab_axis=vocab_axis)
        checks[name, "measures"] = lambda s, axis=vocab_axis, tracker=tracker: (
            rowgeom.row_diameter(s, vocab_axis=axis, block_size=16),
            {k: rowgeom.row_diameter_bounds(s, vocab_axis=axis, sweeps=k) for k in (0, 2)},
            tracker.update(s, tracker.init(s))[1])
        inputs[name, "measures"] = jax.device_put(t(clusters), sharding)
    with context():
        results = jax.jit(lambda xs: {key: checks[key](x) for key, x in xs.items()})(inputs)
    for name, vocab_axis, _, t in layouts:
        for check, (x, options) in variants.items():
            got = np.asarray(results[name, check], np.float64)
            want = ref_rownorm(t(x), vocab_axis, **options)
            out[f"{name}_{check}"] = float(np.abs(got - want).max())
        norms = np.linalg.norm(np.moveaxis(got, vocab_axis, 0), axis=1)  # the eps variant's
        out[f"{name}_rownorm_eps_norms"] = float(
            np.abs(norms - np.minimum(np.concatenate([MESH_NORMS, MESH_NORMS]), 1.0)).max())

        s = t(clusters)
        diameter, brackets, state = results[name, "measures"]
        out[f"{name}_diameter"] = rel(diameter, brute_diameter(s, vocab_axis))
        for k, (lower, upper) in brackets.items():
            for part, err in bracket_errors(lower, upper, s, vocab_axis, k).items():
                out[f"{name}_bracket{k}_{part}"] = err
        for part, err in bracket_errors(state.lower, state.upper, s, vocab_axis, 2).items():
            out[f"{name}_tracker_{part}"] = err
        rows, _ = _token_rows(s, vocab_axis)
        out[f"{name}_tracker_residual"] = rel(state.row_sum_residual,
                                              np.linalg.norm(rows.sum(axis=0)))
    return out



@pytest.mark.sharded
@pytest.mark.usefixtures("sharded_devices")
@pytest.mark.parametrize("context", ["auto_mesh", "explicit_mesh", "auto_sharded_input"])
def test_vocab_sharded_heads_match_the_references(context):
    """Vocabulary-sharded (V, d) tables and (d, V) kernels on 8 devices, inside `jax.set_mesh`
    (Auto and Explicit axes) and as sharded inputs outside it: projected RowNorm (eps near the
    row norms, padding, flags), the bracket, the exact diameter and the tracker, each within
    float32 rounding of its float64 reference."""
    axis_type = AxisType.Explicit if context == "explicit_mesh" else AxisType.Auto
    errors = _mesh_errors(axis_type, inside=context != "auto_sharded_input")
    assert len(errors) == 2 * 16, sorted(errors)  # every check ran, for both layouts
    for check, error in errors.items():
        suffix = check.split("_", 1)[1]
        tolerance = MESH_TOLERANCES.get(suffix) or MESH_TOLERANCES[suffix.rsplit("_", 1)[1]]
        assert error <= tolerance, (check, error, tolerance)
