"""Newton–Schulz orthogonalization against numpy fp64 references (SVD, an in-order loop)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from optax.contrib import _muon as optax_muon

from rowgeom import newton_schulz, ns_coefficients

KELLER = (3.4445, -4.7750, 2.0315)
# Documented bands (module docstring) for inputs whose normalised singular values are not tiny.
BANDS = {"keller": (0.681, 1.135), "polar_express": (0.858, 1.142)}
NORM_SCALE = {"keller": 1.0, "polar_express": 1.02}
# Distinct rows, so applying them in another order gives another result.
TABLE = np.array([[3.4445, -4.7750, 2.0315],
                  [2.0, -1.5, 0.5],
                  [3.0, -3.2, 1.2],
                  [1.875, -1.25, 0.375],
                  [1.5, -0.5, 0.0]])


def ns_reference(g, table, *, norm_scale=1.0, eps=1e-7):
    """fp64 Newton–Schulz applying the rows of `table` in order (last two axes)."""
    x = np.asarray(g, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = np.swapaxes(x, -1, -2)
    x = x / (norm_scale * np.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    for a, b, c in np.asarray(table, np.float64):
        gram = x @ np.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return np.swapaxes(x, -1, -2) if tall else x


def gaussian(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@functools.cache
def _ns_jit(**static):
    return jax.jit(functools.partial(newton_schulz, **static))


def ns(x, **static):
    """`newton_schulz` jitted once per (hashable) options, compiled once per shape and shared
    by the tests (the (48, 16) and (16, 48) matrices of several tests): eagerly, each operation
    of the iteration would be a compile of its own. Results as numpy arrays."""
    return np.asarray(_ns_jit(**static)(x))


# --- coefficient tables ---------------------------------------------------------------------


def test_ns_coefficients_presets_and_tables():
    keller = ns_coefficients("keller", 5)
    assert keller.shape == (5, 3) and keller.dtype == np.float64
    np.testing.assert_array_equal(keller, np.tile(KELLER, (5, 1)))

    pe = ns_coefficients("polar_express", 5)
    assert pe.shape == (5, 3)
    np.testing.assert_array_equal(pe[0], [8.156554524902461, -22.48329292557795,
                                          15.878769915207462])
    np.testing.assert_array_equal(pe[4], [2.3465413258596377, -1.7097828382687081,
                                          0.42323551169305323])
    np.testing.assert_array_equal(ns_coefficients("polar_express", 3), pe[:3])
    pe7 = ns_coefficients("polar_express", 7)
    np.testing.assert_array_equal(pe7[:5], pe)
    np.testing.assert_array_equal(pe7[5:], [[1.875, -1.25, 0.375]] * 2)
    # The steps past 5 use a polynomial with fixed point 1.
    np.testing.assert_allclose(pe7[5].sum(), 1.0)

    np.testing.assert_array_equal(ns_coefficients((1.0, 2.0, 3.0), 4), [[1.0, 2.0, 3.0]] * 4)
    np.testing.assert_array_equal(ns_coefficients(TABLE, 5), TABLE)


@pytest.mark.parametrize("coeffs, steps, exc, match", [
    ("standard", 5, ValueError, "ns_coeffs"),
    (TABLE, 4, ValueError, r"\(4, 3\)"),
    (TABLE[:, :2], 5, ValueError, "shape"),
    ((1.0, 2.0), 5, ValueError, "shape"),
    ((1.0, np.nan, 2.0), 5, ValueError, "finite"),
    ("keller", 0, ValueError, "ns_steps"),
    ("keller", 2.5, TypeError, "ns_steps"),
    ("keller", True, TypeError, "ns_steps"),
    (object(), 5, TypeError, "ns_coeffs"),
])
def test_ns_coefficients_errors(coeffs, steps, exc, match):
    with pytest.raises(exc, match=match):
        ns_coefficients(coeffs, steps)
    with pytest.raises(exc, match=match):
        newton_schulz(jax.device_put(np.ones((2, 3), np.float32)), steps=steps, coeffs=coeffs)


# --- the polar factor -----------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["keller", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
def test_singular_values_in_documented_band(rng, preset, shape):
    """Output = U f(Σ) Vᵀ with the input's singular vectors and f(σ) inside the preset's band.
    (The shapes of the other tests: one compiled program per shape and preset.)"""
    g = gaussian(rng, shape)
    out = np.asarray(ns(g, coeffs=preset), np.float64)
    lo, hi = BANDS[preset]
    s_out = np.linalg.svd(out, compute_uv=False)
    assert lo <= s_out.min() and s_out.max() <= hi, (s_out.min(), s_out.max())
    # Same singular vectors: Uᵀ out V is diagonal.
    u, _, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    core = u.T @ out @ vt.T
    np.testing.assert_allclose(core - np.diag(np.diag(core)), 0, atol=2e-5)
    # And the whole iteration equals the fp64 reference.
    table = ns_coefficients(preset, 5)
    np.testing.assert_allclose(out, ns_reference(g, table, norm_scale=NORM_SCALE[preset]),
                               atol=2e-5)


def test_custom_table_applied_in_order(rng):
    g = gaussian(rng, (16, 40))
    out = np.asarray(jax.jit(lambda x: newton_schulz(x, steps=5, coeffs=TABLE))(g))
    np.testing.assert_allclose(out, ns_reference(g, TABLE), atol=1e-5)
    # The order matters, so the check above would catch a reordering or a wrong slice.
    assert np.abs(ns_reference(g, TABLE[::-1]) - ns_reference(g, TABLE)).max() > 1e-2


def test_matches_optax_orthogonalize(rng):
    g = gaussian(rng, (2, 16, 40))  # a batch of two matrices
    dims = optax_muon.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    coeffs = np.float32(KELLER)
    # Ours and theirs on the batch, and on a tall input (the transposed path in both): one
    # jitted program.
    (ours, theirs), (ours_tall, theirs_tall) = jax.jit(lambda g, tall: (
        (newton_schulz(g, coeffs="keller", eps=1e-7),
         optax_muon.orthogonalize_via_newton_schulz(g, coeffs, 5, eps=1e-7,
                                                    dimension_numbers=dims)),
        (newton_schulz(tall, coeffs=KELLER),
         optax_muon.orthogonalize_via_newton_schulz(tall, coeffs, 5, eps=1e-7))))(g, g[0].T)
    chex.assert_trees_all_close(ours, theirs, atol=2e-6)
    chex.assert_trees_all_close(ours_tall, theirs_tall, atol=2e-6)


@pytest.mark.skipif(optax.__version__ != "0.2.8", reason="documents optax 0.2.8 behaviour")
def test_optax_028_table_length_handling(rng):
    """What `ns_coefficients` documents about optax 0.2.8's handling of an (n, 3) table."""
    g = gaussian(rng, (16, 40))
    dims = {"w": optax_muon.MuonDimensionNumbers()}
    rows = tuple(map(tuple, TABLE))

    @functools.cache  # 7 steps is checked twice: one compile
    def optax_update(ns_steps):
        tx = optax.contrib.scale_by_muon(ns_coeffs=rows, ns_steps=ns_steps, beta=0.0,
                                         nesterov=False, eps=1e-7, weight_dimension_numbers=dims)
        return np.asarray(jax.jit(lambda u: tx.update(u, tx.init(u))[0])({"w": g})["w"])

    # Matching length: rows in order, like ours.
    np.testing.assert_allclose(optax_update(5), ns_reference(g, TABLE), atol=1e-5)
    # Fewer steps than rows: rejected, with a message saying the opposite.
    with pytest.raises(ValueError, match="Not enough coeffs"):
        optax_update(3)
    # More steps than rows: ns_steps is silently ignored (5 steps run, not 7).
    seven = np.concatenate([TABLE, [KELLER, KELLER]])
    np.testing.assert_allclose(optax_update(7), ns_reference(g, TABLE), atol=1e-5)
    assert np.abs(optax_update(7) - ns_reference(g, seven)).max() > 1e-2


