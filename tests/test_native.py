"""The native CPU kernel of projected RowNorm (rowgeom/csrc/rownorm.cc via rowgeom/_native.py):
its result against a float64 reference and the XLA formulation, the in-place write, vmap,
differentiation, the build cache, and the fallback when it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rowgeom import _native, project_rownorm
from rowgeom._rownorm import _project_f32

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def np_project(u, axis, num_valid=None, center_input=True, center_output=True, eps=1e-8):
    """float64 reference: rows along `axis`, rows >= num_valid are padding (zero out)."""
    x = np.moveaxis(np.asarray(u, np.float64), axis, 0)
    shape = x.shape
    x = x.reshape(shape[0], -1)
    n = x.shape[0] if num_valid is None else num_valid
    v = x[:n]
    if center_input:
        v = v - v.mean(axis=0)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), eps)
    if center_output:
        v = v - v.mean(axis=0)
    out = np.zeros_like(x)
    out[:n] = v
    return np.moveaxis(out.reshape(shape), 0, axis)


def run(u, impl, **kw):
    kw = {"eps": 1e-8, "center_input": True, "center_output": True, "num_valid": None} | kw
    fn = jax.jit(lambda u: _project_f32(u, argname="u", impl=impl, **kw))
    return np.asarray(fn(jnp.asarray(u, jnp.float32)), np.float64)


def test_kernel_is_built_and_used_by_default():
    assert _native.available()
    for axis, shape in [(0, (64, 8)), (1, (8, 64)), (-1, (2, 4, 64)), (0, (64, 2, 4))]:
        spec = jax.ShapeDtypeStruct(shape, jnp.float32)
        hlo = jax.jit(lambda u, a=axis: project_rownorm(u, vocab_axis=a)).lower(spec).as_text()
        assert "rowgeom_rownorm_cpu" in hlo, (shape, axis)
    # a middle vocabulary axis keeps the XLA formulation
    spec = jax.ShapeDtypeStruct((2, 64, 4), jnp.float32)
    hlo = jax.jit(lambda u: project_rownorm(u, vocab_axis=1)).lower(spec).as_text()
    assert "rowgeom_rownorm_cpu" not in hlo


# Shapes chosen for the kernel's edges: one row, one feature, rows fewer than threads, features
# not a multiple of its 16 lanes, several 64-row blocks with a partial last one.
SHAPES = [((1, 5), 0), ((2, 1), 0), ((3, 17), 0), ((200, 33), 0), ((131, 2, 3), 0),
          ((33, 200), 1), ((1, 7), 1), ((17, 3), 1), ((2, 3, 131), -1)]


@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True), (False, False)])
def test_matches_float64_reference_and_the_xla_formulation(rng, flags):
    ci, co = flags
    for shape, axis in SHAPES:
        u = rng.normal(size=shape) * 3.0 + 0.5
        vocab = shape[axis]
        for nv in sorted({vocab, max(1, vocab // 2), 1}):
            kw = dict(vocab_axis=axis, center_input=ci, center_output=co, num_valid=nv)
            got = run(u, "native", **kw)
            want = np_project(u, axis, num_valid=nv, center_input=ci, center_output=co)
            np.testing.assert_allclose(got, want, atol=3e-6, err_msg=f"{shape} {axis} {nv}")
            np.testing.assert_allclose(got, run(u, "blocked", **kw), atol=3e-6)


def test_padding_rows_may_hold_anything(rng):
    u = rng.normal(size=(40, 24))
    u[30:] = np.nan
    u[35:, :3] = np.inf
    for axis, x in [(0, u), (1, u.T)]:
        got = run(x, "native", vocab_axis=axis, num_valid=30)
        np.testing.assert_allclose(got, np_project(np.nan_to_num(x), axis, num_valid=30),
                                   atol=3e-6)


def test_large_common_row_plus_tiny_spread(rng):
    """The pivot keeps centring accurate when every row is a big common vector plus noise."""
    u = (1e4 + 1e-2 * rng.normal(size=(300, 40))).astype(np.float32)  # the input as stored
    for axis, x in [(0, u), (1, u.T)]:
        np.testing.assert_allclose(run(x, "native", vocab_axis=axis), np_project(x, axis),
                                   atol=1e-4)


@pytest.mark.parametrize("scale", [1e30, 1e37, 1e-12])
def test_huge_and_tiny_inputs_follow_the_float64_reference(rng, scale):
    """Squared norms of entries ~1e30 overflow float32: the guard rescales by a power of two.
    Rows below eps (1e-8) are divided by eps, as the reference does."""
    u = rng.normal(size=(50, 12))
    for axis, x in [(0, u), (1, u.T)]:
        got = run(x * scale, "native", vocab_axis=axis)
        assert np.all(np.isfinite(got))
        want = np_project(np.float32(x * scale), axis)
        np.testing.assert_allclose(got, want, atol=3e-6 * max(1.0, float(np.abs(want).max())))


def test_non_finite_input_matches_the_xla_formulation(rng):
    u = rng.normal(size=(20, 9))
    for bad in (np.nan, np.inf, -np.inf):
        x = u.copy()
        x[3, 4] = bad
        for axis, v in [(0, x), (1, x.T)]:
            got, want = run(v, "native", vocab_axis=axis), run(v, "blocked", vocab_axis=axis)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            assert not np.all(np.isfinite(got))  # never a silently finite wrong answer


def test_zero_and_identical_rows_give_zero(rng):
    for axis in (0, 1):
        assert np.all(run(np.zeros((9, 5)), "native", vocab_axis=axis) == 0)
    rows = np.tile(rng.normal(size=(1, 7)), (12, 1))
    assert np.all(run(rows, "native", vocab_axis=0) == 0)
    assert np.all(run(rows.T, "native", vocab_axis=1) == 0)


def test_writes_in_place_over_a_donated_input(rng):
    for shape, axis in [((4096, 64), 0), ((64, 4096), 1)]:
        fn = jax.jit(lambda u, a=axis: project_rownorm(u, vocab_axis=a), donate_argnums=0)
        x = jnp.asarray(rng.normal(size=shape), jnp.float32)
        want = np_project(np.asarray(x), axis)
        pointer = x.unsafe_buffer_pointer()
        y = fn(x)
        assert y.unsafe_buffer_pointer() == pointer  # the same buffer, overwritten
        np.testing.assert_allclose(np.asarray(y), want, atol=3e-6)
        stats = fn.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().memory_analysis()
        assert stats.temp_size_in_bytes < np.prod(shape) * 4 // 2, stats
    # without donation the input is kept (XLA copies before the in-place kernel)
    x = jnp.asarray(rng.normal(size=(100, 8)), jnp.float32)
    before = np.asarray(x).copy()
    jax.jit(lambda u: project_rownorm(u, vocab_axis=0))(x)
    np.testing.assert_array_equal(np.asarray(x), before)


def test_vmap_and_grad(rng):
    u = jnp.asarray(rng.normal(size=(3, 30, 6)), jnp.float32)
    got = jax.vmap(lambda x: project_rownorm(x, vocab_axis=0))(u)
    for i in range(3):
        np.testing.assert_allclose(got[i], np_project(u[i], 0), atol=3e-6)

    def loss(impl):
        return lambda x: jnp.sum(jnp.sin(_project_f32(
            x, vocab_axis=0, eps=1e-8, center_input=True, center_output=True, num_valid=None,
            argname="u", impl=impl)))

    np.testing.assert_allclose(jax.grad(loss("native"))(u[0]), jax.grad(loss("reference"))(u[0]),
                               atol=1e-5)


def test_build_is_cached_keyed_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("ROWGEOM_CACHE_DIR", str(tmp_path))
    compiler = _native._compiler()
    first = _native._build(compiler)
    assert first.parent == tmp_path and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert _native._build(compiler) == first and first.stat().st_mtime_ns == mtime  # cached
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    monkeypatch.setattr(_native, "_FLAGS", (*_native._FLAGS, "-DROWGEOM_OTHER_KEY"))
    assert _native._build(compiler) != first  # other flags: another library


def test_a_failed_build_names_the_command_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ROWGEOM_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        _native._build("/bin/false")
    assert list(tmp_path.iterdir()) == []


def test_fallback_warns_once_and_gives_the_same_result(rng, monkeypatch):
    u = rng.normal(size=(30, 7))
    want = run(u, "native", vocab_axis=0)
    monkeypatch.setattr(_native, "_load", lambda: "no C++ compiler (test)")
    _native._warn_once.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C.. compiler .test.*ROWGEOM_NATIVE=0"):
            got = np.asarray(project_rownorm(jnp.asarray(u, jnp.float32), vocab_axis=0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the second trace is silent
            jax.jit(lambda x: project_rownorm(x, vocab_axis=0))(jnp.zeros((31, 7)))
        with pytest.raises(RuntimeError, match="impl='native'"):
            run(u, "native", vocab_axis=0)
    finally:
        _native._warn_once.cache_clear()
    np.testing.assert_allclose(got, want, atol=3e-6)


def test_environment_switch_and_missing_compiler_in_a_fresh_process(tmp_path):
    """ROWGEOM_NATIVE=0: silently the XLA formulation. No compiler: one warning, same result."""
    script = textwrap.dedent("""
        import warnings, jax, jax.numpy as jnp, numpy as np, rowgeom
        from rowgeom import _native
        x = jnp.asarray(np.random.default_rng(0).normal(size=(40, 6)), jnp.float32)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            hlo = jax.jit(lambda u: rowgeom.project_rownorm(u, vocab_axis=0)).lower(x).as_text()
            y = rowgeom.project_rownorm(x, vocab_axis=0)
        print(_native.available(), "rowgeom_rownorm_cpu" in hlo, len(w),
              [str(m.message)[:200] for m in w], float(jnp.abs(y.sum(0)).max()) < 1e-5)
    """)
    env = {**os.environ, "ROWGEOM_CACHE_DIR": str(tmp_path)}
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**env, "ROWGEOM_NATIVE": "0"}, timeout=120)
    assert off.stdout.startswith("False False 0 [] True"), off.stdout + off.stderr
    none = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**env, "CXX": "no-such-compiler"}, timeout=120)
    assert none.stdout.startswith("False False 1 "), none.stdout + none.stderr
    assert "no-such-compiler" in none.stdout and none.stdout.rstrip().endswith("True")


# --- the row-diameter bracket (csrc/bracket.cc) ------------------------------------------------


BRACKET_SHAPES = [((300, 17), 0), ((17, 300), 1), ((3, 4, 130), -1), ((130, 3, 4), 0),
                  ((2, 1), 0), ((1, 5), 0), ((1, 7), 1)]


@pytest.mark.parametrize("sweeps", [0, 2])
def test_bracket_matches_the_xla_formulation_and_brackets_the_diameter(rng, sweeps):
    from rowgeom._geometry import _bounds3, _bounds_and_sum, _three_axes

    for shape, axis in BRACKET_SHAPES:
        x = jnp.asarray(rng.normal(size=shape) * 2.0 + 1.5, jnp.float32)
        axis = axis % x.ndim
        lower, upper, row_sum = _bounds_and_sum(x, axis=axis, sweeps=sweeps)
        hlo = _bounds_and_sum.lower(x, axis=axis, sweeps=sweeps).as_text()
        assert "rowgeom_bracket_cpu" in hlo, shape
        want_lower, want_upper = jax.jit(
            lambda x, a=axis: _bounds3(_three_axes(x, a), sweeps=sweeps))(x)
        np.testing.assert_allclose(float(upper), float(want_upper), rtol=2e-6, err_msg=shape)
        np.testing.assert_allclose(float(lower), float(want_lower), rtol=2e-6, err_msg=shape)
        np.testing.assert_allclose(row_sum, np.asarray(x, np.float64).sum(axis), rtol=1e-5,
                                   atol=1e-4)
        rows = np.moveaxis(np.asarray(x, np.float64), axis, 0).reshape(shape[axis], -1)
        exact = max((np.linalg.norm(rows[:, None] - rows[None], axis=-1)).max(), 0.0)
        assert float(lower) <= exact * (1 + 1e-5) + 1e-6 and exact <= float(upper) * (1 + 1e-5)


def test_bracket_non_finite_and_huge_rows(rng):
    """NaN anywhere gives NaN bounds (never a finite wrong answer); entries ~1e30 overflow the
    squares, and the caller's power-of-two rescaling keeps the bounds exact."""
    import rowgeom

    for axis in (0, 1):
        x = rng.normal(size=(40, 9))
        x = x if axis == 0 else x.T
        bad = x.copy()
        bad[(3, 4) if axis == 0 else (4, 3)] = np.nan
        lower, upper = rowgeom.row_diameter_bounds(jnp.asarray(bad, jnp.float32), vocab_axis=axis)
        assert np.isnan(float(lower)) and np.isnan(float(upper))
        small = rowgeom.row_diameter_bounds(jnp.asarray(x, jnp.float32), vocab_axis=axis)
        big = rowgeom.row_diameter_bounds(jnp.asarray(x * 1e30, jnp.float32), vocab_axis=axis)
        np.testing.assert_allclose(np.asarray(big, np.float64) / 1e30, small, rtol=1e-5)
