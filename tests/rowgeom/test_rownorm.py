"""Projected RowNorm against a numpy fp64 reference and the exact oracles; invariances, edges.

Both formulations are checked directly against the float64 reference: the XLA:CPU one
(`rowgeom._cpu.rownorm`, ``impl="cpu"``) and the masked one (`rowgeom._rownorm._masked`,
``impl="xla"``, the default; sharded in test_sharding.py). Each test picks it by parameter.
"""

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

from benchmarks.hlo_passes import head_traffic
from rowgeom import _cpu, projected_rownorm, rownorm_direction
from rowgeom._numerics import MIN_EPS
from rowgeom._rownorm import _masked

FORMULATIONS = ("cpu", "xla")
_FNS = {"cpu": _cpu.rownorm, "xla": _masked}


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
           formulation=None):
    """The public function (formulation None: its default impl) or one formulation, jitted."""
    opts = dict(eps=eps, center_input=center_input, center_output=center_output)
    if formulation is None:
        return jax.jit(lambda u: rownorm_direction(u, vocab_axis=vocab_axis, num_valid=num_valid,
                                                   **opts))

    def fn(u):
        axis = vocab_axis % u.ndim
        return _FNS[formulation](u, axis, num_valid=u.shape[axis] if num_valid is None
                                 else num_valid, **opts)

    return jax.jit(fn)


def project(u, **kw):
    # numpy float32 in: converting with jnp (eagerly) would compile a program per shape
    return np.asarray(jitted(**kw)(np.asarray(u, np.float32)), np.float64)


@functools.cache
def _jitted_many(key, formulation):
    parts = [jitted(formulation=formulation, **dict(kw)) for _, kw in key]
    return jax.jit(lambda us: [f(u) for f, u in zip(parts, us, strict=True)])


def project_many(calls, formulation=None):
    """`project` of several (input, options) pairs in one jitted program (one compile, not one
    per shape and options; each part is the same jitted function `project` calls)."""
    key = tuple((np.shape(u), tuple(sorted(kw.items()))) for u, kw in calls)
    outs = _jitted_many(key, formulation)([np.asarray(u, np.float32) for u, _ in calls])
    return [np.asarray(y, np.float64) for y in outs]


def project_layouts(u, formulation=None, **kw):
    """`project` of a (V, d) `u` with vocab_axis=0 and of its (d, V) transpose with
    vocab_axis=1, from one jitted program: [(V, d) result, (d, V) result]."""
    return project_many([(u, dict(kw, vocab_axis=0)), (u.T, dict(kw, vocab_axis=1))],
                        formulation)


SIMPLEX_KS = (2, 3, 5)
# The oracle tests' gradient shapes: t4's, t6's and the regular simplices' (k+1, k+1).
STEP_SHAPES = ((30, 5), (6, 3), (11, 4), *((k + 1, k + 1) for k in SIMPLEX_KS))


def steps(gs, r):
    """Theorem 2's step S = -r P rownorm(P G) of each (V, d) gradient of `gs` (eps as small as
    allowed), from one jitted program over every shape of STEP_SHAPES that the oracle tests
    share (one compile, not one per shape; the shapes not in `gs` run on zeros)."""
    slot = {np.shape(g): i for i, g in enumerate(gs)}
    assert len(slot) == len(gs) and set(slot) <= set(STEP_SHAPES), list(slot)
    outs = project_many([(gs[slot[shape]] if shape in slot else np.zeros(shape),
                          {"eps": MIN_EPS}) for shape in STEP_SHAPES])
    return [-r * outs[STEP_SHAPES.index(np.shape(g))] for g in gs]


def step(g, r):
    return steps([g], r)[0]


# --- the reference, layouts, padding, dtypes ------------------------------------------------------


FLAGS = [(True, True), (True, False), (False, True), (False, False)]
REFERENCE_CASES = [((40, 6), 0), ((6, 40), 1), ((3, 40, 2), 1), ((3, 2, 40), -1), ((40, 2, 3), 0)]


@functools.cache
def _reference_inputs():
    rng = np.random.default_rng(0)
    return tuple(rng.normal(size=shape) + 0.5 for shape, _ in REFERENCE_CASES)