@pytest.mark.parametrize("preset", ["keller", "polar_express"])
def test_zero_sum_is_preserved_T9(rng, preset):
    """1ᵀG = 0 over the token axis gives 1ᵀ polar = 0 and D(polar) <= √2 ||polar||₂."""
    for shape, tol in [((48, 16), 1e-5), ((16, 48), 1e-4)]:
        g = rng.standard_normal(shape)
        g = (g - g.mean(axis=0)).astype(np.float32)
        out = np.asarray(ns(g, coeffs=preset), np.float64)
        # V <= d: 1 spans a zero singular direction; its fp32 residual (~1e-7) is amplified by
        # the schedule's slope at 0 (about 5e2..1e3), hence the looser tolerance there.
        assert np.abs(out.sum(axis=0)).max() <= tol
        diffs = out[:, None, :] - out[None, :, :]
        diameter = np.sqrt((diffs**2).sum(-1)).max()
        assert diameter <= np.sqrt(2) * np.linalg.norm(out, 2) * (1 + 1e-5)


def test_zero_input_gives_zero_not_nan(rng):
    for eps in (1e-7, 0.0):
        z = ns(np.zeros((3, 5), np.float32), eps=eps)
        np.testing.assert_array_equal(z, 0.0)
    # A zero matrix in a batch does not disturb its neighbour.
    g = np.stack([np.zeros((6, 10), np.float32), gaussian(rng, (6, 10))])
    out = np.asarray(ns(g))
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1], ns_reference(g[1], ns_coefficients("keller", 5)),
                               atol=1e-5)


