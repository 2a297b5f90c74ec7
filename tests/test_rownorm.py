"""Projected RowNorm against a numpy fp64 reference and the exact oracles; invariances, edges."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rowgeom import project_rownorm, projected_rownorm
from rowgeom._rownorm import _blocked_path, _project_f32

IMPLS = ("auto", "native", "blocked", "reference")


# --- independent float64 references ---------------------------------------------------------------


def np_project(u, axis=0, *, eps=1e-8, center_input=True, center_output=True, num_valid=None):
    """P rownorm(P u) in float64, token rows along `axis`, every other axis a feature."""
    moved = np.moveaxis(np.asarray(u, np.float64), axis, 0)
    vocab = moved.shape[0]
    x = moved.reshape(vocab, -1)
    nv = vocab if num_valid is None else num_valid
    xv = x[:nv] - x[:nv].mean(axis=0) if center_input else x[:nv]
    yv = xv / np.maximum(np.linalg.norm(xv, axis=1, keepdims=True), eps)
    if center_output:
        yv = yv - yv.mean(axis=0)
    out = np.zeros_like(x)
    out[:nv] = yv
    return np.moveaxis(out.reshape(moved.shape), 0, axis)


def np_diameter(s):
    s = np.asarray(s, np.float64)
    return float(np.sqrt(((s[:, None, :] - s[None, :, :]) ** 2).sum(-1)).max())


def centred(g):
    g = np.asarray(g, np.float64)
    return g - g.mean(axis=0)


@functools.cache
def jitted(vocab_axis=0, eps=1e-8, center_input=True, center_output=True, num_valid=None,
           impl="auto"):
    return jax.jit(lambda u: _project_f32(
        u, vocab_axis=vocab_axis, eps=eps, center_input=center_input,
        center_output=center_output, num_valid=num_valid, argname="u", impl=impl))


def project(u, **kw):
    return np.asarray(jitted(**kw)(jnp.asarray(u, jnp.float32)), np.float64)


def step(g, r, **kw):
    """Theorem 2's step S = -r P rownorm(P G), (V, d) layout."""
    return -r * project(g, eps=1e-30, **kw)


# --- the reference, layouts, padding, dtypes ------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True), (False, False)])
def test_matches_float64_reference(rng, impl, flags):
    ci, co = flags
    cases = [((40, 6), 0), ((6, 40), 1), ((3, 40, 2), 1), ((3, 2, 40), -1)]
    for shape, axis in cases:
        u = rng.normal(size=shape) + 0.5
        got = project(u, vocab_axis=axis, center_input=ci, center_output=co, impl=impl)
        want = np_project(u, axis, center_input=ci, center_output=co)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"{shape} axis={axis}")


@pytest.mark.parametrize("block_rows", [1, 4, 7, 64])
@pytest.mark.parametrize("num_valid", [37, 29, 1])
def test_blocked_path_any_block_size(rng, block_rows, num_valid):
    """Full blocks (of token rows, or of feature rows for a (d, V) kernel), a tail block, one
    block, and padding: the same numbers as the reference, in both layouts."""
    u = rng.normal(size=(5, 37)).astype(np.float32)
    for x, axis in ((u, 1), (u.T, 0)):
        got = _blocked_path(jnp.asarray(x), axis, eps=1e-8, center_input=True,
                            center_output=True, num_valid=num_valid, block_rows=block_rows)
        np.testing.assert_allclose(np.asarray(got), np_project(x, axis, num_valid=num_valid),
                                   atol=2e-6, err_msg=f"vocab_axis={axis}")