@functools.cache
def _grid_program(formulation):
    """One formulation at every flag pair, layout and padding of the grid, as one jitted
    program of the REFERENCE_CASES inputs (a program per combination would be 40 compiles):
    {(center_input, center_output, case, num_valid or 0): output}."""
    def run(us):
        out = {}
        for ci, co in FLAGS:
            opts = dict(eps=1e-8, center_input=ci, center_output=co)
            for i, ((_, axis), u) in enumerate(zip(REFERENCE_CASES, us, strict=True)):
                for num_valid in (None, 23):
                    a = axis % u.ndim
                    y = _FNS[formulation](u, a, num_valid=num_valid or u.shape[a], **opts)
                    out[ci, co, i, num_valid or 0] = y  # sortable pytree keys
        return out

    return jax.jit(run)


def grid(formulation, inputs):
    """The grid program of `formulation` on `inputs` (one per REFERENCE_CASES entry), float64."""
    outputs = _grid_program(formulation)([np.asarray(u, np.float32) for u in inputs])
    return jax.tree.map(lambda y: np.asarray(y, np.float64), outputs)


def grid_layouts(u, formulation, *, center=(True, True), num_valid=None):
    """A (40, 6) `u` with vocab_axis=0 and its (6, 40) transpose with vocab_axis=1 through
    `formulation`, eps 1e-8: [(V, d) result, (d, V) result]. They run in the slots of the
    grid's first two cases (those very layouts), so the tests that need the default eps share
    the grid's compiled program rather than compiling one of their own."""
    assert u.shape == REFERENCE_CASES[0][0] and REFERENCE_CASES[1] == (u.T.shape, 1), u.shape
    outputs = grid(formulation, [u, u.T, *_reference_inputs()[2:]])
    return [outputs[(*center, case, num_valid or 0)] for case in (0, 1)]


@functools.cache
def _reference_grid(formulation):
    """(inputs, outputs[flags][case][num_valid]) for every flag pair, layout and padding: one
    jitted program per formulation. The public function (formulation None) with its default
    impl traces the very program of the masked formulation, for every combination (checked here
    by tracing: no compile), so it shares that grid's outputs rather than compiling the same
    program again."""
    if formulation is None:
        for ci, co in FLAGS:
            opts = dict(eps=1e-8, center_input=ci, center_output=co)
            for shape, axis in REFERENCE_CASES:
                for num_valid in (None, 23):
                    a = axis % len(shape)
                    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
                    public = jax.make_jaxpr(functools.partial(
                        rownorm_direction, vocab_axis=axis, num_valid=num_valid, **opts))(spec)
                    masked = jax.make_jaxpr(functools.partial(
                        _masked, axis=a, num_valid=num_valid or shape[a], **opts))(spec)
                    assert str(public) == str(masked), (shape, axis, num_valid, ci, co)
        return _reference_grid("xla")
    inputs = _reference_inputs()
    return inputs, grid(formulation, inputs)


@pytest.mark.parametrize("formulation", [None, *FORMULATIONS])
@pytest.mark.parametrize("flags", FLAGS)
def test_matches_float64_reference(formulation, flags):
    ci, co = flags
    inputs, outputs = _reference_grid(formulation)
    for i, ((shape, axis), u) in enumerate(zip(REFERENCE_CASES, inputs, strict=True)):
        for num_valid in (None, 23):
            want = np_project(u, axis, center_input=ci, center_output=co, num_valid=num_valid)
            np.testing.assert_allclose(outputs[ci, co, i, num_valid or 0], want, atol=2e-6,
                                       err_msg=f"{shape} axis={axis} num_valid={num_valid}")


BLOCK_ROWS = [1, 4, 7, 64]


@functools.cache
def _cpu_blocks(num_valid):
    """The XLA:CPU formulation at every block size, both layouts: one jitted program."""
    u = np.random.default_rng(0).normal(size=(5, 37)).astype(np.float32)

    def run(x):
        return {(block_rows, axis): _cpu.rownorm(
                    x if axis == 1 else x.T, axis, eps=1e-8, center_input=True,
                    center_output=True, num_valid=num_valid, block_rows=block_rows)
                for block_rows in BLOCK_ROWS for axis in (1, 0)}

    return u, jax.jit(run)(u)