def test_leading_axes_are_a_batch(rng):
    g = gaussian(rng, (2, 3, 8, 12))
    out = np.asarray(ns(g))
    table = ns_coefficients("keller", 5)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(out[i, j], ns_reference(g[i, j], table), atol=1e-5)


def test_bf16_compute_dtype(rng):
    g = gaussian(rng, (24, 64))
    # The three calls in one jitted program (numpy in and out: no eager conversions or norms).
    ref, out, out16 = (np.asarray(y) for y in jax.jit(lambda g, g16: (
        newton_schulz(g), newton_schulz(g, compute_dtype=jnp.bfloat16),
        newton_schulz(g16, compute_dtype=jnp.bfloat16)))(g, g.astype(jnp.bfloat16)))
    assert out.dtype == jnp.float32
    # bf16 keeps ~3 significant digits and 5 expanding steps amplify rounding: a few % relative.
    np.testing.assert_allclose(out, ref, atol=0.05)
    assert float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) < 0.05
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(np.float32), ref, atol=0.06)


def test_bad_input_errors():
    ones = lambda shape, dtype=np.float32: jax.device_put(np.ones(shape, dtype))  # no compile
    with pytest.raises(TypeError, match="x must have a real floating dtype"):
        newton_schulz(ones((3, 4), np.int32))
    with pytest.raises(ValueError, match="x must have rank >= 2"):
        newton_schulz(ones(4))
    with pytest.raises(TypeError, match="compute_dtype"):
        newton_schulz(ones((3, 4)), compute_dtype=jnp.int8)


_jitted_keller = jax.jit(lambda x: newton_schulz(x, coeffs="keller"))
_Q = np.linalg.qr(np.random.default_rng(1).standard_normal((12, 12)))[0].astype(np.float32)


@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-3.0, 3.0))
def test_invariances(seed, log_scale):
    """polar(a G) = polar(G) for a > 0, polar(-G) = -polar(G), polar(Q G) = Q polar(G)."""
    g = np.random.default_rng(seed).standard_normal((12, 30)).astype(np.float32)
    base = np.asarray(_jitted_keller(g))
    scaled = np.asarray(_jitted_keller(g * np.float32(10.0**log_scale)))
    np.testing.assert_allclose(scaled, base, atol=2e-5)
    np.testing.assert_allclose(np.asarray(_jitted_keller(-g)), -base, atol=1e-6)
    np.testing.assert_allclose(np.asarray(_jitted_keller(_Q @ g)), _Q @ base, atol=2e-5)


# --- orientation: the Gram matrix on the smaller side, and the transpose identity --------------