def test_dense_layout_is_the_transpose_and_the_wrong_axis_is_caught(rng):
    """(d, V) with vocab_axis=1 is the transpose of (V, d) with vocab_axis=0."""
    g = rng.normal(size=(24, 24))  # square, so a wrong axis cannot hide behind a shape error
    dense = project(g.T, vocab_axis=1)
    embed = project(g, vocab_axis=0)
    np.testing.assert_allclose(dense, embed.T, atol=1e-6)
    np.testing.assert_allclose(embed, np_project(g, 0), atol=1e-6)
    wrong = project(g.T, vocab_axis=0)
    assert np.abs(wrong - embed.T).max() > 0.1
    np.testing.assert_allclose(project(g.T, vocab_axis=-1), dense, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_vocabulary(rng, impl):
    """Padding rows are excluded from both means and get zero, whatever they contain."""
    valid = rng.normal(size=(6, 27))
    garbage = np.concatenate([np.full((6, 3), 1e30), np.full((6, 2), np.nan)], axis=1)
    u = np.concatenate([valid, garbage], axis=1)  # (d, V) with V = 32, 27 valid
    got = project(u, vocab_axis=1, num_valid=27, impl=impl)
    assert np.all(got[:, 27:] == 0)
    np.testing.assert_allclose(got[:, :27], np_project(valid, 1), atol=2e-6)


def test_bfloat16_in_bfloat16_out_float32_inside(rng):
    u = jnp.asarray(rng.normal(size=(48, 8)) + 3.0, jnp.bfloat16)
    out = jax.jit(lambda u: project_rownorm(u, vocab_axis=0))(u)
    assert out.dtype == jnp.bfloat16 and out.shape == u.shape
    f32 = jax.jit(lambda u: project_rownorm(u, vocab_axis=0))(u.astype(jnp.float32))
    chex.assert_trees_all_equal(out, f32.astype(jnp.bfloat16))  # only the result is rounded
    want = np_project(np.asarray(u.astype(jnp.float32)), 0)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2**-7)


def test_large_common_row_plus_tiny_spread(rng):
    """Rows = big common vector + tiny noise: centring must not lose the noise's direction."""
    common = 1e3 * rng.normal(size=(1, 16))
    u = (common + 1e-2 * rng.normal(size=(64, 16))).astype(np.float32)
    want = np_project(u, 0)  # exact on the float32 input
    for impl in IMPLS:
        np.testing.assert_allclose(project(u, impl=impl), want, atol=1e-5, err_msg=impl)


def test_writes_in_place_over_a_donated_input():
    """CPU path: no full-size temporary, so a donated step costs about one read-write pass."""
    if jax.default_backend() != "cpu":
        pytest.skip("the memory layout claim is about the CPU path")
    spec = jax.ShapeDtypeStruct((16384, 256), jnp.float32)
    for axis, shape in [(0, spec.shape), (1, spec.shape[::-1])]:
        fn = jax.jit(lambda u, axis=axis: project_rownorm(u, vocab_axis=axis), donate_argnums=0)
        stats = fn.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().memory_analysis()
        assert stats.temp_size_in_bytes < 16384 * 256 * 4 // 2, stats


def test_multi_device_mesh_uses_the_slice_free_path():
    """The blocked CPU path slices the vocab axis; under a device mesh (vocabulary possibly
    sharded) the masked formulation is used, which only all-reduces d-vectors (run in
    tests/test_sharding.py)."""
    spec = jax.ShapeDtypeStruct((200_000, 16), jnp.float32)
    fn = lambda u: project_rownorm(u, vocab_axis=0)
    blocked = lambda u: _project_f32(u, vocab_axis=0, eps=1e-8, center_input=True,
                                     center_output=True, num_valid=None, argname="u",
                                     impl="blocked")
    assert "rowgeom_rownorm_cpu" in str(jax.make_jaxpr(fn)(spec))  # the native kernel
    assert "dynamic_slice" in str(jax.make_jaxpr(blocked)(spec))  # several blocks: a loop
    mesh = jax.sharding.AbstractMesh((8,), ("vocab",),
                                     axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(fn)(spec))
    assert "dynamic_slice" not in jaxpr and "platform_index" not in jaxpr
    assert "rowgeom_rownorm_cpu" not in jaxpr