@pytest.mark.parametrize("block_rows", BLOCK_ROWS)
@pytest.mark.parametrize("num_valid", [37, 29, 1])
def test_cpu_formulation_any_block_size(block_rows, num_valid):
    """Full blocks (of token rows, or of feature rows for a (d, V) kernel), a tail block, one
    block, and padding: the float64 reference's numbers, in both layouts."""
    u, outputs = _cpu_blocks(num_valid)
    for x, axis in ((u, 1), (u.T, 0)):
        np.testing.assert_allclose(np.asarray(outputs[block_rows, axis]),
                                   np_project(x, axis, num_valid=num_valid),
                                   atol=2e-6, err_msg=f"vocab_axis={axis}")


def test_cpu_formulation_unrolls_its_token_walks_for_large_heads_only(monkeypatch):
    """A (d, V) kernel's slab walk and the bracket's distance pass take 8 feature rows an
    iteration from `_cpu._UNROLL_MIN_TOKENS` tokens on (traced: no compile), and one below it;
    unrolled, a small head still gives the float64 reference's numbers (one compile)."""
    def unrolls(vocab):
        spec = jax.ShapeDtypeStruct((20, vocab), jnp.float32)
        walks = (lambda x: _cpu.rownorm(x, 1, eps=1e-8, center_input=True, center_output=True,
                                        num_valid=vocab),
                 lambda x: _cpu.sq_dists(x, x[:, :1]))
        return [re.findall(r"unroll=(\d+)", str(jax.make_jaxpr(f)(spec))) for f in walks]

    assert unrolls(_cpu._UNROLL_MIN_TOKENS) == [["8"] * 3, ["8"]]  # stats, rescaled stats, write
    assert unrolls(_cpu._UNROLL_MIN_TOKENS - 1) == [["1"] * 3, ["1"]]
    monkeypatch.setattr(_cpu, "_UNROLL_MIN_TOKENS", 0)
    u = np.random.default_rng(3).normal(size=(11, 37)).astype(np.float32)  # 11: a tail too
    out, sq = jax.jit(lambda x: (
        [_cpu.rownorm(x, 1, eps=1e-8, center_input=True, center_output=True, num_valid=29,
                      block_rows=rows) for rows in (1, 3)],
        _cpu.sq_dists(x, x[:, 2:3])))(u)
    for got in out:
        np.testing.assert_allclose(np.asarray(got), np_project(u, 1, num_valid=29), atol=2e-6)
    want = ((u.astype(np.float64) - u[:, 2:3]) ** 2).sum(axis=0)
    np.testing.assert_allclose(np.asarray(sq), want, rtol=1e-5)


def test_dense_layout_is_the_transpose_and_the_wrong_axis_is_caught(rng):
    """(d, V) with vocab_axis=1 is the transpose of (V, d) with vocab_axis=0."""
    g = rng.normal(size=(24, 24))  # square, so a wrong axis cannot hide behind a shape error
    dense, embed, wrong, last = project_many(  # one compile, each part `project`'s function
        [(g.T, {"vocab_axis": 1}), (g, {"vocab_axis": 0}), (g.T, {"vocab_axis": 0}),
         (g.T, {"vocab_axis": -1})])
    np.testing.assert_allclose(dense, embed.T, atol=1e-6)
    np.testing.assert_allclose(embed, np_project(g, 0), atol=1e-6)
    assert np.abs(wrong - embed.T).max() > 0.1
    np.testing.assert_allclose(last, dense, atol=0)


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_padded_vocabulary(rng, formulation):
    """Padding rows are excluded from both means and get zero, whatever they contain."""
    valid = rng.normal(size=(6, 23))
    garbage = np.concatenate([np.full((6, 9), 1e30), np.full((6, 8), np.nan)], axis=1)
    u = np.concatenate([valid, garbage], axis=1)  # (d, V) with V = 40, 23 valid
    for got in grid_layouts(u.T, formulation, num_valid=23):
        got = got.T if got.shape == u.T.shape else got
        assert np.all(got[:, 23:] == 0)
        np.testing.assert_allclose(got[:, :23], np_project(valid, 1), atol=2e-6)


