"""muon_orthogonalize: matrices of every layout, grouping, scaling, optax integration, errors."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rowgeom import MuonDimensionNumbers, muon_orthogonalize, newton_schulz, ns_coefficients

KELLER_TABLE = ns_coefficients("keller", 5)


def ns_reference(g, table=KELLER_TABLE, eps=1e-7):
    """fp64 Newton–Schulz on one matrix (same iteration, independent code)."""
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in table:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def randn(rng, *shape):
    """Standard normal float32, as a numpy array: jnp's conversion (and every eager jnp
    operation on the result) would compile a program per shape."""
    return rng.standard_normal(shape).astype(np.float32)


def first_updates(*calls):
    """The first update from a fresh state of each (transform, updates) pair, from one jitted
    program: one compile per call, not one per pair (eagerly, every operation of the
    Newton–Schulz iteration would compile on its own). Each transform's update is traced on
    its own, as `tx.update` runs it; results come back as numpy float32."""
    txs = [tx for tx, _ in calls]
    outs = jax.jit(lambda trees: [tx.update(u, tx.init(u))[0]
                                  for tx, u in zip(txs, trees, strict=True)])(
        [u for _, u in calls])
    return jax.tree.map(np.asarray, outs)


def apply(tx, updates):
    """The first update of one transform from a fresh state (one compile)."""
    return first_updates((tx, updates))[0]


SCALES = [None, "none", "rms", "spectral", "keller"]


@functools.cache
def _scaled():
    """`muon_orthogonalize(scale=s, rms_scale=0.3)` for every s of SCALES, in one jitted
    program shared by the scale tests (XLA computes their common iteration once)."""
    txs = [muon_orthogonalize(scale=scale, rms_scale=0.3) for scale in SCALES]
    return jax.jit(lambda g: [tx.update(g, tx.init(g))[0] for tx in txs])


@pytest.mark.parametrize("scale, factor", [
    (None, lambda m, n: 1.0),
    ("none", lambda m, n: 1.0),
    ("rms", lambda m, n: 0.3 * math.sqrt(max(m, n))),
    ("spectral", lambda m, n: math.sqrt(n / m)),
    ("keller", lambda m, n: math.sqrt(max(1.0, n / m))),
])
def test_rank2_default_and_scales(rng, scale, factor):
    g = {"wide": randn(rng, 8, 24), "tall": randn(rng, 24, 8)}
    out = _scaled()(g)[SCALES.index(scale)]
    for k, x in g.items():
        m, n = x.shape  # reduction axis 0 (fan-in), output axis 1 (fan-out)
        np.testing.assert_allclose(out[k], factor(m, n) * ns_reference(x), rtol=1e-5, atol=1e-5)


def test_rms_scale_gives_target_rms(rng):
    g = {"w": randn(rng, 16, 64)}
    out = apply(muon_orthogonalize(ns_coeffs="polar_express", ns_steps=8, rms_scale=0.2), g)
    # With 8 Polar Express steps the polar factor is near exact, so the RMS is ~rms_scale.
    np.testing.assert_allclose(np.sqrt(np.mean(np.float64(out["w"]) ** 2)), 0.2, rtol=1e-3)


def test_sign_is_kept(rng):
    g = {"w": randn(rng, 8, 24)}
    tx = muon_orthogonalize()
    negated, plain = first_updates((tx, {"w": -g["w"]}), (tx, g))
    chex.assert_trees_all_close(negated, {"w": -plain["w"]}, atol=1e-6)
    # Positive alignment with the incoming update, as for optax scale_by_* transforms.
    assert float(np.sum(plain["w"] * g["w"])) > 0


def test_stacked_layers_scale_per_matrix(rng):
    g = randn(rng, 3, 8, 20)  # (L, in, out)
    tx = muon_orthogonalize(dimension_numbers=MuonDimensionNumbers(1, 2))
    single = muon_orthogonalize()
    stacked, *alone = first_updates((tx, {"w": g}), *((single, {"w": x}) for x in g))
    out = stacked["w"]
    for layer in range(3):
        np.testing.assert_allclose(out[layer], alone[layer]["w"], atol=1e-6)
        np.testing.assert_allclose(out[layer], 0.2 * math.sqrt(20) * ns_reference(g[layer]),
                                   atol=1e-5)


def test_grouping_equals_per_leaf(rng):
    g = {"a": randn(rng, 8, 24), "b": randn(rng, 8, 24), "c": randn(rng, 24, 8),
         "d": randn(rng, 12, 12), "stack": randn(rng, 2, 8, 24)}
    dims = {"a": MuonDimensionNumbers(), "b": MuonDimensionNumbers(), "c": MuonDimensionNumbers(),
            "d": MuonDimensionNumbers(), "stack": MuonDimensionNumbers(1, 2)}
    tx = muon_orthogonalize(scale="spectral", dimension_numbers=dims)
    # The grouped update and each leaf's own transform, in one program (one compile, not six).
    grouped, *alone = first_updates(
        (tx, g), *((muon_orthogonalize(scale="spectral", dimension_numbers=dims[k]), {k: x})
                   for k, x in g.items()))
    for k, single in zip(g, alone, strict=True):
        # Fused differently: float32 rounding, amplified by the iteration.
        np.testing.assert_allclose(grouped[k], single[k], atol=5e-6)
    np.testing.assert_allclose(grouped["c"], math.sqrt(8 / 24) * ns_reference(g["c"]),
                               atol=1e-5)


def test_per_head_dimension_numbers(rng):
    d, heads, head_dim = 16, 3, 8
    g = randn(rng, d, heads, head_dim)
    # Negative axes and output-before-reduction layouts (an output projection (H, Dh, d)).
    o = randn(rng, heads, head_dim, d)
    per_head, fused, out = (tree[k] for k, tree in zip("qqo", first_updates(  # one compile
        (muon_orthogonalize(dimension_numbers=MuonDimensionNumbers((0,), (2,))), {"q": g}),
        (muon_orthogonalize(dimension_numbers=MuonDimensionNumbers(0, (1, 2))), {"q": g}),
        (muon_orthogonalize(dimension_numbers=MuonDimensionNumbers((-3, -2), -1)), {"o": o})),
        strict=True))
    for h in range(heads):
        np.testing.assert_allclose(per_head[:, h, :],
                                   0.2 * math.sqrt(16) * ns_reference(g[:, h, :]), atol=1e-5)
    manual = 0.2 * math.sqrt(24) * ns_reference(g.reshape(d, heads * head_dim))
    np.testing.assert_allclose(fused, manual.reshape(d, heads, head_dim), atol=1e-5)
    manual = 0.2 * math.sqrt(24) * ns_reference(o.reshape(heads * head_dim, d))
    np.testing.assert_allclose(out, manual.reshape(heads, head_dim, d), atol=1e-5)


def test_none_leaves_and_none_dimension_numbers_pass_through(rng):
    g = {"w": randn(rng, 8, 12), "bias": randn(rng, 12), "missing": None,
         "block": {"x": randn(rng, 4, 4, 4), "y": randn(rng, 5)}}
    dims = {"w": MuonDimensionNumbers(), "bias": None, "missing": MuonDimensionNumbers(),
            "block": None}  # a prefix: None covers the whole block
    out = apply(muon_orthogonalize(dimension_numbers=dims), g)
    assert out["missing"] is None
    for path in (("bias",), ("block", "x"), ("block", "y")):
        a, b = g, out
        for key in path:
            a, b = a[key], b[key]
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(out["w"], 0.2 * math.sqrt(12) * ns_reference(g["w"]), atol=1e-5)


def test_callable_dimension_numbers(rng):
    g = {"w": randn(rng, 8, 12), "stack": randn(rng, 2, 8, 12), "b": randn(rng, 12)}
    rule = lambda tree: jax.tree.map(
            lambda x: MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if x.ndim >= 2 else None, tree)
    single = muon_orthogonalize()
    out, *alone = first_updates((muon_orthogonalize(dimension_numbers=rule), g),
                                *((single, {"w": x}) for x in (g["w"], *g["stack"])))
    np.testing.assert_array_equal(out["b"], g["b"])
    np.testing.assert_allclose(out["w"], alone[0]["w"], atol=1e-6)
    for layer in range(2):
        np.testing.assert_allclose(out["stack"][layer], alone[1 + layer]["w"], atol=1e-6)


def test_same_shape_leaves_share_one_newton_schulz(rng):
    """Grouping: 3 leaves of one (oriented) shape run one batched iteration, not three."""
    g = {"a": randn(rng, 8, 24), "b": randn(rng, 8, 24), "c": randn(rng, 24, 8)}
    tx = muon_orthogonalize()
    jaxpr = jax.make_jaxpr(tx.update)(g, optax.EmptyState())
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 * 5  # three products per step, five steps, one group
    assert all(e.outvars[0].aval.shape[0] == 3 for e in dots)


def test_inside_optax_partition_with_masked_nodes(rng):
    params = {"h": randn(rng, 8, 12), "stack": randn(rng, 2, 12, 8), "bias": randn(rng, 8)}
    labels = {"h": "muon", "stack": "muon", "bias": "sgd"}
    dims = {"h": MuonDimensionNumbers(), "stack": MuonDimensionNumbers(1, 2), "bias": None}
    tx = optax.partition({"muon": muon_orthogonalize(dimension_numbers=dims),
                          "sgd": optax.scale(-1.0)}, labels)
    state = tx.init(params)
    out, _ = jax.jit(tx.update)(params, state, params)
    np.testing.assert_array_equal(out["bias"], -params["bias"])
    np.testing.assert_allclose(out["h"], 0.2 * math.sqrt(12) * ns_reference(params["h"]),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["stack"])[0], 0.2 * math.sqrt(12) *
                               ns_reference(params["stack"][0]), atol=1e-5)


def test_jit_compiles_once_and_eval_shape_init(rng):
    params = {"a": randn(rng, 8, 12), "b": randn(rng, 12, 8)}
    tx = muon_orthogonalize(ns_coeffs="polar_express")
    state = jax.eval_shape(tx.init, params)
    assert isinstance(state, optax.EmptyState)
    traces = []

    def step(updates, state):
        traces.append(1)
        return tx.update(updates, state)

    step = jax.jit(step)
    first, _ = step(params, tx.init(params))
    second, _ = step(jax.tree.map(lambda x: 2 * x, params), tx.init(params))
    assert len(traces) == 1
    chex.assert_trees_all_close(first, second, atol=1e-5)  # scale invariance


def test_bf16_compute_dtype_and_mixed_leaf_dtypes(rng):
    g = {"f32": randn(rng, 16, 32), "bf16": randn(rng, 16, 32).astype(jnp.bfloat16)}
    default = muon_orthogonalize()
    out, ref, ref16 = first_updates(  # one compile; the references on their own transforms
        (muon_orthogonalize(compute_dtype=jnp.bfloat16), g), (default, {"w": g["f32"]}),
        (default, {"w": g["bf16"].astype(np.float32)}))
    assert out["f32"].dtype == jnp.float32 and out["bf16"].dtype == jnp.bfloat16
    ref = np.float64(ref["w"])
    rel = float(np.linalg.norm(out["f32"] - ref) / np.linalg.norm(ref))
    assert rel < 0.05
    np.testing.assert_allclose(out["bf16"].astype(np.float32), ref16["w"], atol=0.1)


def test_zero_update_stays_zero():
    out = apply(muon_orthogonalize(), {"w": np.zeros((6, 9), np.float32)})
    np.testing.assert_array_equal(out["w"], 0.0)


def test_inject_hyperparams(rng):
    g = {"w": randn(rng, 8, 12)}
    tx = optax.inject_hyperparams(muon_orthogonalize, static_args=("ns_steps",))(rms_scale=0.2)
    state = jax.jit(tx.init)(g)  # eagerly, init compiles each conversion of its own
    step = jax.jit(tx.update)
    first, state = step(g, state)
    # float32 like the injected value (a weak-typed jnp.asarray(0.4) would retrace), put on
    # the device from the host (jnp.asarray compiles)
    state.hyperparams["rms_scale"] = jax.device_put(np.float32(0.4))
    second, _ = step(g, state)
    np.testing.assert_allclose(second["w"], 2 * np.asarray(first["w"]), rtol=1e-6)
    # ns_steps is a static loop count: injecting it (the default for ints) fails clearly.
    bad = optax.inject_hyperparams(muon_orthogonalize)()
    with pytest.raises(TypeError, match="static_args"):
        jax.jit(lambda g: bad.update(g, bad.init(g)))(g)


def _ones(shape, dtype=np.float32):
    """A jax array of ones put from the host (jnp.ones compiles per shape and dtype)."""
    return jax.device_put(np.ones(shape, dtype))


@pytest.mark.parametrize("kwargs, updates, exc, match", [
    ({}, {"w": _ones((2, 3, 4))}, ValueError, r"\['w'\].*dimension_numbers"),
    ({}, {"v": _ones(4)}, ValueError, r"\['v'\].*dimension_numbers"),
    ({}, {"w": _ones((3, 4), np.int32)}, TypeError, r"\['w'\].*int32"),
    ({"dimension_numbers": MuonDimensionNumbers(0, 0)}, {"w": _ones((3, 4))}, ValueError,
     "distinct"),
    ({"dimension_numbers": MuonDimensionNumbers(0, 2)}, {"w": _ones((3, 4))}, ValueError,
     "output_axis.*out of range"),
    ({"dimension_numbers": MuonDimensionNumbers((), 1)}, {"w": _ones((3, 4))}, ValueError,
     "reduction_axis"),
    ({"dimension_numbers": {"w": (0, 1)}}, {"w": _ones((3, 4))}, ValueError,
     "dimension_numbers"),
])
def test_bad_updates_errors(kwargs, updates, exc, match):
    tx = muon_orthogonalize(**kwargs)
    with pytest.raises(exc, match=match):
        tx.update(updates, optax.EmptyState())
    with pytest.raises(exc, match=match):  # reported at init already
        tx.init(updates)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"ns_coeffs": "newton"}, ValueError, "ns_coeffs"),
    ({"ns_coeffs": np.ones((4, 3))}, ValueError, "ns_coeffs"),
    ({"ns_steps": 0}, ValueError, "ns_steps"),
    ({"scale": "adaptive"}, ValueError, "scale"),
    ({"rms_scale": -1.0}, ValueError, "rms_scale"),
    ({"eps": -1e-7}, ValueError, "eps"),
    ({"compute_dtype": jnp.int32}, TypeError, "compute_dtype"),
])
def test_bad_options_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        muon_orthogonalize(**kwargs)


def test_matches_newton_schulz_on_batch(rng):
    g = randn(rng, 4, 8, 12)
    tx = muon_orthogonalize(scale=None, dimension_numbers=MuonDimensionNumbers(1, 2))
    # Both in one jitted program (newton_schulz eagerly compiles each of its operations).
    out, want = jax.jit(lambda g: (tx.update({"w": g}, tx.init({"w": g}))[0]["w"],
                                   newton_schulz(g)))(g)
    np.testing.assert_allclose(out, want, atol=1e-6)


def test_optax_contrib_dimension_numbers_are_accepted(rng):
    """optax's own MuonDimensionNumbers work wherever rowgeom's do: one, per leaf, in a tree."""
    g = {"w": randn(rng, 3, 8, 20), "v": randn(rng, 8, 12)}
    ours = {"w": MuonDimensionNumbers(1, 2), "v": MuonDimensionNumbers()}
    theirs = {"w": optax.contrib.MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,)),
              "v": optax.contrib.MuonDimensionNumbers()}
    one = muon_orthogonalize(dimension_numbers=optax.contrib.MuonDimensionNumbers(1, 2))
    want, got, got_one = first_updates(  # one compile
        (muon_orthogonalize(dimension_numbers=ours), g),
        (muon_orthogonalize(dimension_numbers=theirs), g), (one, {"w": g["w"]}))
    chex.assert_trees_all_close(got, want)
    chex.assert_trees_all_close(got_one["w"], want["w"])


def test_shard_matrices_off_is_the_same_update_on_one_device(rng):
    """With one device there is no mesh: both settings run the same computation."""
    g = {"a": randn(rng, 8, 24), "b": randn(rng, 24, 8), "stack": randn(rng, 3, 8, 8)}
    dims = {"a": MuonDimensionNumbers(), "b": MuonDimensionNumbers(),
            "stack": MuonDimensionNumbers(1, 2)}
    on, off = first_updates(  # one compile
        (muon_orthogonalize(dimension_numbers=dims), g),
        (muon_orthogonalize(dimension_numbers=dims, shard_matrices=False), g))
    chex.assert_trees_all_equal(on, off)


@pytest.mark.parametrize("value", [1, "yes", None, jax.device_put(np.bool_(True))])
def test_shard_matrices_must_be_a_bool(value):
    with pytest.raises(TypeError, match="shard_matrices"):
        muon_orthogonalize(shard_matrices=value)


# --- Against optax 0.2.8's own Muon ------------------------------------------------------------


def test_same_polar_factor_as_optax(rng):
    """Where optax is right, the two agree: the bare polar factor of every layout."""
    from optax.contrib import _muon as optax_muon

    coeffs = np.float32(ns_coefficients("keller", 1)[0])
    xs = [randn(rng, *shape) for shape in ((8, 24), (24, 8), (12, 12))]
    tx = muon_orthogonalize(scale=None)
    # Every layout, theirs and ours, in one jitted program (one compile, not six).
    pairs = jax.jit(lambda xs: [(optax_muon.orthogonalize_via_newton_schulz(
        x, coeffs, 5, eps=1e-7), tx.update({"x": x}, tx.init({"x": x}))[0]["x"]) for x in xs])(xs)
    for x, (theirs, ours) in zip(xs, pairs, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=2e-6, err_msg=str(x.shape))


def test_coefficient_table_length_is_checked_where_optax_is_not(rng):
    """rowgeom requires exactly ns_steps rows (presets define every step count); optax 0.2.8
    refuses a table longer than ns_steps ("Not enough coeffs") and silently runs only the rows
    of a shorter one (optax before 0.2.8 has no table check)."""
    table = ns_coefficients("polar_express", 5)
    g = {"w": randn(rng, 16, 48)}
    with pytest.raises(ValueError, match=r"\(8, 3\)"):
        muon_orthogonalize(ns_coeffs=table, ns_steps=8)
    calls = [(muon_orthogonalize(ns_coeffs=table, ns_steps=5, scale=None), g),
             (muon_orthogonalize(ns_coeffs="polar_express", ns_steps=8, scale=None), g)]
    optax_checks = tuple(int(v) for v in optax.__version__.split(".")[:3]) >= (0, 2, 8)
    if optax_checks:
        dims = {"w": optax.contrib.MuonDimensionNumbers()}
        with pytest.raises(ValueError, match="Not enough coeffs"):  # 5 rows, 3 steps
            jax.eval_shape(optax.contrib.scale_by_muon(  # traced: eagerly, init compiles
                ns_coeffs=table, ns_steps=3, weight_dimension_numbers=dims).init, g)
        calls.append((optax.contrib.scale_by_muon(
            ns_coeffs=table, ns_steps=8, beta=0.0, nesterov=False, eps=1e-7,
            weight_dimension_numbers=dims), g))
    five, steps8, *eight = (out["w"] for out in first_updates(*calls))  # one compile
    np.testing.assert_allclose(five, ns_reference(g["w"], table), atol=1e-5)
    assert float(np.max(np.abs(steps8 - five))) > 1e-3  # the 3 more steps matter
    if optax_checks:
        np.testing.assert_allclose(eight[0], five, atol=1e-5)


def test_stacked_matrices_are_scaled_each_on_its_own_unlike_optax_adaptive(rng):
    """optax 0.2.8's adaptive=True multiplies a stacked (L, m, n) leaf by <G, polar(G)> summed
    over all L matrices, so one layer's step depends on the others; rowgeom's scale is per
    matrix, so layer 0's update is the same whatever layer 1 holds."""
    g0, g1 = (np.asarray(randn(rng, 8, 20)) for _ in range(2))
    stack = lambda big: {"w": np.stack([g0, np.float32(big) * g1])}  # numpy: no eager compiles
    theirs = optax.contrib.scale_by_muon(
            beta=0.0, nesterov=False, adaptive=True,
            weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers(1, 2)})
    ours = muon_orthogonalize(dimension_numbers=MuonDimensionNumbers(1, 2))
    outs = first_updates(*((tx, stack(big)) for tx in (theirs, ours) for big in (10.0, 1.0)),
                         (muon_orthogonalize(), {"w": g0}))  # one compile
    (theirs10, theirs1, ours10, ours1), alone = [out["w"][0] for out in outs[:4]], outs[4]
    coupled = float(np.linalg.norm(theirs10) / np.linalg.norm(theirs1))
    assert coupled > 5  # layer 1 grew 10x: optax's layer-0 step grew with it
    np.testing.assert_allclose(ours10, ours1, atol=1e-6)
    np.testing.assert_allclose(ours1, alone["w"], atol=1e-6)