def _entry_ops(compiled_text):
    """Op name -> count in the entry computation of optimized HLO text."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    ops = re.findall(r"= \S+ ([a-z][\w-]*)\(", entry)
    return {op: ops.count(op) for op in set(ops)}


@pytest.mark.parametrize("num_valid", [None, 200])
def test_accelerator_path_is_a_few_fusions_in_both_layouts(num_valid):
    """GPU/TPU run the masked formulation: a fixed handful of fused reductions and one
    elementwise write, the same for a (V, d) table and a (d, V) kernel and at any size, with
    no loop, slice or branch that depends on the layout."""
    def fn(impl, axis):
        return jax.jit(lambda u: _project_f32(
                u, vocab_axis=axis, eps=1e-8, center_input=True, center_output=True,
                num_valid=num_valid, argname="u", impl=impl))

    counts = {}
    for vocab, dim in ((256, 32), (1024, 96)):
        for axis, shape in ((0, (vocab, dim)), (1, (dim, vocab))):
            spec = jax.ShapeDtypeStruct(shape, jnp.float32)
            # What an accelerator is handed: "auto" lowered for CUDA/TPU is the masked formulation.
            for platform in ("cuda", "tpu"):
                text = fn("auto", axis).trace(spec).lower(lowering_platforms=(platform,)).as_text()
                assert "stablehlo.while" not in text and "dynamic_slice" not in text, platform
                assert text.count("stablehlo.reduce") == fn("reference", axis).trace(spec).lower(
                        lowering_platforms=(platform,)).as_text().count("stablehlo.reduce")
            ops = _entry_ops(fn("reference", axis).lower(spec).compile().as_text())
            assert not {"while", "conditional", "copy", "transpose"} & set(ops), ops
            counts[shape] = ops["fusion"]
    assert len(set(counts.values())) == 1, counts  # same count: both layouts, both sizes
    assert next(iter(counts.values())) <= 16, counts


# --- Optimality against the exact oracles ---------------------------------------------------------


def test_t4_gauge_diameter_and_value(rng):
    g = rng.normal(size=(30, 5)) + rng.normal(size=(1, 5))
    g[3] = 0.0
    r = 0.37
    s = step(g, r)
    np.testing.assert_allclose(s.sum(axis=0), 0, atol=1e-6)
    assert np_diameter(s) <= 2 * r * (1 + 1e-5)
    value = np.linalg.norm(centred(g), axis=1).sum()
    np.testing.assert_allclose(-(g * s).sum(), r * value, rtol=1e-5)


def test_t6_equals_the_common_ball_optimum(rng):
    oracle = pytest.importorskip("rowgeom._oracle")
    pytest.importorskip("clarabel")
    r = 0.5
    for shape in [(6, 3), (11, 4)]:
        g = rng.normal(size=shape)
        s = step(g, r)
        s_ref, value = oracle.common_ball_oracle(g, r)
        np.testing.assert_allclose(-(g * s).sum(), value, rtol=1e-5)
        np.testing.assert_allclose(s, s_ref, atol=1e-4)  # unique: every row of PG is non-zero
        # Random feasible points: rows in a common ball of radius r, gauge 1^T S = 0.
        for _ in range(200):
            z = rng.normal(size=shape)
            z *= r * rng.uniform(size=(shape[0], 1)) ** (1 / shape[1]) / np.linalg.norm(
                z, axis=1, keepdims=True)
            z -= z.mean(axis=0)
            assert -(g * z).sum() <= value * (1 + 1e-9)


def jung(k):
    return np.sqrt((k + 1) / (2 * k))


@pytest.mark.slow
def test_t7_within_jungs_factor_of_the_exact_diameter_optimum(rng):
    oracle = pytest.importorskip("rowgeom._oracle")
    pytest.importorskip("clarabel")
    rho = 1.0
    cases = [rng.normal(size=(8, 2)), rng.normal(size=(7, 3)),
             rng.normal(size=(9, 1)) @ rng.normal(size=(1, 4))]  # rank 1: ratio exactly 1
    for g in cases:
        k = np.linalg.matrix_rank(centred(g))
        _, opt = oracle.diameter_oracle(g, rho)
        s = step(g, rho / 2)
        decrease = -(g * s).sum()
        assert np_diameter(s) <= rho * (1 + 1e-5)
        assert jung(k) * (1 - 1e-4) <= decrease / opt <= 1 + 1e-4
        if k == 1:
            np.testing.assert_allclose(decrease / opt, 1, rtol=1e-4)
        # Beyond the paper: S * rho / D(S) is still feasible and never worse.
        tx = projected_rownorm(vocab_axis=0, eps=1e-30, rescale="exact")
        s_big = -(rho / 2) * np.asarray(tx.update(jnp.asarray(g, jnp.float32), None)[0],
                                        np.float64)
        assert decrease * (1 - 1e-5) <= -(g * s_big).sum() <= opt * (1 + 1e-4)
        np.testing.assert_allclose(np_diameter(s_big), rho, rtol=1e-5)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_t7_regular_simplex_attains_jungs_factor(k):
    oracle = pytest.importorskip("rowgeom._oracle")
    pytest.importorskip("clarabel")
    g = np.eye(k + 1) - 1.0 / (k + 1)  # k+1 rows: a regular simplex spanning k dimensions
    _, opt = oracle.diameter_oracle(g, 1.0)
    decrease = -(g * step(g, 0.5)).sum()
    np.testing.assert_allclose(decrease / opt, jung(k), rtol=1e-4)


# --- Invariances and degenerate input -------------------------------------------------------------

SHAPE = (16, 6)


def _draw(seed):
    rng = np.random.default_rng(seed)
    return rng, rng.normal(size=SHAPE) * rng.uniform(0.1, 10)


@given(st.integers(0, 2**32 - 1))
def test_t5_token_permutation_equivariance(seed):
    rng, g = _draw(seed)
    perm = rng.permutation(SHAPE[0])
    np.testing.assert_allclose(project(g[perm]), project(g)[perm], atol=1e-5)


@given(st.integers(0, 2**32 - 1))
def test_t5_feature_rotation_equivariance(seed):
    rng, g = _draw(seed)
    q, _ = np.linalg.qr(rng.normal(size=(SHAPE[1], SHAPE[1])))
    np.testing.assert_allclose(project(g @ q), project(g) @ q, atol=1e-5)


@given(st.integers(0, 2**32 - 1), st.floats(1e-3, 1e3))
def test_t5_shift_and_scale_invariance(seed, scale):
    rng, g = _draw(seed)
    c = rng.normal(size=(1, SHAPE[1])) * rng.uniform(0, 10)
    base = project(g)
    np.testing.assert_allclose(project(g + c), base, atol=1e-5)
    np.testing.assert_allclose(project(scale * g), base, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_t8_degenerate_input(rng, impl):
    c = rng.normal(size=(1, 5)) * 100
    rows = np.repeat(c, 9, axis=0)
    assert np.all(project(rows, impl=impl) == 0)  # G = 1c^T: exactly zero
    assert np.all(project(np.zeros((9, 5)), impl=impl) == 0)
    assert np.all(project(c, impl=impl) == 0)  # V = 1
    assert np.all(project(c.T, vocab_axis=1, impl=impl) == 0)
    g = rng.normal(size=(9, 5))
    g[[2, 5]] = 0.0
    plain = project(g, center_input=False, center_output=False, impl=impl)
    assert np.all(np.isfinite(plain)) and np.all(plain[[2, 5]] == 0)
    for eps in [1e-30, 1e-8, 0.5, 10.0]:
        tiny = g * 1e-3
        for x in (g, tiny):
            y = project(x, eps=eps, center_output=False, impl=impl)
            assert np.all(np.isfinite(y))
            assert np.linalg.norm(y, axis=1).max() <= 1 + 1e-6


# --- Momentum commutes with centring; optax integration -------------------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
def test_t10_centring_commutes_with_momentum(rng, nesterov):
    grads = [jnp.asarray(rng.normal(size=(5, 12)) + 2.0, jnp.float32) for _ in range(4)]
    def run(gs, tx):
        state = tx.init(gs[0])
        update = jax.jit(tx.update)
        outs = []
        for g in gs:
            u, state = update(g, state)
            outs.append(np.asarray(u, np.float64))
        return outs

    momentum = optax.trace(decay=0.9, nesterov=nesterov)
    centre = lambda g: g - g.mean(axis=1, keepdims=True)  # (d, V): tokens on axis 1
    raw = run(grads, momentum)
    pre = run([centre(g) for g in grads], momentum)
    for a, b in zip(raw, pre, strict=True):
        np.testing.assert_allclose(centre(a), b, atol=1e-6)  # P M(G) = M(P G)
    tx = optax.chain(momentum, projected_rownorm(vocab_axis=1))
    for a, b in zip(run(grads, tx), run([centre(g) for g in grads], tx), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _params(rng):
    return {
        "head": {"kernel": jnp.asarray(rng.normal(size=(6, 20)), jnp.float32),
                 "bias": jnp.asarray(rng.normal(size=(20,)), jnp.float32)},
        "embed": jnp.asarray(rng.normal(size=(20, 6)), jnp.bfloat16),
        "norm": None,
    }


def test_transform_tree_prefix_callable_and_no_retrace(rng):
    params = _params(rng)
    want_head = np_project(params["head"]["kernel"], 1)
    want_embed = np_project(np.asarray(params["embed"].astype(jnp.float32)), 0)
    prefixes = [
        {"head": {"kernel": 1, "bias": None}, "embed": 0, "norm": None},
        lambda p: {"head": {"kernel": 1, "bias": None}, "embed": 0, "norm": None},
    ]
    for vocab_axis in prefixes:
        tx = projected_rownorm(vocab_axis=vocab_axis)
        state = tx.init(params)
        traces = []

        @jax.jit
        def update(u, state, p, tx=tx, traces=traces):
            traces.append(1)
            return tx.update(u, state, p)

        for _ in range(2):
            out, state = update(params, state, params)
        assert len(traces) == 1  # the second step reuses the compiled update
        np.testing.assert_allclose(out["head"]["kernel"], want_head, atol=2e-6)
        chex.assert_trees_all_equal(out["head"]["bias"], params["head"]["bias"])
        assert out["embed"].dtype == jnp.bfloat16 and out["norm"] is None
        np.testing.assert_allclose(np.asarray(out["embed"], np.float64), want_embed, atol=2**-7)
    tx = projected_rownorm(vocab_axis=0)
    assert jax.eval_shape(tx.init, params) == optax.EmptyState()
    out = jax.eval_shape(tx.update, {"w": params["embed"]}, optax.EmptyState())[0]
    assert out["w"].shape == (20, 6) and out["w"].dtype == jnp.bfloat16


def test_inside_partition_and_chain(rng):
    params = _params(rng)
    del params["norm"]
    labels = {"head": {"kernel": "head", "bias": "other"}, "embed": "other"}
    lr = 0.1
    tx = optax.partition(
        {"head": optax.chain(optax.trace(0.9), projected_rownorm(vocab_axis=1),
                             optax.scale_by_learning_rate(lr)),
         "other": optax.sgd(lr)},
        labels)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: x * 2, params)
    out, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_allclose(out["head"]["kernel"],
                               -lr * np_project(2 * params["head"]["kernel"], 1), atol=1e-6)
    chex.assert_trees_all_close(out["head"]["bias"], -lr * grads["head"]["bias"])
    # The callable form sees MaskedNode leaves for the other partition.
    head_only = optax.partition(
        {"head": projected_rownorm(vocab_axis=lambda p: jax.tree.map(lambda x: 1, p)),
         "other": optax.identity()}, labels)
    out = jax.jit(head_only.update)(grads, head_only.init(params), params)[0]
    np.testing.assert_allclose(out["head"]["kernel"],
                               np_project(grads["head"]["kernel"], 1), atol=2e-6)
    chex.assert_trees_all_equal(out["embed"], grads["embed"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "bound"])
def test_rescale(rng, mode):
    g = jnp.asarray(rng.normal(size=(5, 30)), jnp.float32)
    tx = projected_rownorm(vocab_axis=1, rescale=mode)
    out = np.asarray(jax.jit(tx.update)(g, tx.init(g))[0], np.float64)
    base = np_project(g, 1)
    factor = float(np.vdot(out, base) / np.vdot(base, base))  # a positive multiple of base:
    assert factor > 0                                          # (entrywise ratios would blow
    np.testing.assert_allclose(out, factor * base, atol=2e-6 * factor)  # up near zero)
    diameter = np_diameter(out.T)
    if mode == "exact":
        np.testing.assert_allclose(diameter, 2, rtol=1e-5)
    else:
        assert 1 - 1e-5 <= diameter <= 2 * (1 + 1e-5)
    padded = jnp.concatenate([g, jnp.full((5, 4), 7.0)], axis=1)
    tx_pad = projected_rownorm(vocab_axis=1, rescale=mode, num_valid=30)
    out_pad = np.asarray(tx_pad.update(padded, None)[0], np.float64)
    np.testing.assert_allclose(out_pad[:, :30], out, atol=1e-5)
    assert np.all(out_pad[:, 30:] == 0)
    constant = jnp.ones((5, 30), jnp.float32)  # D = 0: no 0/0
    assert np.all(np.asarray(tx.update(constant, None)[0]) == 0)


# --- bad input ------------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    u = jnp.ones((4, 3))
    with pytest.raises(TypeError, match="u must have a real floating"):
        project_rownorm(jnp.ones((4, 3), jnp.int32), vocab_axis=0)
    with pytest.raises(TypeError, match="u must have a real floating"):
        project_rownorm(jnp.ones((4, 3), jnp.complex64), vocab_axis=0)
    with pytest.raises(ValueError, match="u must have rank >= 2"):
        project_rownorm(jnp.ones((4,)), vocab_axis=0)
    with pytest.raises(ValueError, match="vocab_axis=2 is out of range"):
        project_rownorm(u, vocab_axis=2)
    with pytest.raises(TypeError, match="vocab_axis must be an int"):
        project_rownorm(u, vocab_axis="rows")
    for eps in [0.0, -1.0, float("nan"), 1e-45]:
        with pytest.raises(ValueError, match="eps must be"):
            project_rownorm(u, vocab_axis=0, eps=eps)
    for num_valid in [0, 5]:
        with pytest.raises(ValueError, match="num_valid must satisfy"):
            project_rownorm(u, vocab_axis=0, num_valid=num_valid)
    with pytest.raises(TypeError, match="num_valid must be an int"):
        project_rownorm(u, vocab_axis=0, num_valid=2.5)
    with pytest.raises(ValueError, match="rescale must be one of"):
        projected_rownorm(vocab_axis=0, rescale="full")
    with pytest.raises(ValueError, match="eps must be"):
        projected_rownorm(vocab_axis=0, eps=0)
    # inject_hyperparams turns every non-static argument into an array: say what to do.
    for argname, static in (("eps", ("vocab_axis",)), ("num_valid", ("vocab_axis", "eps"))):
        injected = optax.inject_hyperparams(projected_rownorm, static_args=static)(
            vocab_axis=0, num_valid=3)
        with pytest.raises(TypeError, match=f"{argname} must be a Python .* static_args"):
            jax.jit(injected.init)(u)
        injected.init(u)  # eagerly the injected values are concrete: accepted
    tx = projected_rownorm(vocab_axis=0)
    with pytest.raises(TypeError, match=r"leaf \['w'\].*updates must have a real floating"):
        tx.update({"w": jnp.ones((4, 3), jnp.int32)}, optax.EmptyState())
    with pytest.raises(ValueError, match=r"leaf \['b'\].*updates must have rank >= 2"):
        tx.update({"b": jnp.ones((3,))}, optax.EmptyState())