def test_bfloat16_in_bfloat16_out_float32_inside(rng):
    u = (rng.normal(size=(48, 8)) + 3.0).astype(jnp.bfloat16)  # numpy (ml_dtypes) bfloat16
    # The bfloat16 call and the float32 one on the upcast input, rounded once to bfloat16: one
    # jitted program (each apart, and the casts eagerly, would be five compiles).
    out, rounded = jax.jit(lambda u: (
        rownorm_direction(u, vocab_axis=0),
        rownorm_direction(u.astype(jnp.float32), vocab_axis=0).astype(jnp.bfloat16)))(u)
    assert out.dtype == jnp.bfloat16 and out.shape == u.shape
    # only the result is rounded (compared on the host: chex converts bfloat16 with jnp)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(rounded, np.float32))
    want = np_project(np.asarray(u, np.float32), 0)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2**-7)


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_large_common_row_plus_tiny_spread(rng, formulation):
    """Rows = big common vector + tiny noise: centring must not lose the noise's direction."""
    common = 1e3 * rng.normal(size=(1, 6))
    u = (common + 1e-2 * rng.normal(size=(40, 6))).astype(np.float32)
    for (x, axis), got in zip(((u, 0), (u.T, 1)), grid_layouts(u, formulation), strict=True):
        want = np_project(x, axis)  # exact on the float32 input
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("scale", [1e30, 1e37, 1e-12])
def test_huge_and_tiny_inputs_follow_the_float64_reference(rng, formulation, scale):
    """Squared norms of entries ~1e30 overflow float32: the guard rescales by a power of two.
    Rows below eps (1e-8) are divided by eps, as the reference does."""
    u = rng.normal(size=(40, 6))
    for (x, axis), got in zip(((u, 0), (u.T, 1)), grid_layouts(u * scale, formulation),
                              strict=True):
        assert np.all(np.isfinite(got))
        want = np_project(np.float32(x * scale), axis)
        np.testing.assert_allclose(got, want, atol=3e-6 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_eps_rule_unit_rows_at_least_eps_long_shorter_ones_over_eps(rng, formulation):
    """Rows with ||x|| >= eps come out unit length and shorter ones x / eps, down to the
    smallest eps allowed, with entries so small that squares near them underflow float32."""
    d = 256
    directions = rng.normal(size=(6, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = MIN_EPS * np.array([4.0, 1.5, 1.0 + 1e-3, 0.5, 1e-3, 0.0])
    x = (directions * norms[:, None]).astype(np.float32)
    for axis, got in enumerate(project_layouts(x, formulation, eps=MIN_EPS, center_input=False,
                                               center_output=False)):
        got = got if axis == 0 else got.T
        lengths = np.linalg.norm(got, axis=1)
        np.testing.assert_allclose(lengths[:3], 1.0, rtol=1e-5)
        np.testing.assert_allclose(got[3:], np.float64(x[3:]) / np.float64(np.float32(MIN_EPS)),
                                   rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("eps", [1.2e-38, 1e-30, 1.1e-19, MIN_EPS / 2])
def test_eps_below_the_float32_safe_minimum_is_rejected(eps):
    """Below 2**-40, rows whose squared norm underflows were divided by eps and came out far
    longer than 1 (entries ~1e-30 with eps 1.2e-38 gave rows of norm ~3e8): eps is refused."""
    u = jax.device_put(np.float32(np.full((3, 4), 1e-30) * np.arange(1, 4)[:, None]))
    with pytest.raises(ValueError, match="eps must be a finite float >= 9.09e-13"):
        rownorm_direction(u, vocab_axis=0, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite float >= 9.09e-13"):
        projected_rownorm(vocab_axis=0, eps=eps)
    y = np.asarray(jitted(vocab_axis=0, eps=MIN_EPS)(u), np.float64)
    assert np.linalg.norm(y, axis=1).max() <= 1.0  # rows far below eps: x / eps, tiny


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_huge_input_rows_far_below_the_largest_are_never_longer_than_one(rng, formulation):
    """Above 2**50 the input is scaled down by a power of two; a row more than 2**60 times
    shorter than the largest entry then comes out shorter than unit length, never longer."""
    x = rng.normal(size=(40, 6)) * 100.0
    x[0] *= 2.0**54  # largest entry ~2**61: rows shorter than ~2 may come out short
    x[1] *= 1e-7
    for axis, got in enumerate(grid_layouts(x, formulation, center=(False, False))):
        lengths = np.linalg.norm(got if axis == 0 else got.T, axis=1)
        assert np.all(np.isfinite(lengths)) and lengths.max() <= 1 + 1e-6, lengths
        np.testing.assert_allclose(np.delete(lengths, 1), 1.0, rtol=1e-5)
        assert lengths[1] < 1e-3


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_non_finite_input_is_never_a_finite_wrong_answer(rng, formulation):
    u = rng.normal(size=(40, 6))
    for bad in (np.nan, np.inf, -np.inf):
        x = u.copy()
        x[3, 4] = bad
        for axis, got in enumerate(grid_layouts(x, formulation)):
            assert not np.all(np.isfinite(got)), (bad, axis)


def test_writes_in_place_over_a_donated_input(rng):
    """``impl="cpu"``: the XLA:CPU formulation makes no full-size temporary and overwrites a
    donated input (one read-write pass of memory traffic per step)."""
    for shape, axis in [((16384, 256), 0), ((256, 16384), 1)]:
        fn = jax.jit(lambda u, a=axis: rownorm_direction(u, vocab_axis=a, impl="cpu"),
                     donate_argnums=0)
        compiled = fn.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile()
        stats = compiled.memory_analysis()
        assert stats.temp_size_in_bytes < np.prod(shape) * 4 // 2, stats
        # The very program measured runs (one compile per layout, not two).
        # jnp.asarray, not device_put: XLA must own the buffer to reuse it (a device_put one
        # is not always donated: the output then lands elsewhere); it costs a trivial compile.
        x = jnp.asarray(rng.normal(size=shape).astype(np.float32))
        want = np_project(np.asarray(x), axis)
        pointer = x.unsafe_buffer_pointer()
        y = compiled(x)
        assert y.unsafe_buffer_pointer() == pointer  # the same buffer, overwritten
        np.testing.assert_allclose(np.asarray(y), want, atol=3e-6)


def test_vmap_and_grad_agree_between_formulations(rng):
    u = rng.normal(size=(3, 30, 6)).astype(np.float32)

    def loss(name):
        fn = _FNS[name]
        return lambda x: jnp.sum(jnp.sin(fn(x, 0, eps=1e-8, center_input=True,
                                            center_output=True, num_valid=30)))

    # The vmapped call and both gradients in one jitted program (numpy in: no eager slices).
    got, *grads = jax.jit(lambda u: (jax.vmap(lambda x: rownorm_direction(x, vocab_axis=0))(u),
                                     jax.grad(loss("cpu"))(u[0]), jax.grad(loss("xla"))(u[0])))(u)
    got = np.asarray(got)
    for i in range(3):
        np.testing.assert_allclose(got[i], np_project(u[i], 0), atol=3e-6)
    np.testing.assert_allclose(*grads, atol=1e-5)


def test_impl_chooses_the_formulation_and_auto_follows_the_array(monkeypatch):
    """``impl`` names the formulation traced (only that one: no ``platform_index``); "auto"
    takes the XLA:CPU one for an array that cannot be sharded (one CPU device) and the masked
    one where the process has more devices than one."""
    spec = jax.ShapeDtypeStruct((200_000, 16), jnp.float32)
    jaxpr = lambda impl: str(jax.make_jaxpr(
        lambda u: rownorm_direction(u, vocab_axis=0, impl=impl))(spec))
    assert "dynamic_slice" in jaxpr("cpu")  # several blocks: a loop
    for impl in ("xla", "cpu", "auto"):
        assert "platform_index" not in jaxpr(impl)
    assert "dynamic_slice" not in jaxpr("xla")
    assert "dynamic_slice" in jaxpr("auto")  # this process: one CPU device
    assert _cpu.resolve_impl("auto", jax.device_put(np.zeros((2, 2), np.float32))) == "cpu"
    monkeypatch.setattr(jax, "device_count", lambda *a: 8)
    assert "dynamic_slice" not in jaxpr("auto")
    with pytest.raises(ValueError, match="impl must be one of"):
        rownorm_direction(jnp.zeros((2, 2)), vocab_axis=0, impl="masked")


def _entry_ops(compiled_text):
    """Op name -> count in the entry computation of optimized HLO text."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    ops = re.findall(r"= \S+ ([a-z][\w-]*)\(", entry)
    return {op: ops.count(op) for op in set(ops)}


@pytest.mark.parametrize("num_valid", [None, 200])
def test_accelerator_path_reads_the_head_four_times_and_writes_it_once(num_valid):
    """GPU/TPU run the masked formulation: the same program for a (V, d) table and a (d, V)
    kernel at any size, with no loop or slice that depends on the layout. Compiled, it reads the
    head four times (the column mean, the norms, the weighted column sum of the outer centring,
    the write) and writes it once on TPU (benchmarks/bench_tpu.py); the overflow guard's scale
    comes from a max beside the column mean, with no branch, which the TPU compiler fuses into
    the mean's pass and XLA:CPU runs as a fifth read (at no measurable cost). With padding rows
    XLA:CPU stores each masked operand (it does not fuse the mask's select into its
    reductions), so there only the layouts' equality is checked."""
    counts = {}
    for vocab, dim in ((256, 32), (1024, 96)):
        for axis, shape in ((0, (vocab, dim)), (1, (dim, vocab))):
            spec = jax.ShapeDtypeStruct(shape, jnp.float32)
            public = jitted(vocab_axis=axis, num_valid=num_valid)
            masked = jitted(vocab_axis=axis, num_valid=num_valid, formulation="xla")
            # What an accelerator is handed, even when lowered from this CPU process.
            for platform in ("cuda", "tpu"):
                text = public.trace(spec).lower(lowering_platforms=(platform,)).as_text()
                assert "stablehlo.while" not in text and "dynamic_slice" not in text, platform
                assert text.count("stablehlo.reduce") == masked.trace(spec).lower(
                        lowering_platforms=(platform,)).as_text().count("stablehlo.reduce")
            compiled = masked.lower(spec).compile().as_text()
            ops = _entry_ops(compiled)
            assert not {"while", "copy", "transpose"} & set(ops), ops
            traffic = head_traffic(compiled, vocab * dim)
            counts[shape] = (round(traffic.reads), round(traffic.writes))
    assert len(set(counts.values())) == 1, counts  # same passes: both layouts, both sizes
    if num_valid is None:
        assert next(iter(counts.values())) == (5, 1), counts


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
    oracle = pytest.importorskip("rowgeom.testing._oracle")
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
    oracle = pytest.importorskip("rowgeom.testing._oracle")
    pytest.importorskip("clarabel")
    rho = 1.0
    cases = [rng.normal(size=(8, 2)), rng.normal(size=(7, 3)),
             rng.normal(size=(9, 1)) @ rng.normal(size=(1, 4))]  # rank 1: ratio exactly 1
    # Every case's step and rescaled step in one jitted program (one compile, not six).
    tx = projected_rownorm(vocab_axis=0, eps=MIN_EPS, rescale="exact")
    parts = [jitted(eps=MIN_EPS) for _ in cases]
    steps, rescaled = jax.jit(lambda gs: ([f(g) for f, g in zip(parts, gs, strict=True)],
                                          [tx.update(g, None)[0] for g in gs]))(
        [g.astype(np.float32) for g in cases])
    for g, projected, big in zip(cases, steps, rescaled, strict=True):
        k = np.linalg.matrix_rank(centred(g))
        _, opt = oracle.diameter_oracle(g, rho)
        s = -(rho / 2) * np.asarray(projected, np.float64)  # step(g, rho / 2)
        decrease = -(g * s).sum()
        assert np_diameter(s) <= rho * (1 + 1e-5)
        assert jung(k) * (1 - 1e-4) <= decrease / opt <= 1 + 1e-4
        if k == 1:
            np.testing.assert_allclose(decrease / opt, 1, rtol=1e-4)
        # Beyond the paper: S * rho / D(S) is still feasible and never worse.
        s_big = -(rho / 2) * np.asarray(big, np.float64)
        assert decrease * (1 - 1e-5) <= -(g * s_big).sum() <= opt * (1 + 1e-4)
        np.testing.assert_allclose(np_diameter(s_big), rho, rtol=1e-5)


@functools.cache
def _simplex_steps():
    """k -> (G, step(G, 0.5)) for the regular simplices of SIMPLEX_KS: one program run."""
    gs = [np.eye(k + 1) - 1.0 / (k + 1) for k in SIMPLEX_KS]  # k+1 rows spanning k dimensions
    return dict(zip(SIMPLEX_KS, zip(gs, steps(gs, 0.5), strict=True), strict=True))


@pytest.mark.parametrize("k", SIMPLEX_KS)
def test_t7_regular_simplex_attains_jungs_factor(k):
    oracle = pytest.importorskip("rowgeom.testing._oracle")
    pytest.importorskip("clarabel")
    g, s = _simplex_steps()[k]
    _, opt = oracle.diameter_oracle(g, 1.0)
    decrease = -(g * s).sum()
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
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_t8_degenerate_input(rng, formulation):
    c = rng.normal(size=(1, 5)) * 100
    rows = np.repeat(c, 9, axis=0)
    g = rng.normal(size=(9, 5))
    g[[2, 5]] = 0.0
    tiny = g * 1e-3
    zero_cases = [(rows, {}), (rows.T, {"vocab_axis": 1}),  # G = 1c^T: exactly zero
                  (np.zeros((9, 5)), {}), (np.zeros((5, 9)), {"vocab_axis": 1}),
                  (c, {}), (c.T, {"vocab_axis": 1})]  # V = 1
    eps_cases = [(x, {"eps": eps, "center_output": False})
                 for eps in [MIN_EPS, 1e-8, 0.5, 10.0] for x in (g, tiny)]
    plain_case = (g, {"center_input": False, "center_output": False})
    outs = project_many([*zero_cases, plain_case, *eps_cases], formulation)  # one compile
    for (x, kw), y in zip(zero_cases, outs[:len(zero_cases)], strict=True):
        assert np.all(y == 0), (x.shape, kw)
    plain = outs[len(zero_cases)]
    assert np.all(np.isfinite(plain)) and np.all(plain[[2, 5]] == 0)
    for (_, kw), y in zip(eps_cases, outs[len(zero_cases) + 1:], strict=True):
        assert np.all(np.isfinite(y)), kw
        assert np.linalg.norm(y, axis=1).max() <= 1 + 1e-6, kw


# --- Momentum commutes with centring; optax integration -------------------------------------------


@functools.cache
def _momentum_runs(nesterov):
    """The momentum alone and chained before projected RowNorm ((d, V): tokens on axis 1), each
    stepped in order over a list of gradients and over the same gradients centred, the state
    carried from step to step: one jitted program (a jitted update per transform, run step by
    step, is the same computation at two compiles, and the centring eagerly a few more)."""
    momentum = optax.trace(decay=0.9, nesterov=nesterov)
    chained = optax.chain(momentum, projected_rownorm(vocab_axis=1))

    def run(gs, tx):
        state = tx.init(gs[0])
        outs = []
        for g in gs:
            u, state = tx.update(g, state)
            outs.append(u)
        return outs

    return jax.jit(lambda raw, pre: {name: (run(raw, tx), run(pre, tx))
                                     for name, tx in (("momentum", momentum),
                                                      ("chained", chained))})


@pytest.mark.parametrize("nesterov", [False, True])
def test_t10_centring_commutes_with_momentum(rng, nesterov):
    grads = [(rng.normal(size=(5, 12)) + 2.0).astype(np.float32) for _ in range(4)]
    centre = lambda g: g - g.mean(axis=1, keepdims=True)  # (d, V): tokens on axis 1
    outs = jax.tree.map(lambda y: np.asarray(y, np.float64),
                        _momentum_runs(nesterov)(grads, [centre(g) for g in grads]))
    raw, pre = outs["momentum"]
    for a, b in zip(raw, pre, strict=True):
        np.testing.assert_allclose(centre(a), b, atol=1e-6)  # P M(G) = M(P G)
    for a, b in zip(*outs["chained"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _params(rng):
    # Converted on the host and put on the device: jnp's conversions compile per shape.
    put = lambda shape, dtype: jax.device_put(rng.normal(size=shape).astype(dtype))
    return {
        "head": {"kernel": put((6, 20), np.float32), "bias": put((20,), np.float32)},
        "embed": put((20, 6), jnp.bfloat16),
        "norm": None,
    }


def test_transform_tree_prefix_callable_and_no_retrace(rng):
    params = _params(rng)
    want_head = np_project(params["head"]["kernel"], 1)
    want_embed = np_project(np.asarray(params["embed"], np.float32), 0)
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
    grads = jax.tree.map(lambda x: jax.device_put(np.asarray(x) * 2), params)  # exact: x2
    # init and update in one jitted program (eagerly, init compiles its zeros per leaf)
    out = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)
    np.testing.assert_allclose(out["head"]["kernel"],
                               -lr * np_project(2 * np.asarray(params["head"]["kernel"]), 1),
                               atol=1e-6)
    chex.assert_trees_all_close(out["head"]["bias"], -lr * np.asarray(grads["head"]["bias"]))
    # The callable form sees MaskedNode leaves for the other partition.
    head_only = optax.partition(
        {"head": projected_rownorm(vocab_axis=lambda p: jax.tree.map(lambda x: 1, p)),
         "other": optax.identity()}, labels)
    out = jax.jit(head_only.update)(grads, head_only.init(params), params)[0]
    np.testing.assert_allclose(out["head"]["kernel"],
                               np_project(grads["head"]["kernel"], 1), atol=2e-6)
    np.testing.assert_array_equal(np.asarray(out["embed"], np.float32),
                                  np.asarray(grads["embed"], np.float32))  # bfloat16, exactly


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "bound"])
def test_rescale(rng, mode):
    g = rng.normal(size=(5, 30)).astype(np.float32)
    padded = np.concatenate([g, np.full((5, 4), 7.0, np.float32)], axis=1)
    constant = np.ones((5, 30), np.float32)  # D = 0: no 0/0
    tx = projected_rownorm(vocab_axis=1, rescale=mode)
    tx_pad = projected_rownorm(vocab_axis=1, rescale=mode, num_valid=30)
    # One jitted program for the three updates (numpy inputs: no conversion compiles).
    out, out_pad, out_constant = (np.asarray(y, np.float64) for y in jax.jit(
        lambda g, padded, constant: (tx.update(g, tx.init(g))[0], tx_pad.update(padded, None)[0],
                                     tx.update(constant, None)[0]))(g, padded, constant))
    base = np_project(g, 1)
    factor = float(np.vdot(out, base) / np.vdot(base, base))  # a positive multiple of base:
    assert factor > 0                                          # (entrywise ratios would blow
    np.testing.assert_allclose(out, factor * base, atol=2e-6 * factor)  # up near zero)
    diameter = np_diameter(out.T)
    if mode == "exact":
        np.testing.assert_allclose(diameter, 2, rtol=1e-5)
    else:
        assert 1 - 1e-5 <= diameter <= 2 * (1 + 1e-5)
    np.testing.assert_allclose(out_pad[:, :30], out, atol=1e-5)
    assert np.all(out_pad[:, 30:] == 0)
    assert np.all(out_constant == 0)


# --- bad input ------------------------------------------------------------------------------------


def _ones(shape, dtype=np.float32):
    """A jax array of ones put from the host (jnp.ones compiles per shape and dtype)."""
    return jax.device_put(np.ones(shape, dtype))


def test_bad_input_names_the_argument():
    u = _ones((4, 3))
    with pytest.raises(TypeError, match="u must have a real floating"):
        rownorm_direction(_ones((4, 3), np.int32), vocab_axis=0)
    with pytest.raises(TypeError, match="u must have a real floating"):
        rownorm_direction(_ones((4, 3), np.complex64), vocab_axis=0)
    with pytest.raises(ValueError, match="u must have rank >= 2"):
        rownorm_direction(_ones((4,)), vocab_axis=0)
    with pytest.raises(ValueError, match="vocab_axis=2 is out of range"):
        rownorm_direction(u, vocab_axis=2)
    with pytest.raises(TypeError, match="vocab_axis must be an int"):
        rownorm_direction(u, vocab_axis="rows")
    for eps in [0.0, -1.0, float("nan"), float("inf"), 1e-45]:
        with pytest.raises(ValueError, match="eps must be"):
            rownorm_direction(u, vocab_axis=0, eps=eps)
    with pytest.raises(TypeError, match="eps must be a positive float"):
        rownorm_direction(u, vocab_axis=0, eps="small")
    with pytest.raises(ValueError, match="num_valid must be >= 1, got 0"):
        rownorm_direction(u, vocab_axis=0, num_valid=0)
    with pytest.raises(ValueError, match=r"num_valid must be <= 4 \(the vocabulary size"):
        rownorm_direction(u, vocab_axis=0, num_valid=5)
    for bad in (2.5, True):
        with pytest.raises(TypeError, match="num_valid must be an int"):
            rownorm_direction(u, vocab_axis=0, num_valid=bad)
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
        tx.update({"w": _ones((4, 3), np.int32)}, optax.EmptyState())
    with pytest.raises(ValueError, match=r"leaf \['b'\].*updates must have rank >= 2"):
        tx.update({"b": _ones((3,))}, optax.EmptyState())
