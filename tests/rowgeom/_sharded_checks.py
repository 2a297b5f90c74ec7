"""Runs in its own process with 8 simulated CPU devices (see test_sharding.py).

Prints one JSON object. ``"head"``: for every way users shard (Auto or Explicit mesh axes, inside
or outside ``jax.set_mesh``, arrays placed by ``jax.device_put`` or by
``jax.jit(out_shardings=...)``), every head layout (vocabulary-sharded ``(V, d)`` table and
``(d, V)`` kernel, feature-sharded ``(d, V)`` kernel) and every head transform and diagnostic:
the error if it raised, the max difference from the unsharded result, the result's sharding,
and from the compiled HLO the bytes every collective moves per device (and whether any runs
inside a loop). ``"tracker_every_k"`` and ``"muon"``: the tracker's conditional and sharded Muon,
inside ``jax.set_mesh``.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rowgeom  # noqa: E402

V, D = 512, 64
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


def head_checks():
    table = jnp.asarray(np.random.default_rng(0).normal(size=(V, D)), jnp.float32)
    out = {}
    for layout, (vocab_axis, transpose, spec) in LAYOUTS.items():
        x = table.T if transpose else table
        fns = head_functions(vocab_axis)
        expected = {name: jax.jit(fn)(x) for name, fn in fns.items()}
        for axis_type in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
            sharding = NamedSharding(mesh, spec)
            placed = {"device_put": jax.device_put(x, sharding),
                      "out_shardings": jax.jit(lambda u: u * 1.0, out_shardings=sharding)(x)}
            for placement, xs in placed.items():
                assert xs.sharding == sharding, (placement, xs.sharding)
                for inside in (False, True):
                    mode = (f"{axis_type.name.lower()}/{'in' if inside else 'outside'}_set_mesh/"
                            f"{placement}")
                    for name, fn in fns.items():
                        key = f"{mode}/{layout}/{name}"
                        try:
                            step = jax.jit(fn)
                            if inside:
                                with jax.set_mesh(mesh):
                                    compiled = step.lower(xs).compile()
                                    got = compiled(xs)
                            else:
                                compiled = step.lower(xs).compile()
                                got = compiled(xs)
                            leaves = jax.tree.leaves(got)
                            out[key] = dict(
                                error=None,
                                diff=max(rel_diff(a, b) for a, b in zip(
                                    leaves, jax.tree.leaves(expected[name]), strict=True)),
                                spec=str(leaves[0].sharding.spec)
                                if hasattr(leaves[0].sharding, "spec") else None,
                                **communication(compiled.as_text()))
                        except Exception as e:  # noqa: BLE001 - reported, one line per case
                            out[key] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return out


def tracker_every_k(axis_type):
    """The tracker with every_k_steps=3 on a feature-sharded kernel, three steps (measured, kept,
    measured): the conditional adds no communication beyond the measuring branch's vectors."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    kernel = jnp.asarray(np.random.default_rng(1).normal(size=(D, V)), jnp.float32)
    xs = jax.device_put(kernel, NamedSharding(mesh, P("x", None)))
    tracker = rowgeom.track_row_diameter(vocab_axis=1, every_k_steps=3)
    tstep = jax.jit(tracker.update)

    def three_steps(u):
        state = tracker.init(u)
        for i in range(3):
            _, state = tstep(u * (i + 1.0), state)
        return state

    expected_state = three_steps(kernel)
    with jax.set_mesh(mesh):
        got_state = three_steps(xs)
        hlo = tstep.lower(xs, tracker.init(xs)).compile().as_text()
    return dict(diff=max(rel_diff(a, b) for a, b in zip(
                    jax.tree.leaves(got_state), jax.tree.leaves(expected_state), strict=True)),
                measured=[int(got_state.measured_at), int(got_state.count)],
                **communication(hlo))


def muon(axis_type):
    """Hidden matrices: a stack of (D, 4D) matrices sharded along the batch axis, and one (D, 4D)
    matrix sharded along its columns."""
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    rng = np.random.default_rng(2)
    stack = jnp.asarray(rng.normal(size=(8, D, 4 * D)), jnp.float32)
    mat = jnp.asarray(rng.normal(size=(D, 4 * D)), jnp.float32)
    params = {"stack": stack, "mat": mat}
    dims = {"stack": rowgeom.MuonDimensionNumbers(reduction_axis=1, output_axis=2),
            "mat": rowgeom.MuonDimensionNumbers(reduction_axis=0, output_axis=1)}
    tx = rowgeom.muon_orthogonalize(dimension_numbers=dims)
    step = jax.jit(lambda u: tx.update(u, tx.init(u))[0])
    expected = step(params)
    sharded = {"stack": jax.device_put(stack, NamedSharding(mesh, P("vocab", None, None))),
               "mat": jax.device_put(mat, NamedSharding(mesh, P(None, "vocab")))}
    with jax.set_mesh(mesh):
        got = step(sharded)
    return dict(stack_diff=max_diff(got["stack"], expected["stack"]),
                mat_diff=max_diff(got["mat"], expected["mat"]))


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
    print(json.dumps({"head_bytes": HEAD_BYTES, "head": head_checks(),
                      "tracker_every_k": {k: tracker_every_k(t) for k, t in types.items()},
                      "muon": {k: muon(t) for k, t in types.items()}}))
