"""Row diameter, bracket and Hilbert geometry against float64 numpy brute force; both layouts.

The bracket's distance pass over a leading feature axis has two formulations, each checked
directly against float64 numpy: the XLA:CPU one (`rowgeom._cpu.sq_dists`, ``impl="cpu"``) and
the masked one (`_masked_sq_dists`, ``impl="xla"``, any backend and any mesh); the whole bracket
is also run with each, chosen by its ``impl`` argument.
"""

import functools
import re

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.hlo_passes import head_traffic
from rowgeom import (
    _cpu,
    hilbert_distance,
    hilbert_perturbation,
    row_diameter,
    row_diameter_bounds,
)
from rowgeom._geometry import (
    _block_rows,
    _masked_sq_dists,
    _sq_dists,
    _sweep_sq_dists,
    _token_view,
)
from rowgeom._numerics import _take_rows

FORMULATIONS = ("cpu", "xla")


def np_rows(s, axis):
    x = np.moveaxis(np.asarray(s, np.float64), axis, 0)
    return x.reshape(x.shape[0], -1)


def np_pair_dists(s, axis):
    x = np_rows(s, axis)
    return np.sqrt(np.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1))


def np_diameter(s, axis):
    """Independent reference: every pair, float64, no centring and no Gram trick."""
    return float(np_pair_dists(s, axis).max())


def np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ----- Exact diameter ---------------------------------------------------------------------


@functools.cache
def _diameters_program(configs):
    return jax.jit(lambda xs: [row_diameter(x, vocab_axis=axis, block_size=block)
                               for x, (axis, block) in zip(xs, configs, strict=True)])


def diameters(*cases):
    """`row_diameter` of each ``(input, vocab_axis, block_size)``, from one jitted program for
    them all (a program per case would be a compile each); numpy inputs: no conversion compiles.
    """
    configs = tuple((axis, block) for _, axis, block in cases)
    return _diameters_program(configs)([x for x, _, _ in cases])


DIAMETER_SHAPES = [((37, 5), 0), ((5, 37), 1), ((4, 29, 3), 1), ((2, 1), 0)]


@functools.cache
def _brute_force_grid():
    """Every input of DIAMETER_SHAPES (drawn as the test's `rng` would) and its diameter."""
    inputs = [np.random.default_rng(0).normal(size=shape) * 2.0 + 3.0
              for shape, _ in DIAMETER_SHAPES]
    got = diameters(*[(s.astype(np.float32), axis, 8)
                      for s, (_, axis) in zip(inputs, DIAMETER_SHAPES, strict=True)])
    return inputs, got


@pytest.mark.parametrize("shape,axis", DIAMETER_SHAPES)
def test_row_diameter_matches_brute_force(shape, axis):
    inputs, diameters_ = _brute_force_grid()
    i = DIAMETER_SHAPES.index((shape, axis))
    s, got = inputs[i], diameters_[i]
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(got, np_diameter(s.astype(np.float32), axis), rtol=1e-5)


BLOCK_SIZES = [1, 7, 16, 64]


@functools.cache
def _blocked_grid():
    """A (61, 6) input (drawn as the test's `rng` would) and its diameter unblocked and in
    blocks of each of BLOCK_SIZES."""
    s = np.random.default_rng(0).normal(size=(61, 6)).astype(np.float32)
    sizes = [61, *BLOCK_SIZES]
    return s, dict(zip(sizes, diameters(*[(s, 0, b) for b in sizes]), strict=True))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_blocked_equals_unblocked(block_size):
    s, got = _blocked_grid()  # 61 rows: not a multiple of any block
    unblocked = got[61]
    np.testing.assert_allclose(got[block_size], unblocked, rtol=1e-6)
    np.testing.assert_allclose(unblocked, np_diameter(s, 0), rtol=1e-5)