def test_embedding_and_head_stay_off_muon_unlike_optax_default(rng):
    """optax.contrib.muon's default rule sends every rank-2 leaf to Muon, the embedding table
    and the LM head included; rowgeom labels them by name and shape and gives them their own
    geometry (AdamW for the table, projected RowNorm for the head)."""
    import rowgeom

    v, d = 64, 16
    params = {"embed": {"embedding": randn(rng, v, d)},
              "layers": {"0": {"attn": {"q_proj": {"kernel": randn(rng, d, d)}},
                               "attn_norm": {"scale": np.ones(d, np.float32)}}},
              "lm_head": {"kernel": randn(rng, d, v)}}
    grads = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), params)
    def cosine(a, b):  # float64 numpy (eager jnp would compile each operation per shape)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    polar = lambda x: -ns_reference(x)  # a descent step along the polar factor

    # Both optimizers' first steps from one jitted program (one compile, not two).
    txs = (optax.contrib.muon(1e-3), rowgeom.lm_optimizer(1e-3, weight_decay=0.0))  # no decay
    steps = jax.jit(lambda g, p: [tx.update(g, tx.init(p), p)[0] for tx in txs])(grads, params)
    step = steps[0]
    for path in (("embed", "embedding"), ("lm_head", "kernel")):
        got, g = step[path[0]][path[1]], grads[path[0]][path[1]]
        assert cosine(got, polar(g)) > 0.99, path  # orthogonalized: Muon

    assert rowgeom.label_params(params) == {
            "embed": {"embedding": "embedding"}, "lm_head": {"kernel": "head"},
            "layers": {"0": {"attn": {"q_proj": {"kernel": "hidden"}},
                             "attn_norm": {"scale": "vector"}}}}
    step = steps[1]  # rowgeom's, without decay like optax's
    for path in (("embed", "embedding"), ("lm_head", "kernel")):
        got, g = step[path[0]][path[1]], grads[path[0]][path[1]]
        assert cosine(got, polar(g)) < 0.95, path
    q = ("layers", "0", "attn", "q_proj", "kernel")
    got, g = step, grads
    for key in q:
        got, g = got[key], g[key]
    assert cosine(got, polar(g)) > 0.99  # the hidden matrix is Muon's in both
