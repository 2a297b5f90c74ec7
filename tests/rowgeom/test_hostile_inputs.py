"""Hostile inputs: every public function and transform against bad arguments and degenerate data.

Each case either raises an error that names the offending argument, or returns the finite result
docs/reliability.md documents. Non-finite input is never hidden: a NaN or inf in a leaf makes that
leaf's result non-finite, so `optax.apply_if_finite` can skip the step (tested below). Finite
input never yields NaN: hypothesis properties at the end (profile `ci`: 20 examples each;
`HYPOTHESIS_PROFILE=thorough`: 1000) draw values over float32's whole finite range.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import rowgeom
import rowgeom.testing

V, DIM = 6, 4
GOOD = np.random.default_rng(0).standard_normal((V, DIM)).astype(np.float32)


def _put(x):
    """A jax array of the numpy `x`, put on the device: jnp.asarray, jnp.ones and eager casts
    compile a program per shape and dtype."""
    return jax.device_put(np.asarray(x))


def _ones(shape, dtype=np.float32):
    return _put(np.ones(shape, dtype))


def _apply(tx, x):
    """One update of `tx` on a single-leaf tree; returns (update, state)."""
    tree = {"w": x}
    updates, state = tx.update(tree, tx.init(tree), tree)
    return updates["w"], state


def _hidden_for(x, axis):
    valid = jnp.ndim(x) == 2 and isinstance(axis, int) and -2 <= axis < 2
    return np.ones((3, x.shape[1 - axis % 2] if valid else DIM), np.float32)


# name -> (call(x, vocab_axis), name of the array argument in error messages)
HEAD_FUNCTIONS = {
    "row_diameter": (lambda x, ax: rowgeom.row_diameter(x, vocab_axis=ax), "s"),
    "row_diameter_bounds": (lambda x, ax: rowgeom.row_diameter_bounds(x, vocab_axis=ax), "s"),
    "rownorm_direction": (lambda x, ax: rowgeom.rownorm_direction(x, vocab_axis=ax), "u"),
    "projected_rownorm": (
        lambda x, ax: _apply(rowgeom.projected_rownorm(vocab_axis=ax), x)[0], "updates"),
    "projected_rownorm_exact": (
        lambda x, ax: _apply(rowgeom.projected_rownorm(vocab_axis=ax, rescale="exact"), x)[0],
        "updates"),
    "clip_row_diameter": (
        lambda x, ax: _apply(rowgeom.clip_row_diameter(0.5, vocab_axis=ax), x)[0], "updates"),
    "clip_row_diameter_exact": (
        lambda x, ax: _apply(rowgeom.clip_row_diameter(0.5, vocab_axis=ax, exact=True), x)[0],
        "updates"),
    "track_row_diameter": (  # the update and the measured stats (not the step counters)
        lambda x, ax: (lambda u, s: (u, s[:3]))(
            *_apply(rowgeom.track_row_diameter(vocab_axis=ax), x)),
        "(?:params|updates)"),  # init sees the params first
    "hilbert_perturbation": (
        lambda x, ax: rowgeom.hilbert_perturbation(x, _hidden_for(x, ax), vocab_axis=ax),
        "update"),
}
MATRIX_FUNCTIONS = {  # functions of matrices without a vocabulary axis
    "newton_schulz": (lambda x: rowgeom.newton_schulz(x), "x"),
    "muon_orthogonalize": (lambda x: _apply(rowgeom.muon_orthogonalize(), x)[0],
                           "muon_orthogonalize"),
}
ALL = sorted(HEAD_FUNCTIONS)


@functools.cache
def _jitted(name, axis):
    """A head function, jitted once per vocabulary axis (compiled once per shape and dtype):
    called eagerly, each of its operations would be a compile of its own."""
    return jax.jit(functools.partial(HEAD_FUNCTIONS[name][0], ax=axis))


@functools.cache
def _jitted_matrix(name):
    return jax.jit(MATRIX_FUNCTIONS[name][0])


HALF = (jnp.bfloat16, jnp.float16)
DEGENERATE_SHAPES = [(V, DIM), (1, DIM), (V, 1), (1, 1)]
# The inputs of `_calls`' program: float32 in every DEGENERATE_SHAPES shape, then, for a head
# function (the half-precision test's), (V, DIM) in each half-precision dtype.
SLOTS = [*((shape, np.float32) for shape in DEGENERATE_SHAPES),
         *(((V, DIM), dtype) for dtype in HALF)]


def _slots(name):
    return SLOTS[:len(DEGENERATE_SHAPES)] if name in MATRIX_FUNCTIONS else SLOTS


@functools.cache
def _program(name):
    """The head (vocabulary axis 0) or matrix function `name` of one input per SLOTS entry, as
    one jitted program: what the degenerate-data, non-finite and half-precision tests call (one
    compile per function, not one per shape and dtype)."""
    fn = _jitted_matrix(name) if name in MATRIX_FUNCTIONS else _jitted(name, 0)
    return jax.jit(lambda xs: [fn(x) for x in xs])


def _calls(name, inputs):
    """`_program(name)` with `inputs` ({SLOTS index: array}) in its slots and zeros in the
    others: the list of results, one per slot."""
    slots = _slots(name)
    assert set(inputs) <= set(range(len(slots))), inputs
    xs = [np.asarray(inputs[i], dtype) if i in inputs else np.zeros(shape, dtype)
          for i, (shape, dtype) in enumerate(slots)]
    assert all(x.shape == shape for x, (shape, _) in zip(xs, slots, strict=True))
    return _program(name)(xs)


def _call(name, x):
    """The head (vocabulary axis 0) or matrix function `name` of a float32 (V, DIM) `x`."""
    return _calls(name, {0: x})[0]


def _leaves(out):
    return [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(out)]


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(), (V,)])
def test_wrong_rank_names_the_argument(name, shape):
    fn, arg = HEAD_FUNCTIONS[name]
    with pytest.raises(ValueError, match=rf"\b{arg}\b.*rank"):
        fn(_ones(shape), 0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("axis", [2, -3, 7])
def test_out_of_range_vocab_axis_names_it(name, axis):
    fn, _ = HEAD_FUNCTIONS[name]
    with pytest.raises(ValueError, match=rf"vocab_axis={axis} is out of range"):
        fn(_put(GOOD), axis)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("axis", [1.0, "0", None])
def test_non_integer_vocab_axis_is_rejected(name, axis):
    fn, _ = HEAD_FUNCTIONS[name]
    if axis is None and name.startswith(("projected", "clip", "track")):
        # In a transform, None means "not a head leaf": the update passes through untouched.
        out = fn(_put(GOOD), axis)
        leaf = out[0] if name.startswith("track") else out
        np.testing.assert_array_equal(leaf, GOOD)
        return
    with pytest.raises(TypeError, match="vocab_axis must be"):
        fn(_put(GOOD), axis)


@pytest.mark.parametrize("name", ALL + sorted(MATRIX_FUNCTIONS))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64])
def test_non_real_floating_dtypes_name_the_argument(name, dtype):
    x = _put(GOOD.astype(dtype) if dtype != jnp.bool_ else GOOD > 0)
    if name in MATRIX_FUNCTIONS:
        fn, arg = MATRIX_FUNCTIONS[name]
        call = lambda: fn(x)
    else:
        fn, arg = HEAD_FUNCTIONS[name]
        call = lambda: fn(x, 0)
    with pytest.raises(TypeError, match=rf"\b{arg}\b.*(floating|dtype)"):
        call()


def test_hilbert_distance_bad_arguments():
    p = _put(np.full((4,), 0.25, np.float32))
    with pytest.raises(ValueError, match=r"\bp\b.*rank"):
        rowgeom.hilbert_distance(_put(np.float32(1)), _put(np.float32(1)))
    with pytest.raises(ValueError, match="same rank"):
        rowgeom.hilbert_distance(p, _put(np.asarray(p)[None]))
    with pytest.raises(ValueError, match="axis=1 is out of range"):
        rowgeom.hilbert_distance(p, p, axis=1)
    for dtype, arg in ((jnp.int32, "p"), (jnp.complex64, "p")):
        with pytest.raises(TypeError, match=rf"\b{arg}\b must have a real floating dtype"):
            rowgeom.hilbert_distance(_put(np.asarray(p).astype(dtype)), p)
    with pytest.raises(TypeError, match=r"\bq\b must have a real floating dtype"):
        rowgeom.hilbert_distance(p, _ones(4, np.int32))


def test_hilbert_perturbation_bad_hidden():
    u = _put(GOOD)
    with pytest.raises(ValueError, match=r"hidden must have last dimension d=4"):
        rowgeom.hilbert_perturbation(u, _ones((3, 5)), vocab_axis=0)
    with pytest.raises(TypeError, match=r"\bhidden\b must have a real floating dtype"):
        rowgeom.hilbert_perturbation(u, _ones((3, 4), np.int32), vocab_axis=0)
    with pytest.raises(ValueError, match=r"\bupdate\b must have rank 2"):
        rowgeom.hilbert_perturbation(_ones((2, 3, 4)), _ones((3, 4)), vocab_axis=0)


def test_newton_schulz_and_muon_bad_arguments():
    with pytest.raises(ValueError, match=r"\bx\b must have rank >= 2"):
        rowgeom.newton_schulz(_ones(4))
    with pytest.raises(ValueError, match="ns_steps must be >= 1"):
        rowgeom.newton_schulz(_put(GOOD), steps=0)
    with pytest.raises(ValueError, match="ns_coeffs must be one of"):
        rowgeom.ns_coefficients("fast", 5)
    with pytest.raises(TypeError, match="compute_dtype"):
        rowgeom.newton_schulz(_put(GOOD), compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="rank"):  # no dimension_numbers: matrices only
        _apply(rowgeom.muon_orthogonalize(), _ones((2, 3, 4)))
    for kwargs, match in (({"eps": -1.0}, "eps"), ({"rms_scale": 0.0}, "rms_scale"),
                          ({"scale": "huge"}, "scale must be one of")):
        with pytest.raises(ValueError, match=match):
            rowgeom.muon_orthogonalize(**kwargs)


def test_transform_option_errors_name_the_option():
    for make, match in (
            (lambda: rowgeom.projected_rownorm(vocab_axis=0, eps=0.0), "eps must be"),
            (lambda: rowgeom.projected_rownorm(vocab_axis=0, eps=float("nan")), "eps must be"),
            (lambda: rowgeom.projected_rownorm(vocab_axis=0, eps=1e-30), "eps must be"),
            (lambda: rowgeom.projected_rownorm(vocab_axis=0, num_valid=0), "num_valid"),
            (lambda: rowgeom.projected_rownorm(vocab_axis=0, rescale="max"), "rescale"),
            (lambda: rowgeom.clip_row_diameter(-1.0, vocab_axis=0), "max_diameter"),
            (lambda: rowgeom.clip_row_diameter(float("inf"), vocab_axis=0), "max_diameter"),
            (lambda: rowgeom.clip_row_diameter(float("nan"), vocab_axis=0), "max_diameter"),
            (lambda: rowgeom.clip_row_diameter(1.0, vocab_axis=0, block_size=0), "block_size"),
            (lambda: rowgeom.lm_optimizer(1e-3, head="sgd"), "head must be one of"),
            (lambda: rowgeom.lm_optimizer(1e-3, tied="both"), "tied must be")):
        with pytest.raises((ValueError, TypeError), match=match):
            make()
    with pytest.raises(ValueError, match=f"num_valid must be <= {V}"):
        _apply(rowgeom.projected_rownorm(vocab_axis=0, num_valid=V + 1), _put(GOOD))


def test_oracles_bad_arguments():
    for g, rho, error, match in ((np.ones(4), 1.0, ValueError, r"\bg\b must be a \(V, d\)"),
                                 (GOOD.astype(np.complex64), 1.0, TypeError, r"\bg\b.*real"),
                                 (np.where(GOOD > 1, np.nan, GOOD), 1.0, ValueError, "finite"),
                                 (GOOD, 0.0, ValueError, "rho"), (GOOD, np.inf, ValueError, "rho")):
        with pytest.raises(error, match=match):
            rowgeom.testing.diameter_oracle(g, rho)
    with pytest.raises(ValueError, match=r"\br\b must be a finite positive"):
        rowgeom.testing.common_ball_oracle(GOOD, -1.0)


# --------------------------------------------------------------------------- labels and trees


def _lm_params(head=True):
    params = {"embed": {"embedding": _ones((16, 4))},
              "layers": {"0": {"mlp": {"kernel": _ones((4, 4))}}},
              "final_norm": {"scale": _ones(4)}}
    if head:
        params["lm_head"] = {"kernel": _ones((4, 16))}
    return params


def test_tied_head_without_a_policy_asks_for_one():
    with pytest.raises(ValueError, match="tied='embedding'.*tied='head'"):
        rowgeom.label_params(_lm_params(head=False))
    with pytest.raises(ValueError, match="tied="):
        rowgeom.lm_optimizer(1e-3).init(_lm_params(head=False))
    for tied in ("embedding", "head"):  # with a policy it trains
        params = _lm_params(head=False)
        tx = rowgeom.lm_optimizer(1e-3, tied=tied)
        updates = jax.jit(lambda p, tx=tx: tx.update(  # one compile, not one per operation
            jax.tree.map(jnp.ones_like, p), tx.init(p), p)[0])(params)
        assert all(np.all(np.isfinite(u)) for u in _leaves(updates))


def test_a_label_without_transform_or_a_leaf_without_label_is_named():
    params = _lm_params()
    hidden_only = {"hidden": optax.sgd(1e-2), "embedding": optax.sgd(1e-2),
                   "vector": optax.sgd(1e-2)}
    with pytest.raises(ValueError, match=r"no transform for label\(s\) 'head' \(used by "
                                         r"lm_head/kernel\)"):
        rowgeom.partition_by_label(hidden_only, rowgeom.label_params).init(params)
    labels = rowgeom.label_params(params)
    del labels["lm_head"]
    with pytest.raises(ValueError, match="no label for parameter.*lm_head/kernel"):
        rowgeom.partition_by_label({**hidden_only, "head": optax.sgd(1e-2)}, labels).init(params)
    with pytest.raises(ValueError, match="lm_head/kernel"):
        rowgeom.lm_optimizer(1e-3, labels=labels).init(params)
    unnamed = {**params, "router": {"kernel": _ones((4, 3))}}
    with pytest.raises(ValueError, match=r"no label for these matrices: router/kernel"):
        rowgeom.label_params(unnamed)


def test_mismatched_trees_raise():
    x = _put(GOOD)
    for make in (lambda: rowgeom.projected_rownorm(vocab_axis={"a": 0}),
                 lambda: rowgeom.clip_row_diameter(1.0, vocab_axis={"a": 0}),
                 lambda: rowgeom.track_row_diameter(vocab_axis={"a": 0})):
        tx = make()
        with pytest.raises(ValueError, match="vocab_axis"):
            tx.update({"b": x}, tx.init({"b": x}))
    params = _lm_params()
    tx = rowgeom.lm_optimizer(1e-3)
    # Traced (jax.eval_shape): the same update code, raising at trace time, with no compile of
    # its own (eagerly, init and every operation up to the error compile one by one).
    state = jax.eval_shape(tx.init, params)
    grads = jax.tree.map(lambda p: _ones(p.shape, p.dtype), params)
    del grads["layers"]
    with pytest.raises((ValueError, TypeError, KeyError)):
        jax.eval_shape(tx.update, grads, state, params)
    bigger = {**params, "lm_head": {"kernel": _ones((4, 17))}}
    with pytest.raises((ValueError, TypeError)):
        jax.eval_shape(tx.update, jax.tree.map(lambda p: _ones(p.shape, p.dtype), bigger),
                       state, bigger)


def test_read_row_diameter_without_tracker_says_so():
    with pytest.raises(ValueError, match="add rowgeom.track_row_diameter"):
        rowgeom.read_row_diameter(jax.eval_shape(optax.adam(1e-3).init, {"w": _ones((3, 3))}))


# --------------------------------------------------------------------------- degenerate data


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_is_computed_in_float32(name, dtype):
    x = GOOD.astype(dtype)
    # One run: GOOD in both half-precision dtypes, and `x` upcast exactly to float32.
    outs = _calls(name, {0: x.astype(np.float32), **{len(DEGENERATE_SHAPES) + i: GOOD.astype(d)
                                                     for i, d in enumerate(HALF)}})
    got, want = outs[len(DEGENERATE_SHAPES) + HALF.index(dtype)], outs[0]
    for g, w, leaf in zip(_leaves(got), _leaves(want), jax.tree.leaves(got), strict=True):
        assert np.all(np.isfinite(g))
        if leaf.shape == x.shape:  # updates keep the input's dtype
            assert leaf.dtype == dtype
        tol = 1e-2 if dtype == jnp.bfloat16 else 2e-3
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ALL + sorted(MATRIX_FUNCTIONS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_gives_non_finite_output(name, bad):
    """Never a silently finite result from a NaN/inf leaf (docs/reliability.md)."""
    x = GOOD.copy()
    x[2, 1] = bad
    out = _call(name, x)
    if name.startswith("track"):  # updates pass through; the statistics show it
        update, state = out
        np.testing.assert_array_equal(update, x)
        out = state
    assert not all(np.all(np.isfinite(leaf)) for leaf in _leaves(out)), out


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_padding_rows_may_hold_anything(bad):
    """num_valid: padded rows are never read into a sum; they come out zero."""
    x = GOOD.copy()
    x[-2:] = bad
    got, want = (np.asarray(y) for y in _padded_and_valid(x, GOOD[:-2]))
    np.testing.assert_allclose(got[:-2], want, atol=1e-6)
    np.testing.assert_array_equal(got[-2:], 0.0)


@jax.jit
def _padded_and_valid(x, valid):
    """rownorm_direction of `x` with its last two rows padding, and of the valid rows alone:
    one jitted program (numpy in and out: no eager slices)."""
    return (rowgeom.rownorm_direction(x, vocab_axis=0, num_valid=V - 2),
            rowgeom.rownorm_direction(valid, vocab_axis=0))


@functools.cache
def _degenerate(name):
    """`name` of zeros and of a random draw in every shape of DEGENERATE_SHAPES (the program of
    `_calls`, run on the zeros then on the draws). {shape: (input, result) per kind}."""
    kinds = ([np.zeros(shape, np.float32) for shape in DEGENERATE_SHAPES],
             [np.random.default_rng(1).standard_normal(shape).astype(np.float32)
              for shape in DEGENERATE_SHAPES])
    results = [list(zip(xs, _calls(name, dict(enumerate(xs)))[:len(xs)], strict=True))
               for xs in kinds]
    per_shape = zip(*results, strict=True)
    return dict(zip(DEGENERATE_SHAPES, per_shape, strict=True))


@pytest.mark.parametrize("name", ALL + sorted(MATRIX_FUNCTIONS))
@pytest.mark.parametrize("shape", DEGENERATE_SHAPES)
def test_zeros_single_token_and_single_feature_are_finite(name, shape):
    """All-zero updates give zeros, V = 1 gives a zero step and diameter."""
    for x, out in _degenerate(name)[shape]:
        leaves = _leaves(out)
        assert all(np.all(np.isfinite(leaf)) for leaf in leaves), (name, x, out)
        if not x.any() or (shape[0] == 1 and name not in MATRIX_FUNCTIONS and
                           not name.startswith(("clip", "hilbert", "track"))):
            assert all(not leaf.any() for leaf in leaves), (name, x, out)
    one = rowgeom.hilbert_distance(_ones(1), _put(np.full(1, 3.0, np.float32)))
    assert float(one) == 0.0  # a single outcome: every distribution is the same point


@functools.cache
def _lm_step(head):
    """The recipe with `head`, its jitted init and update (shared by the tests below)."""
    tx = rowgeom.lm_optimizer(1e-2, head=head)
    return tx, jax.jit(tx.init), jax.jit(tx.update)


def test_lm_optimizer_all_zero_and_tiny_gradients_are_finite():
    params = _lm_params()
    for head in ("rownorm", "adamw", "muon"):
        tx, init, update = _lm_step(head)  # compiled once, shared with the property below
        state = init(params)
        for scale in (0.0, 1e-30, 1e15):
            grads = jax.tree.map(lambda p, s=scale: (  # numpy: no eager conversion compiles
                s * np.arange(p.size, dtype=np.float32)).reshape(p.shape).astype(p.dtype), params)
            updates, state = update(grads, state, params)
            assert all(np.all(np.isfinite(u)) for u in _leaves(updates)), (head, scale)
            assert all(np.all(np.isfinite(s)) for s in _leaves(state)), (head, scale)


# --------------------------------------------------------------------------- apply_if_finite


def test_composes_with_apply_if_finite():
    """A NaN/inf gradient step is skipped without touching the state; training then continues
    exactly as if the bad step had never happened."""
    params = _lm_params()
    rng = np.random.default_rng(2)
    # numpy gradients, edited in place (eager jnp conversions and .at[] would each compile)
    grads = [jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(p.dtype), params)
             for _ in range(3)]
    bad = jax.tree.map(np.copy, grads[0])
    bad["lm_head"]["kernel"][0, 0] = np.nan
    worse = jax.tree.map(np.copy, grads[0])
    worse["layers"]["0"]["mlp"]["kernel"][1] = np.inf

    tx = optax.apply_if_finite(rowgeom.lm_optimizer(1e-2), max_consecutive_errors=5)
    # Both runs share one compiled init and one compiled step (applying the update).
    init = jax.jit(tx.init)
    step = jax.jit(lambda g, state, p: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, state, p)))

    def run(seq):
        p, state = params, init(params)
        for g in seq:
            p, state = step(g, state, p)
        return p, state

    clean_params, clean_state = run(grads)
    got_params, got_state = run([grads[0], bad, grads[1], worse, grads[2]])
    assert int(got_state.total_notfinite) == 2 and int(got_state.notfinite_count) == 0
    jax.tree.map(np.testing.assert_array_equal, got_params, clean_params)
    jax.tree.map(np.testing.assert_array_equal, got_state.inner_state, clean_state.inner_state)
    stats = rowgeom.read_row_diameter(got_state)
    assert all(np.isfinite(v) for v in _leaves(stats))


# --------------------------------------------------------------------------- finite -> no NaN
# Values span float32's finite range: standard normals times 2**k for k in [-140, 120] (down to
# subnormals), with structured rows (zeros, equal rows, one outlier row, huge common offset).

SHAPES = [(1, 3), (5, 3), (4, 8)]


@st.composite
def finite_arrays(draw, *, max_log2=120):
    shape = draw(st.sampled_from(SHAPES))
    seed = draw(st.integers(0, 2**32 - 1))
    log2 = draw(st.integers(-140, max_log2))
    pattern = draw(st.sampled_from(["normal", "zeros", "equal_rows", "outlier", "offset",
                                    "two_scales"]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if pattern == "zeros":
        x[:] = 0.0
    elif pattern == "equal_rows":
        x[:] = x[0]
    elif pattern == "outlier":
        x[:] *= 2.0 ** -30
        x[rng.integers(shape[0])] *= 2.0 ** 30
    elif pattern == "offset":
        x = 1.0 + 2.0 ** -20 * x
    elif pattern == "two_scales":
        x[:, 0] *= 2.0 ** 40
    x = x * 2.0 ** log2
    x = np.clip(x, -np.finfo(np.float32).max / 2, np.finfo(np.float32).max / 2)
    return x.astype(np.float32)


def _no_nan(out):
    leaves = _leaves(out)
    assert not any(np.isnan(leaf).any() for leaf in leaves), out
    return leaves


@functools.cache
def _jitted_together(names, axis):
    """The head functions `names` of one input, in one jitted program (one compile per shape,
    not one per function)."""
    fns = [_jitted(name, axis) for name in names]
    return jax.jit(lambda x: [fn(x) for fn in fns])


def _diameter_and_bounds(x, axis):
    d, (lower, upper) = _jitted_together(("row_diameter", "row_diameter_bounds"), axis)(x)
    return float(d), float(lower), float(upper)


@pytest.mark.slow
@given(finite_arrays(), st.sampled_from([0, 1]))
def test_property_diameters_finite_and_bracketed(x, axis):
    d, lower, upper = _diameter_and_bounds(x, axis)
    rows = np.moveaxis(x.astype(np.float64), axis, 0).reshape(x.shape[axis], -1)
    ref = max((np.linalg.norm(a - b) for a in rows for b in rows), default=0.0)
    assert not np.isnan([d, lower, upper]).any(), (d, lower, upper, ref)
    if 2 * ref >= np.finfo(np.float32).max:  # upper <= 2 D may legitimately overflow
        return
    assert np.isfinite([d, lower, upper]).all(), (d, lower, upper, ref)
    # float32 rounding of the rows is ~1e-7 relative to max|x|; XLA:CPU flushes subnormal
    # inputs (|x| < 1.2e-38) to zero.
    slack = 1e-5 * ref + 1e-6 * float(np.abs(x).max(initial=0.0)) + 4 * np.finfo(np.float32).tiny
    assert abs(d - ref) <= slack, (d, ref)
    assert lower <= d + slack and d <= upper + slack, (lower, d, upper)


@pytest.mark.slow
@given(finite_arrays(), st.sampled_from([0, 1]))
def test_property_clip_is_finite_and_clips(x, axis):
    # The cap holds for the exactly scaled update; storing it in float32 moves each entry by up
    # to half an ulp of max|y| (a large common offset keeps its full size under the scaling).
    names = ("clip_row_diameter_exact", "clip_row_diameter")
    for name, out in zip(names, _jitted_together(names, axis)(x), strict=True):
        y = _no_nan(out)[0]
        assert np.isfinite(y).all(), name
        rounding = 2 * np.finfo(np.float32).eps * np.abs(y).max(initial=0.0) * np.sqrt(y.size)
        assert _diameter_and_bounds(y, axis)[0] <= 0.5 * (1 + 1e-5) + rounding, name


def _representable(value):
    return value < np.finfo(np.float32).max / (1 + 1e-5)


@functools.cache
def _tracker_and_hilbert_jit(axis):
    """The tracker's update of x and x's Hilbert perturbation for hidden states h: one jitted
    program (eagerly: a compile per operation)."""
    tracker = _jitted("track_row_diameter", axis)
    return jax.jit(lambda x, h: (tracker(x), rowgeom.hilbert_perturbation(x, h, vocab_axis=axis)))


_hilbert_logits_jit = jax.jit(functools.partial(rowgeom.hilbert_distance, logits=True))


@pytest.mark.slow
@given(finite_arrays(), st.sampled_from([0, 1]))
def test_property_tracker_and_hilbert_are_finite(x, axis):
    # Hidden states of norm <= 1: the perturbation is at most D, representable.
    h = (np.random.default_rng(0).standard_normal((3, x.shape[1 - axis])) / 8).astype(np.float32)
    (update, state), delta = _tracker_and_hilbert_jit(axis)(x, h)
    np.testing.assert_array_equal(update, x)
    stats = _no_nan(state)
    rows = np.moveaxis(x.astype(np.float64), axis, 0).reshape(x.shape[axis], -1)
    bound = 2 * np.linalg.norm(rows - rows.mean(axis=0), axis=1).max()
    if _representable(bound):  # upper = 2 max_i ||x_i - xbar|| may exceed float32 otherwise
        assert all(np.isfinite(leaf).all() for leaf in stats), (stats, bound)
    assert np.isfinite(delta).all()
    z = np.moveaxis(x, axis, -1)
    dist = np.asarray(_hilbert_logits_jit(z, z[::-1]))
    r = z.astype(np.float64) - z[::-1].astype(np.float64)
    ref = r.max(axis=-1) - r.min(axis=-1)
    assert not np.isnan(dist).any()
    ok = _representable(ref)
    tiny, eps = np.finfo(np.float32).tiny, np.finfo(np.float32).eps  # subnormals flush to 0
    np.testing.assert_allclose(dist[ok], ref[ok], rtol=1e-5,
                               atol=4 * eps * np.abs(z).max(initial=0.0) + 4 * tiny)


@pytest.mark.slow
@given(finite_arrays())
def test_property_orthogonalizers_are_finite(x):
    fns = [_jitted_matrix(name) for name in MATRIX_FUNCTIONS]
    for name, out in zip(MATRIX_FUNCTIONS, _orthogonalizers(*fns)(x), strict=True):
        y = _no_nan(out)[0]
        assert np.isfinite(y).all(), name


@functools.cache
def _orthogonalizers(*fns):
    """Every matrix function of one input, in one jitted program (one compile per shape)."""
    return jax.jit(lambda x: [fn(x) for fn in fns])




@pytest.mark.slow
@given(st.sampled_from(["rownorm", "adamw", "muon"]), st.integers(0, 2**32 - 1),
       st.integers(-140, 55), st.sampled_from(["normal", "zeros", "one_row"]))
def test_property_lm_optimizer_steps_are_finite(head, seed, log2, pattern):
    """Two steps of the whole recipe on gradients of any scale up to 2^55 stay finite."""
    params = _lm_params()
    _, init, update = _lm_step(head)
    rng = np.random.default_rng(seed)
    state = init(params)
    for _ in range(2):
        grads = {}
        for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
            g = rng.standard_normal(p.shape) * 2.0 ** log2
            if pattern == "zeros":
                g[:] = 0.0
            elif pattern == "one_row" and g.ndim == 2:
                g[1:] = 0.0
            grads[jax.tree_util.keystr(path)] = g.astype(np.float32)
        tree = jax.tree_util.tree_unflatten(
            jax.tree.structure(params), list(grads.values()))  # numpy: no eager conversions
        updates, state = update(tree, state, params)
        assert all(np.isfinite(u).all() for u in _leaves(updates)), (head, log2, pattern)
        assert all(np.isfinite(s).all() for s in _leaves(state)), (head, log2, pattern)