@pytest.mark.parametrize("num_rows,block_size", [(50304, 1024), (300, 200), (129, 128)])
def test_block_choice_covers_rows_within_budget(num_rows, block_size):
    block, num_blocks = _block_rows(num_rows, block_size)
    assert block <= block_size and block % 64 == 0
    assert (num_blocks - 1) * block < num_rows <= num_blocks * block


def test_rounded_blocks_match_brute_force(rng):
    s = rng.normal(size=(300, 3))
    assert _block_rows(300, 200) == (128, 3)  # 2 blocks of 192 would compute more pairs
    got = row_diameter(s.astype(np.float32), vocab_axis=0, block_size=200)
    np.testing.assert_allclose(got, np_diameter(s, 0), rtol=1e-5)


@pytest.mark.parametrize("pair", [(3, 5), (16, 40), (48, 49)])
def test_farthest_pair_within_or_across_blocks(rng, pair):
    # 50 rows in 16-row blocks: the farthest pair inside the first block (a diagonal block
    # pair), across blocks, and inside the last, partly padded block.
    s = rng.normal(size=(50, 4)) * 0.01
    s[pair[0]] += 5.0
    s[pair[1]] -= 5.0
    got = row_diameter(s.astype(np.float32), vocab_axis=0, block_size=16)
    np.testing.assert_allclose(got, np_diameter(s, 0), rtol=1e-5)


def test_translation_invariant(rng):
    s = rng.normal(size=(50, 4))  # test_farthest_pair_within_or_across_blocks's program
    shifted = s + 10.0 * rng.normal(size=(1, 4))  # S + 1 c^T
    d0 = row_diameter(s.astype(np.float32), vocab_axis=0, block_size=16)
    d1 = row_diameter(shifted.astype(np.float32), vocab_axis=0, block_size=16)
    np.testing.assert_allclose(d1, d0, rtol=1e-5)


def test_single_token_and_constant_rows_give_zero(rng):
    constant = np.tile(rng.normal(size=(1, 4)).astype(np.float32), (9, 1))  # G = 1 c^T
    one_token, one_column, constant = jax.jit(lambda a, b, c: (  # one compile for the three
        row_diameter(a, vocab_axis=0), row_diameter_bounds(b, vocab_axis=1),
        row_diameter(c, vocab_axis=0)))(np.ones((1, 5), np.float32),
                                        np.ones((5, 1), np.float32), constant)
    assert float(one_token) == 0.0
    assert [float(v) for v in one_column] == [0.0, 0.0]
    np.testing.assert_allclose(constant, 0.0, atol=1e-6)


def test_under_jit_and_bf16(rng):
    s = rng.normal(size=(33, 7))
    s_bf16 = s.astype(jnp.bfloat16)  # on the host: no conversion compile
    jitted = jax.jit(lambda x, y: (row_diameter(x, vocab_axis=0, block_size=16),
                                   row_diameter(y, vocab_axis=0, block_size=16)))
    got_f32, got = jitted(s.astype(np.float32), s_bf16)
    np.testing.assert_allclose(got_f32, np_diameter(s, 0), rtol=1e-5)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_diameter(np.asarray(s_bf16, np.float64), 0), rtol=1e-5)
    # The bracket's dtypes (traced: no compile).
    lower, upper = jax.eval_shape(functools.partial(row_diameter_bounds, vocab_axis=0), s_bf16)
    assert lower.dtype == upper.dtype == jnp.float32


def test_dense_layout_is_transpose_and_wrong_axis_differs(rng):
    s = rng.normal(size=(12, 30)).astype(np.float32)  # (d, V) Flax kernel
    d_dense, d_rows, b_dense, b_rows, d_wrong = jax.jit(lambda s, t: (  # one compile
        row_diameter(s, vocab_axis=1), row_diameter(t, vocab_axis=0),
        row_diameter_bounds(s, vocab_axis=1), row_diameter_bounds(t, vocab_axis=0),
        row_diameter(s, vocab_axis=0)))(s, np.ascontiguousarray(s.T))
    np.testing.assert_allclose(d_dense, d_rows, atol=1e-6)
    chex.assert_trees_all_close(b_dense, b_rows, atol=1e-6)
    assert abs(float(d_wrong) - np_diameter(s, 1)) > 1e-2


