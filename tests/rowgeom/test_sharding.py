"""Sharded equals unsharded, in every way users shard, and the communication contract, on 8
CPU devices (`sharded` tests: `python -m pytest -q -m sharded`, tests/conftest.py).

Modes: Auto or Explicit mesh axes, inside or outside `jax.set_mesh`, arrays placed by
`jax.device_put` or by `jax.jit(out_shardings=...)`. Layouts: a vocabulary-sharded `(V, d)` table
and `(d, V)` kernel, and a feature-sharded `(d, V)` kernel (as FSDP shards it). For each, every
head transform and diagnostic: the max difference from the unsharded result, the result's
sharding, and from the compiled HLO the bytes every collective moves per device (and whether any
runs inside a loop).
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rowgeom
from tests._programs import compile_once

pytestmark = [pytest.mark.sharded, pytest.mark.usefixtures("sharded_devices")]
V, D = 512, 64
MODES = [f"{axes}/{where}/{placement}" for axes in ("auto", "explicit")
         for where in ("outside_set_mesh", "in_set_mesh")
         for placement in ("device_put", "out_shardings")]
SPECS = {"table_vocab_sharded": "P('x', None)", "kernel_vocab_sharded": "P(None, 'x')",
         "kernel_feature_sharded": "P('x', None)"}
# O(Vd) transforms and diagnostics: only reduced vectors may cross devices.
VECTOR_ONLY = ["projected_rownorm", "projected_rownorm_rescale_bound", "row_diameter_bounds",
               "track_row_diameter", "clip_row_diameter"]
# O(V^2 d) exact diameter: gathering the rows once is allowed, never inside its loop.
GATHER_ONCE = ["row_diameter", "clip_row_diameter_exact", "projected_rownorm_rescale_exact"]
UPDATES = ["projected_rownorm", "projected_rownorm_rescale_bound",
           "projected_rownorm_rescale_exact", "track_row_diameter", "clip_row_diameter",
           "clip_row_diameter_exact"]
HEAD_BYTES = V * D * 4
COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\(")
SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8, "bf16": 2, "f16": 2}


def collectives(compiled_text):
    """(op, result shape) for every cross-device collective in optimized HLO (tuples split)."""
    return [(op, shape.group(0)) for result, op in COLLECTIVE.findall(compiled_text)
            for shape in SHAPE.finditer(result)]


def nbytes(shape):
    dtype, dims = SHAPE.fullmatch(shape).groups()
    return DTYPE_BYTES[dtype] * int(np.prod([int(n) for n in dims.split(",") if n]))


def loop_bodies(compiled_text):
    """The HLO computations that are while-loop bodies or conditions, with their text."""
    names = set(re.findall(r"(?:body|condition)=%?([\w.-]+)", compiled_text))
    blocks = re.split(r"\n(?=\S)", compiled_text)  # computations start at column 0
    return {name: block for block in blocks for name in names
            if re.match(rf"%?{re.escape(name)}\s", block)}


def communication(compiled_text):
    found = collectives(compiled_text)
    in_loop = [c for body in loop_bodies(compiled_text).values() for c in collectives(body)]
    sizes = [nbytes(shape) for _, shape in found]
    return dict(collectives=found, total_bytes=sum(sizes), max_bytes=max(sizes, default=0),
                in_loop=in_loop)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def rel_diff(a, b):
    """max |a - b| relative to max(1, max |b|)."""
    b = np.asarray(b, np.float64)
    return max_diff(a, b) / max(1.0, float(np.max(np.abs(b))))


def head_functions(vocab_axis):
    """name -> function of the head array returning a tree of arrays, for one layout."""
    def update(tx):
        return lambda u: tx.update(u, tx.init(u))[0]

    tracker = rowgeom.track_row_diameter(vocab_axis=vocab_axis)
    return {
        "projected_rownorm": update(rowgeom.projected_rownorm(vocab_axis=vocab_axis)),
        "projected_rownorm_rescale_exact": update(
            rowgeom.projected_rownorm(vocab_axis=vocab_axis, rescale="exact")),
        "projected_rownorm_rescale_bound": update(
            rowgeom.projected_rownorm(vocab_axis=vocab_axis, rescale="bound")),
        "row_diameter": lambda u: rowgeom.row_diameter(u, vocab_axis=vocab_axis, block_size=128),
        "row_diameter_bounds": lambda u: jnp.stack(
            rowgeom.row_diameter_bounds(u, vocab_axis=vocab_axis)),
        "track_row_diameter": lambda u: tracker.update(u, tracker.init(u)),
        "clip_row_diameter": update(rowgeom.clip_row_diameter(0.5, vocab_axis=vocab_axis)),
        "clip_row_diameter_exact": update(
            rowgeom.clip_row_diameter(0.5, vocab_axis=vocab_axis, exact=True, block_size=128)),
    }


LAYOUTS = {  # name: (vocab_axis, transpose the (V, d) table, partition spec over "x")
    "table_vocab_sharded": (0, False, P("x", None)),
    "kernel_vocab_sharded": (1, True, P(None, "x")),
    "kernel_feature_sharded": (1, True, P("x", None)),
}


LAYOUT_LIST = list(LAYOUTS)


@functools.cache
def _table():
    return jnp.asarray(np.random.default_rng(0).normal(size=(V, D)), jnp.float32)


@functools.cache
def _head_functions(layout):
    """name -> (function, jitted function): one jit per function, shared by every mode (jit
    caches a compile per input sharding and mesh context)."""
    return {name: (fn, jax.jit(fn)) for name, fn in head_functions(LAYOUTS[layout][0]).items()}


@functools.cache
def _unsharded(layout):
    """The head of `layout` and every function's result on one device: one program computes
    them all (the reference; each sharded function is compiled on its own, for its HLO)."""
    vocab_axis, transpose, _ = LAYOUTS[layout]
    x = _table().T if transpose else _table()
    functions = {name: fn for name, (fn, _) in _head_functions(layout).items()}
    return x, jax.jit(lambda u: {name: fn(u) for name, fn in functions.items()})(x)


@functools.cache
def _placer(sharding):
    """A jit that places its input by `out_shardings` (one per sharding, shared by the modes)."""
    return jax.jit(lambda u: u * 1.0, out_shardings=sharding)


def _context(mesh, where):
    return jax.set_mesh(mesh) if where == "in_set_mesh" else contextlib.nullcontext()


def _compile(lowered, mesh):
    """(compiled, its communication), compiled once per distinct lowered program
    (`tests/_programs.py`): where two modes trace to the same StableHLO (Auto axes inside and
    outside `jax.set_mesh`, for most functions) they run the same executable."""
    compiled = compile_once(lowered, mesh)
    return compiled, communication(compiled.as_text())


@functools.cache
def _compiled(layout, axes, where):
    """(mesh, sharding, name -> (compiled update, its communication)): both placements give the
    same sharded input, hence the same program, compiled once for them."""
    x, _ = _unsharded(layout)
    axis_type = AxisType.Auto if axes == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    sharding = NamedSharding(mesh, LAYOUTS[layout][2])
    xs = jax.device_put(x, sharding)
    out = {}
    for name, (_, step) in _head_functions(layout).items():
        with _context(mesh, where):
            out[name] = _compile(step.lower(xs), mesh)
    return mesh, sharding, out


@functools.cache
def _head_case(mode, layout):
    """name -> dict(diff, spec, collectives...) for one mode and layout."""
    axes, where, placement = mode.split("/")
    x, expected = _unsharded(layout)
    mesh, sharding, compiled = _compiled(layout, axes, where)
    xs = (jax.device_put(x, sharding) if placement == "device_put"
          else _placer(sharding)(x))
    assert xs.sharding == sharding, (placement, xs.sharding)
    out = {}
    for name, (program, comm) in compiled.items():
        with _context(mesh, where):
            leaves = jax.tree.leaves(program(xs))
        out[name] = dict(
            diff=max(rel_diff(a, b) for a, b in zip(
                leaves, jax.tree.leaves(expected[name]), strict=True)),
            spec=str(leaves[0].sharding.spec) if hasattr(leaves[0].sharding, "spec") else None,
            **comm)
    return out


@pytest.mark.parametrize("layout", LAYOUT_LIST)
@pytest.mark.parametrize("mode", MODES)
def test_head_transforms_run_and_match_unsharded(mode, layout):
    """The unsharded result: float32 rounding (1e-6 for the unit-scale RowNorm step, 1e-5
    relative for the statistics)."""
    for name in VECTOR_ONLY + GATHER_ONCE:
        case = _head_case(mode, layout)[name]
        assert case["diff"] <= (1e-6 if name == "projected_rownorm" else 1e-5), (name, case)


@pytest.mark.parametrize("layout", LAYOUT_LIST)
@pytest.mark.parametrize("mode", MODES)
def test_head_updates_keep_the_parameter_sharding(mode, layout):
    """An update comes back sharded like its parameter (Explicit: by type; Auto: as compiled)."""
    for name in UPDATES:
        assert _head_case(mode, layout)[name]["spec"] == SPECS[layout], name


@pytest.mark.parametrize("layout", LAYOUT_LIST)
@pytest.mark.parametrize("mode", MODES)
def test_no_collective_moves_head_sized_data(mode, layout):
    """The O(Vd) operations move only reduced vectors: each collective at most one V- or
    d-vector, all of them together less than one device's shard of the head (an eighth). The
    exact diameter gathers the rows once: the head's bytes plus vectors, nothing in its scan."""
    vector = 4 * max(V, D)
    for name in VECTOR_ONLY:
        case = _head_case(mode, layout)[name]
        assert case["max_bytes"] <= vector, (name, case["collectives"])
        assert case["total_bytes"] < HEAD_BYTES / 8, (name, case["collectives"])
    for name in GATHER_ONCE:
        case = _head_case(mode, layout)[name]
        assert case["total_bytes"] <= 1.1 * HEAD_BYTES, (name, case["collectives"])
        assert not case["in_loop"], (name, case["in_loop"])