def _dot_output_shapes(jaxpr):
    """Output shapes of every dot_general in a (closed) jaxpr, sub-jaxprs included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.append(tuple(eqn.outvars[0].aval.shape))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    shapes += _dot_output_shapes(getattr(inner, "jaxpr", inner))
    return shapes


@pytest.mark.parametrize("shape", [(96, 16), (16, 96), (3, 40, 12)])
def test_traced_program_forms_the_gram_matrix_on_the_smaller_side(shape):
    """Every product in the traced program of `newton_schulz` is (n, n) or (n, m) with n the
    smaller side: a tall (m, n) input is transposed, never multiplied as an (m, m) Gram."""
    m, n = max(shape[-2:]), min(shape[-2:])
    jaxpr = jax.make_jaxpr(lambda x: newton_schulz(x, steps=2))(
        jax.ShapeDtypeStruct(shape, jnp.float32))
    shapes = _dot_output_shapes(jaxpr.jaxpr)
    batch = shape[:-2]
    assert shapes, "no dot_general found in the traced program"
    assert all(s[:len(batch)] == batch for s in shapes), shapes
    mats = {s[len(batch):] for s in shapes}
    assert (n, n) in mats, mats  # the Gram matrix A = X Xᵀ
    assert all(m not in s or s == (n, m) for s in mats), mats  # never (m, m), nor (m, n)


@pytest.mark.parametrize("coeffs", ["keller", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (2, 40, 12)])
def test_transpose_identity_is_exact(rng, shape, coeffs):
    """``newton_schulz(x) == newton_schulz(xᵀ)ᵀ`` bit for bit: a tall input is computed as its
    transpose (the same operations on the same numbers), not by another route that happens to
    agree to rounding. Checked on the traced program (no compile): a tall input's is, operation
    for operation, the transpose, the wide input's program and the transpose back, so run op by
    op (eagerly) the two give the same bits. Under jit XLA may fuse the transposes
    differently: equal to rounding."""
    x = gaussian(rng, shape)
    xt = np.swapaxes(x, -1, -2)
    tall = x if shape[-2] > shape[-1] else xt
    polar = lambda y: newton_schulz(y, coeffs=coeffs)
    via_wide = lambda y: jnp.swapaxes(polar(jnp.swapaxes(y, -1, -2)), -1, -2)
    assert str(jax.make_jaxpr(polar)(tall)) == str(jax.make_jaxpr(via_wide)(tall))
    np.testing.assert_allclose(ns(x, coeffs=coeffs), np.swapaxes(ns(xt, coeffs=coeffs), -1, -2),
                               atol=1e-5)


def _scalar_schedule(sigma, table, norm):
    """The singular values after the iteration: each ``σ / norm`` through the odd polynomials."""
    s = np.asarray(sigma, np.float64) / norm
    for a, b, c in np.asarray(table, np.float64):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("preset", ["keller", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
def test_polar_factor_of_a_well_conditioned_matrix_against_svd(rng, preset, shape):
    """For ``X = U Σ Vᵀ`` with Σ in [1, 2]: the result is ``U f(Σ) Vᵀ`` with f the preset's
    polynomials applied to the normalised singular values (float64, from numpy's SVD), hence
    within the preset's documented band of the polar factor ``U Vᵀ``; and applying the
    coefficients in another order (rows reversed, or a triple permuted) gives a different f,
    which this comparison rejects."""
    m, n = shape
    k = min(m, n)
    u = np.linalg.qr(rng.standard_normal((m, k)))[0]
    v = np.linalg.qr(rng.standard_normal((n, k)))[0]
    sigma = np.linspace(1.0, 2.0, k)
    x = (u * sigma) @ v.T
    out = np.asarray(ns(np.float32(x), coeffs=preset), np.float64)
    table = ns_coefficients(preset, 5)
    norm = NORM_SCALE[preset] * np.linalg.norm(sigma) + 1e-7
    f = _scalar_schedule(sigma, table, norm)
    np.testing.assert_allclose(out, (u * f) @ v.T, atol=2e-5)
    lo, hi = BANDS[preset]
    assert lo <= f.min() and f.max() <= hi
    assert np.linalg.norm(out - u @ v.T, 2) <= max(1 - lo, hi - 1)
    for wrong in (table[::-1], table[:, [0, 2, 1]], table[:, [1, 0, 2]]):
        if np.array_equal(wrong, table):  # "keller" repeats one row: reversing is a no-op
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # a wrong order may diverge
            g = _scalar_schedule(sigma, wrong, norm)
            assert not np.all(np.abs((u * g) @ v.T - out) <= 1e-2)