def test_bad_input_names_the_argument():
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731  (host arrays: no compile)
    with pytest.raises(ValueError, match="s must have rank >= 2"):
        row_diameter(ones(5), vocab_axis=0)
    with pytest.raises(TypeError, match="s must have a real floating dtype"):
        row_diameter(np.ones((3, 2), np.int32), vocab_axis=0)
    with pytest.raises(ValueError, match="vocab_axis=2 is out of range"):
        row_diameter(ones(3, 2), vocab_axis=2)
    with pytest.raises(TypeError, match="vocab_axis must be an int"):
        row_diameter_bounds(ones(3, 2), vocab_axis=None)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        row_diameter(ones(3, 2), vocab_axis=0, block_size=0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        row_diameter(ones(3, 2), vocab_axis=0, block_size=2.5)
    with pytest.raises(ValueError, match="sweeps must be >= 0"):
        row_diameter_bounds(ones(3, 2), vocab_axis=0, sweeps=-1)


# ----- The O(Vd) bracket ----------------------------------------------------------------------

@jax.jit
def _bounds_jit(s):
    """The bracket of rows along axis 0 with two sweeps and with none (the centroid terms):
    one program per shape, which the tests below share (four shapes in all)."""
    return (row_diameter_bounds(s, vocab_axis=0),
            row_diameter_bounds(s, vocab_axis=0, sweeps=0))


@given(st.sampled_from([(2, 8), (4, 8), (40, 6)]).flatmap(
        lambda shape: hnp.arrays(np.float32, shape, elements=st.floats(-8, 8, width=32))))
def test_bracket_holds(s):
    exact = np_diameter(s, 0)
    (lower, upper), (lower0, upper0) = jax.tree.map(float, _bounds_jit(s))
    assert lower <= exact * (1 + 1e-5) + 1e-5
    assert exact <= upper * (1 + 1e-5) + 1e-5
    # The centroid terms against their numpy formulas.
    x = np_rows(s, 0)
    n = np.linalg.norm(x - x.mean(axis=0), axis=1)
    v = len(n)
    np.testing.assert_allclose(upper0, 2 * n.max(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(upper, upper0, rtol=1e-6)
    centroid_lower = max(n.max(), np.sqrt(2 * v / (v - 1) * np.mean(n**2)))
    np.testing.assert_allclose(lower0, min(centroid_lower, 2 * n.max()), rtol=1e-5, atol=1e-5)
    assert lower >= n.max() * (1 - 1e-5) - 1e-5  # the first sweep dominates r_c


def test_bracket_holds_for_rows_with_a_large_common_offset():
    """Rows = a common vector of size 1e3..1e6 plus a unit spread: the float32 centroid rounds
    at the offset's scale, which must not lift the lower end above D (it did, by up to 3e-6
    relative, when the lower end included centroid terms)."""
    rng = np.random.default_rng(7)
    for trial in range(120):
        vocab, offset = 2 + trial % 3, 10.0 ** (3 + trial % 4)
        s = (rng.standard_normal((vocab, 8)) + offset * rng.standard_normal(8)).astype(np.float32)
        exact = np_diameter(s, 0)
        lower, upper = (float(v) for v in _bounds_jit(s)[0])
        assert lower <= exact * (1 + 1e-6) and exact <= upper * (1 + 1e-6), (trial, lower, exact)


# Shapes for the layouts' edges: one feature, one token, a middle vocabulary axis, more
# feature rows than the CPU formulation's loop takes an iteration for a large head (the unrolled
# loop on a small head: test_rownorm.py::test_cpu_formulation_unrolls_...).
BRACKET_SHAPES = [((300, 17), 0), ((17, 300), 1), ((3, 4, 130), -1), ((130, 3, 4), 0),
                  ((3, 40, 5), 1), ((2, 1), 0), ((1, 5), 0), ((1, 7), 1), ((20, 9), 1)]


def _view_of(shape, axis):
    """`_token_view`'s view shape and token axis for an input of `shape` (traced: no compile)."""
    box = {}

    def view(s):
        x, box["t"] = _token_view(s, axis % len(shape))
        return x

    return jax.eval_shape(view, jax.ShapeDtypeStruct(shape, jnp.float32)).shape, box["t"]


@functools.cache
def _distance_pass_grid():
    """For every shape of BRACKET_SHAPES (drawn as the test's `rng` would): its input, point and
    sweep token, and its `_token_view` with each distance pass's result, from one jitted
    program (a program per shape and pass would be some 40 compiles)."""
    rng = np.random.default_rng(0)
    cases = []
    for shape, axis in BRACKET_SHAPES:
        s = rng.normal(size=shape) * 2.0 + 1.5
        vshape, t = _view_of(shape, axis)
        point = np.expand_dims(rng.normal(size=vshape[:t] + vshape[t + 1:]), t)
        cases.append((s, point, vshape[t] // 2))

    def run(ss, points, tokens):
        out = []
        for (shape, axis), s, p, i in zip(BRACKET_SHAPES, ss, points, tokens, strict=True):
            x, t = _token_view(s, axis % len(shape))
            got = {"xla": _masked_sq_dists(x, t, p)}
            if t == 1 and x.shape[0] > 1:
                got["cpu"] = _cpu.sq_dists(x, p)
            centre = jnp.mean(x, axis=t, keepdims=True)
            row = _take_rows(x, t, jnp.reshape(i, (1,)))
            got["sweep"] = _sweep_sq_dists(x, t, centre, _sq_dists(x, t, centre), row)
            out.append((x, got))
        return out

    # numpy arguments: jnp.asarray would compile a conversion per shape
    outs = jax.jit(run)([s.astype(np.float32) for s, _, _ in cases],
                        [p.astype(np.float32) for _, p, _ in cases],
                        [np.int32(i) for *_, i in cases])
    return [(case, jax.tree.map(np.asarray, out)) for case, out in zip(cases, outs, strict=True)]


def test_distance_pass_matches_float64():
    """||x_v - p||^2 to a given point, and a sweep's ||x_v - x_a||^2 to one of the rows (from the
    centred norms and one matrix-vector product), against float64, for every layout's view; with
    a leading feature axis also the CPU formulation's loop (`rowgeom._cpu`)."""
    for (shape, axis), ((_, point, token), (x, got)) in zip(BRACKET_SHAPES, _distance_pass_grid(),
                                                            strict=True):
        _, t = _view_of(shape, axis)
        rows = np.moveaxis(np.asarray(x, np.float64), t, 0).reshape(x.shape[t], -1)
        want = ((rows - np.moveaxis(point, t, 0).reshape(1, -1)) ** 2).sum(axis=1)
        assert set(got) == ({"xla", "cpu", "sweep"} if t == 1 and x.shape[0] > 1
                            else {"xla", "sweep"})
        for name in set(got) - {"sweep"}:
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{shape} {name}")
        want = ((rows - rows[token]) ** 2).sum(axis=1)
        np.testing.assert_allclose(got["sweep"], want, rtol=1e-5, atol=1e-5 * want.max(),
                                   err_msg=str(shape))


@functools.cache
def _bracket_program(formulation):
    """The indices of BRACKET_SHAPES whose bracket `formulation` traces to a program of its own,
    and one jitted function of a list of inputs (one per shape) giving their brackets with 0
    and 2 sweeps (a program per shape and sweep count would be 18 compiles)."""
    # The CPU formulation differs from the masked one only on a view with a leading feature
    # axis of more than one row; elsewhere it traces the very same program (checked here, by
    # tracing: no compile), which the "xla" grid runs.
    own = [i for i, (shape, axis) in enumerate(BRACKET_SHAPES) if formulation == "xla"
           or _differs_on_cpu(shape, axis)]
    for i, (shape, axis) in enumerate(BRACKET_SHAPES):
        if i not in own:
            _assert_cpu_traces_the_masked_program(shape, axis, sweeps=2)

    def run(xs):
        return {(sweeps, i): row_diameter_bounds(xs[i], vocab_axis=BRACKET_SHAPES[i][1],
                                                 sweeps=sweeps, impl=formulation)
                for sweeps in (0, 2) for i in own}

    return own, jax.jit(run)


def _assert_cpu_traces_the_masked_program(shape, axis, sweeps):
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    jaxprs = {impl: str(jax.make_jaxpr(functools.partial(
        row_diameter_bounds, vocab_axis=axis, sweeps=sweeps, impl=impl))(spec))
        for impl in FORMULATIONS}
    assert jaxprs["cpu"] == jaxprs["xla"], shape


def _brackets(formulation, inputs):
    """``{(sweeps, i): (lower, upper)}`` (floats) of `inputs` (one per shape of BRACKET_SHAPES,
    float32 numpy: no conversion compile per shape) in `formulation`, with 0 and 2 sweeps: the
    "cpu" grid's program where that formulation has its own, else the "xla" grid's (the same
    program, as `_bracket_program` checks)."""
    _, run = _bracket_program(formulation)
    got = jax.tree.map(float, run(list(inputs)))
    return got if formulation == "xla" else {**_brackets("xla", inputs), **got}


@functools.cache
def _bracket_inputs():
    """An input per shape of BRACKET_SHAPES (drawn as the test's `rng` would)."""
    rng = np.random.default_rng(0)
    return tuple((rng.normal(size=shape) * 2.0 + 1.5).astype(np.float32)
                 for shape, _ in BRACKET_SHAPES)


@functools.cache
def _bracket_grid(formulation):
    """Every input of `_bracket_inputs` and its brackets in `formulation` (see `_brackets`)."""
    return _bracket_inputs(), _brackets(formulation, _bracket_inputs())


def _differs_on_cpu(shape, axis):
    vshape, t = _view_of(shape, axis)
    return t == 1 and vshape[0] > 1


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("sweeps", [0, 2])
def test_bracket_in_each_formulation_holds_and_matches_float64(formulation, sweeps):
    inputs, bounds = _bracket_grid(formulation)
    if formulation == "cpu":  # the same program as "xla" elsewhere (see _bracket_program)
        assert sum(_differs_on_cpu(*case) for case in BRACKET_SHAPES) == 4
    for i, ((shape, axis), x) in enumerate(zip(BRACKET_SHAPES, inputs, strict=True)):
        lower, upper = bounds[sweeps, i]
        rows = np_rows(np.asarray(x, np.float64), axis % len(shape))
        n = np.linalg.norm(rows - rows.mean(axis=0), axis=1)
        np.testing.assert_allclose(float(upper), 2 * n.max(), rtol=1e-5, err_msg=str(shape))
        exact = np_diameter(np.asarray(x), axis % len(shape))
        assert float(lower) <= exact * (1 + 1e-5) + 1e-6 and exact <= float(upper) * (1 + 1e-5)
        if sweeps:
            assert float(lower) >= n.max() * (1 - 1e-5) - 1e-6


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_bracket_non_finite_and_huge_rows(rng, formulation):
    """NaN anywhere gives NaN bounds (never a finite wrong answer); entries ~1e30 overflow the
    squares, and the power-of-two rescaling keeps the bounds exact; in both formulations. The
    rows are (300, 17) along axis 0 and their transpose along axis 1: BRACKET_SHAPES' first two
    layouts, whose programs (`_brackets`) these tests share with the grid's."""
    assert BRACKET_SHAPES[:2] == [((300, 17), 0), ((17, 300), 1)]
    x = rng.normal(size=(300, 17))
    bad = x.copy()
    bad[3, 4] = np.nan

    def bounds(rows):
        """[(lower, upper) with tokens along axis 0, the same along axis 1] of `rows`."""
        inputs = list(_bracket_inputs())
        inputs[:2] = rows.astype(np.float32), np.ascontiguousarray(rows.T).astype(np.float32)
        got = _brackets(formulation, inputs)
        return [np.asarray(got[2, axis], np.float64) for axis in (0, 1)]

    for axis, (lower, upper) in enumerate(bounds(bad)):
        assert np.isnan(lower) and np.isnan(upper), f"axis={axis}"
    for axis, (small, big) in enumerate(zip(bounds(x), bounds(x * 1e30), strict=True)):
        np.testing.assert_allclose(big / 1e30, small, rtol=1e-5, err_msg=f"axis={axis}")


def test_bracket_formulation_follows_impl():
    """``impl="cpu"``: the (d, V) centred norms are the CPU formulation's loop over the leading
    feature axis; ``impl="xla"`` (the default): plain reductions with no slice of the token or
    feature axis, and no loop but the sweeps' own (two iterations; a gather of one row each).
    Only the formulation asked for is traced."""
    spec = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    jaxpr = lambda **kw: str(jax.make_jaxpr(
        lambda s: row_diameter_bounds(s, vocab_axis=1, **kw))(spec))
    cpu = jaxpr(impl="cpu")
    assert "length=64" in cpu and "platform_index" not in cpu  # the feature loop
    assert jaxpr(impl="auto") == cpu  # this process: one CPU device
    masked = jaxpr()
    assert jaxpr(impl="xla") == masked
    assert not [op for op in ("dynamic_slice", "platform_index") if op in masked]
    assert set(re.findall(r"length=(\d+)", masked)) == {"2"}  # the sweeps (and their rescaling)


def test_bracket_formulation_follows_the_device_count(monkeypatch):
    """``impl="auto"`` (the lm_optimizer head's default): the XLA:CPU loop for a traced array in
    a process with one CPU device, where no array can be sharded; the plain reductions as soon
    as the process has more devices (an input may then be sharded, even invisibly to tracing)."""
    spec = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    jaxpr = lambda: str(jax.make_jaxpr(
        lambda s: row_diameter_bounds(s, vocab_axis=1, impl="auto"))(spec))
    assert "length=64" in jaxpr()
    monkeypatch.setattr(jax, "device_count", lambda *a: 8)
    assert "length=64" not in jaxpr() and "dynamic_slice" not in jaxpr()


def _compiled_bounds(shape, axis, sweeps, formulation):
    """Optimized HLO of the jitted bracket of a float32 input of `shape`; the "cpu" formulation
    on a layout where it traces the masked program (checked on the jaxprs) reads that compile."""
    if formulation == "cpu" and not _differs_on_cpu(shape, axis):
        _assert_cpu_traces_the_masked_program(shape, axis, sweeps)
        formulation = "xla"
    return _compiled_bounds_text(shape, axis, sweeps, formulation)


@functools.cache
def _compiled_bounds_text(shape, axis, sweeps, formulation):
    fn = jax.jit(lambda s: row_diameter_bounds(s, vocab_axis=axis, sweeps=sweeps,
                                               impl=formulation))
    return fn.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("sweeps", [0, 1, 2])
def test_bracket_reads_the_rows_once_per_step_of_the_algorithm(formulation, sweeps):
    """Compiled, the bracket reads the rows 2 + sweeps times and writes nothing of their size:
    the centroid, the centred norms, and one pass per farthest-point sweep (its rows are
    gathered, not found by a masked pass); the power-of-two rescaling runs only when the first
    result is out of float32's safe range (a branch)."""
    for shape, axis in (((1024, 96), 0), ((96, 1024), 1)):
        traffic = head_traffic(_compiled_bounds(shape, axis, sweeps, formulation), 1024 * 96)
        assert (round(traffic.reads), round(traffic.writes)) == (2 + sweeps, 0), traffic.ops


def np_double_sweep(s, axis):
    """Independent float64 reference for the lower end with two sweeps: from the row farthest
    from the centroid to the row farthest from it, then to the row farthest from that one; the
    two sweeps' lengths."""
    x = np_rows(s, axis)
    anchor = int(np.argmax(np.linalg.norm(x - x.mean(axis=0), axis=1)))
    lengths = []
    for _ in range(2):
        dists = np.linalg.norm(x - x[anchor], axis=1)
        anchor = int(np.argmax(dists))
        lengths.append(float(dists[anchor]))
    return lengths


# Six points of the plane whose diameter only the second sweep finds: the row farthest from
# the centroid is (5, -4), the row farthest from it (-6, -3) at 11.05, the row farthest from
# that one (5, 6) at D = 14.21. Clear gaps at every step: float32 picks the same rows.
SECOND_SWEEP_POINTS = np.array([[-4, 2], [5, -4], [-6, -3], [1, 6], [-4, 0], [5, 6]], float)


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_bracket_lower_end_is_the_double_sweep(rng, formulation):
    """The lower end with two sweeps is the float64 double sweep's, on rows whose diameter only
    the second sweep finds: sweeps that never moved their anchor would stop at 0.78 D. The
    plane is embedded in 8 features by a random rotation, with a common offset."""
    basis = np.linalg.qr(rng.normal(size=(8, 8)))[0][:2]
    s = (SECOND_SWEEP_POINTS @ basis + 3.0 * rng.normal(size=8)).astype(np.float32)
    first, second = np_double_sweep(s, 0)
    assert first < 0.8 * second  # the point set does what it is here for
    np.testing.assert_allclose(second, np_diameter(s, 0), rtol=1e-6)
    both = jax.jit(lambda x, xt: [row_diameter_bounds(x, vocab_axis=0, impl=formulation),
                                  row_diameter_bounds(xt, vocab_axis=1, impl=formulation)])
    for axis, (lower, upper) in enumerate(both(s, np.ascontiguousarray(s.T))):  # one compile
        np.testing.assert_allclose(float(lower), second, rtol=1e-6, err_msg=f"axis={axis}")
        assert float(upper) >= second


def test_sweeps_reach_exact_diameter_on_two_clusters(rng):
    # Two tight clusters: the centroid bound is off by ~2x, one double sweep is exact.
    s = np.concatenate([rng.normal(size=(20, 6)) * 0.01, rng.normal(size=(20, 6)) * 0.01 + 3.0])
    lower, upper = _bounds_jit(s.astype(np.float32))[0]  # test_bracket_holds's (40, 6) program
    exact = np_diameter(s, 0)
    np.testing.assert_allclose(lower, exact, rtol=1e-5)
    assert float(upper) >= exact


# ----- Hilbert distance -------------------------------------------------------------------


def test_hilbert_distance_is_logit_range(rng):
    z = rng.normal(size=(4, 11)) * 3.0
    delta = rng.normal(size=(4, 11))
    expected = delta.max(axis=-1) - delta.min(axis=-1)
    p = np_softmax(z).astype(np.float32)  # host arrays: no conversion compiles
    q = np_softmax(z + delta).astype(np.float32)
    zc = (z + rng.normal(size=(4, 1)) * 50).astype(np.float32)
    zdc = (z + delta + rng.normal(size=(4, 1)) * 50).astype(np.float32)
    plain, shifted, scaled, transposed = jax.jit(lambda p, q, zc, zdc, p3, pt, qt: (  # one compile
        hilbert_distance(p, q), hilbert_distance(zc, zdc, logits=True), hilbert_distance(p3, q),
        hilbert_distance(pt, qt, axis=0)))(p, q, zc, zdc, 3.0 * p, np.ascontiguousarray(p.T),
                                           np.ascontiguousarray(q.T))
    np.testing.assert_allclose(plain, expected, rtol=1e-5)
    # Constants added to either logit vector change nothing; logits=True is exact.
    np.testing.assert_allclose(shifted, expected, rtol=1e-5)
    # Unnormalised positive vectors: the metric is projective.
    np.testing.assert_allclose(scaled, expected, rtol=1e-5)
    # axis: the (11, 4) layout.
    np.testing.assert_allclose(transposed, expected, rtol=1e-5)


def test_hilbert_distance_logits_survive_underflow():
    z = np.asarray([0.0, -200.0, -400.0], np.float32)  # softmax underflows to 0 in float32
    delta = np.asarray([0.5, -1.0, 2.0], np.float32)
    np.testing.assert_allclose(hilbert_distance(z, z + delta, logits=True), 3.0, rtol=1e-6)


def test_hilbert_distance_zeros():
    p = np.asarray([0.5, 0.5, 0.0], np.float32)
    q = np.asarray([0.25, 0.75, 0.0], np.float32)
    np.testing.assert_allclose(hilbert_distance(p, q), np.log(2.0) - np.log(2 / 3), rtol=1e-6)
    assert np.isinf(hilbert_distance(p, np.asarray([0.5, 0.25, 0.25], np.float32)))
    assert float(hilbert_distance(np.zeros(3, np.float32), np.zeros(3, np.float32))) == 0.0
    with pytest.raises(TypeError, match="q must have a real floating dtype"):
        hilbert_distance(p, np.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match="axis=1 is out of range"):
        hilbert_distance(p, q, axis=1)


# ----- Worst case over the hidden-state ball ---------------------------------


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_hilbert_perturbation_attains_theorem_1(rng, vocab_axis):
    v, d, radius = 17, 6, 2.5
    s = rng.normal(size=(v, d))
    dists = np_pair_dists(s, 0)
    a, b = np.unravel_index(np.argmax(dists), dists.shape)
    h_star = radius * (s[a] - s[b]) / np.linalg.norm(s[a] - s[b])
    h_rand = rng.normal(size=(3, 50, d))
    h_rand *= radius * rng.uniform(size=(3, 50, 1)) / np.linalg.norm(h_rand, axis=-1,
                                                                     keepdims=True)
    update = np.ascontiguousarray(s if vocab_axis == 0 else s.T).astype(np.float32)
    bound = radius * dists.max()
    got_star, got = jax.jit(lambda u, h_star, h_rand: (  # one compile for both
        hilbert_perturbation(u, h_star, vocab_axis=vocab_axis),
        hilbert_perturbation(u, h_rand, vocab_axis=vocab_axis)))(
        update, h_star.astype(np.float32), h_rand.astype(np.float32))
    np.testing.assert_allclose(got_star, bound, rtol=1e-5)
    assert got.shape == (3, 50)
    logits = h_rand @ s.T
    np.testing.assert_allclose(got, logits.max(-1) - logits.min(-1), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got) <= bound * (1 + 1e-5))
    # Lemma 1: it is the softmax's Hilbert change for any head W.
    w = rng.normal(size=(v, d))
    p = np_softmax(h_rand @ w.T)
    q = np_softmax(h_rand @ (w + s).T)
    np.testing.assert_allclose(got, np.log(p / q).max(-1) - np.log(p / q).min(-1), rtol=1e-4)


def test_hilbert_perturbation_bad_input():
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731  (host arrays: no compile)
    with pytest.raises(ValueError, match="update must have rank 2"):
        hilbert_perturbation(ones(2, 3, 4), ones(4), vocab_axis=0)
    with pytest.raises(ValueError, match="hidden must have last dimension d=3"):
        hilbert_perturbation(ones(5, 3), ones(2, 5), vocab_axis=0)
    with pytest.raises(ValueError, match="vocab_axis=-3 is out of range"):
        hilbert_perturbation(ones(5, 3), ones(3), vocab_axis=-3)