@pytest.mark.parametrize("layout", LAYOUT_LIST)
def test_the_projection_needs_an_all_reduce(layout):
    """The means (vocabulary-sharded) or the row norms (feature-sharded) cross shards: an
    all-reduce, so the byte bounds above are about real communication, not its absence."""
    case = _head_case(MODES[0], layout)["projected_rownorm"]
    assert any(op == "all-reduce" for op, _ in case["collectives"]), case["collectives"]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_tracker_every_k_steps_on_a_feature_sharded_kernel(axis_type):
    """The tracker with every_k_steps=3 on a feature-sharded kernel, three steps (measured, kept,
    measured): the unsharded statistics, and the conditional adds no communication beyond the
    measuring branch's vectors."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    sharding = NamedSharding(mesh, P("x", None))
    kernel = np.random.default_rng(1).normal(size=(D, V)).astype(np.float32)
    # The three steps' inputs, scaled on the host (scaled on the devices, each scaling would
    # compile a program of its own), unsharded and sharded.
    inputs = [kernel * np.float32(i + 1.0) for i in range(3)]
    tracker = rowgeom.track_row_diameter(vocab_axis=1, every_k_steps=3)
    tstep = jax.jit(tracker.update)

    def three_steps(us, step):
        state = tracker.init(us[0])
        for u in us:
            _, state = step(u, state)
        return state

    expected_state = three_steps([jnp.asarray(u) for u in inputs], tstep)
    xs = [jax.device_put(u, sharding) for u in inputs]
    with jax.set_mesh(mesh):
        # One compile: the steps run the program whose HLO is read.
        compiled = tstep.lower(xs[0], tracker.init(xs[0])).compile()
        got_state = three_steps(xs, compiled)
        res = communication(compiled.as_text())
    diff = max(rel_diff(a, b) for a, b in zip(
        jax.tree.leaves(got_state), jax.tree.leaves(expected_state), strict=True))
    assert diff <= 1e-5
    # every_k_steps=3 over three steps: measured on 1 and 3, kept on 2, as unsharded.
    assert [int(got_state.measured_at), int(got_state.count)] == [3, 3]
    assert 0 < res["total_bytes"] < HEAD_BYTES / 8, res["collectives"]
    assert res["max_bytes"] <= 4 * max(V, D), res["collectives"]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_sharded_muon_matches_unsharded(axis_type):
    """Hidden matrices inside `jax.set_mesh`: a stack of (D, 4D) matrices sharded along the batch
    axis, and one (D, 4D) matrix sharded along its columns."""
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    rng = np.random.default_rng(2)
    # Host arrays: placed from the host, nothing is compiled to convert or split them.
    stack = rng.normal(size=(8, D, 4 * D)).astype(np.float32)
    mat = rng.normal(size=(D, 4 * D)).astype(np.float32)
    dims = {"stack": rowgeom.MuonDimensionNumbers(reduction_axis=1, output_axis=2),
            "mat": rowgeom.MuonDimensionNumbers(reduction_axis=0, output_axis=1)}
    tx = rowgeom.muon_orthogonalize(dimension_numbers=dims)
    step = jax.jit(lambda u: tx.update(u, tx.init(u))[0])
    expected = step({"stack": stack, "mat": mat})
    sharded = {"stack": jax.device_put(stack, NamedSharding(mesh, P("vocab", None, None))),
               "mat": jax.device_put(mat, NamedSharding(mesh, P(None, "vocab")))}
    with jax.set_mesh(mesh):
        got = step(sharded)
    assert max_diff(got["stack"], expected["stack"]) <= 1e-5
    assert max_diff(got["mat"], expected["mat"]) <= 1e-5
