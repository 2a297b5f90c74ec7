"""Runs in its own process with 8 simulated CPU devices (see test_sharding.py).

Prints one JSON object: for each check, the max abs difference between the sharded and the
unsharded result, and the collectives found in the compiled HLO of the sharded head update.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rowgeom  # noqa: E402

V, D = 512, 64
COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\(")
SHAPE = re.compile(r"[a-z]+\d*\[[\d,]*\]")


def collectives(compiled_text):
    """(op, result shape) for every cross-device collective in optimized HLO (tuples split)."""
    return [(op, shape) for result, op in COLLECTIVE.findall(compiled_text)
            for shape in SHAPE.findall(result)]


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def rel_diff(a, b):
    """max |a - b| relative to max(1, max |b|): for statistics whose unsharded reference is the
    native CPU kernel (float64-accumulated sums) and the sharded value XLA's float32 ones."""
    b = np.asarray(b, np.float64)
    return max_diff(a, b) / max(1.0, float(np.max(np.abs(b))))


def run(axis_type):
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    rng = np.random.default_rng(0)
    out = {}

    # Head, (V, d) table sharded along V, and (d, V) Flax kernel sharded along V.
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    for name, x, vocab_axis, spec in (
        ("table", table, 0, P("vocab", None)),
        ("kernel", table.T, 1, P(None, "vocab")),
    ):
        tx = rowgeom.projected_rownorm(vocab_axis=vocab_axis)
        step = jax.jit(lambda u, tx=tx: tx.update(u, tx.init(u))[0])
        expected = step(x)
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        with jax.set_mesh(mesh):
            got = step(xs)
            hlo = step.lower(xs).compile().as_text()
        out[f"rownorm_{name}_diff"] = max_diff(got, expected)
        out[f"rownorm_{name}_sharding"] = str(got.sharding.spec)
        out[f"rownorm_{name}_collectives"] = collectives(hlo)

        diam = jax.jit(
            lambda u, a=vocab_axis: rowgeom.row_diameter(u, vocab_axis=a, block_size=128))
        bounds = jax.jit(lambda u, a=vocab_axis: rowgeom.row_diameter_bounds(u, vocab_axis=a))
        with jax.set_mesh(mesh):
            out[f"diameter_{name}_diff"] = max_diff(diam(xs), diam(x))
            out[f"bounds_{name}_diff"] = max_diff(jnp.stack(bounds(xs)), jnp.stack(bounds(x)))

    # A (d, V) kernel sharded along its *feature* axis (as FSDP shards it): row norms and the
    # tracker's bracket need reductions of V-vectors, never the gathered kernel.
    tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=1),
                     rowgeom.track_row_diameter(vocab_axis=1))
    step = jax.jit(lambda u: tx.update(u, tx.init(u)))
    kernel = table.T
    expected_u, expected_state = step(kernel)
    xs = jax.device_put(kernel, NamedSharding(mesh, P("vocab", None)))
    with jax.set_mesh(mesh):
        got_u, got_state = step(xs)
        hlo = step.lower(xs).compile().as_text()
    out["feature_sharded_diff"] = max(
        max_diff(got_u, expected_u),
        max(max_diff(a, b) for a, b in zip(jax.tree.leaves(got_state),
                                           jax.tree.leaves(expected_state), strict=True)))
    out["feature_sharded_collectives"] = collectives(hlo)

    # The tracker with every_k_steps=3 on a feature-sharded kernel, three steps (measured, kept,
    # measured): the conditional adds no communication beyond the measuring branch's vectors.
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
    out["tracker_every_k_diff"] = max(rel_diff(a, b) for a, b in zip(
        jax.tree.leaves(got_state), jax.tree.leaves(expected_state), strict=True))
    out["tracker_every_k_measured"] = [int(got_state.measured_at), int(got_state.count)]
    out["tracker_every_k_collectives"] = collectives(hlo)

    # Hidden matrices: a stack of four (D, 4D) matrices sharded along the batch axis, and one
    # (D, 4D) matrix sharded along its columns.
    stack = jnp.asarray(rng.normal(size=(8, D, 4 * D)), jnp.float32)
    mat = jnp.asarray(rng.normal(size=(D, 4 * D)), jnp.float32)
    params = {"stack": stack, "mat": mat}
    dims = {"stack": rowgeom.MuonDimensionNumbers(reduction_axis=1, output_axis=2),
            "mat": rowgeom.MuonDimensionNumbers(reduction_axis=0, output_axis=1)}
    tx = rowgeom.muon_orthogonalize(dimension_numbers=dims)
    muon = jax.jit(lambda u: tx.update(u, tx.init(u))[0])
    expected = muon(params)
    sharded = {"stack": jax.device_put(stack, NamedSharding(mesh, P("vocab", None, None))),
               "mat": jax.device_put(mat, NamedSharding(mesh, P(None, "vocab")))}
    with jax.set_mesh(mesh):
        got = muon(sharded)
    out["muon_stack_diff"] = max_diff(got["stack"], expected["stack"])
    out["muon_mat_diff"] = max_diff(got["mat"], expected["mat"])
    return out


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    print(json.dumps({"auto": run(AxisType.Auto), "explicit": run(AxisType.Explicit)}))
