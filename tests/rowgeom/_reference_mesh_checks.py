"""Runs in its own process with 8 simulated CPU devices (see test_reference_numerics.py).

The float64 references of test_reference_numerics.py, on vocabulary-sharded heads: projected
RowNorm (default, without input centring, padded, eps near the row norms), the bracket with 0 and
2 sweeps, the exact diameter and the tracker, each compared with its reference (never with
another formulation). Inside ``jax.set_mesh`` this is the formulation accelerators and meshes use;
outside it, a sharded input on the one-device formulation. Prints one JSON object
``{context: {check: error}}``; test_reference_numerics.py holds the tolerances.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
# The repository root first (its rowgeom package, not the tests/rowgeom folder), then tests/
# for the shared _subprocess helper.
sys.path[:0] = [str(Path(__file__).parents[2])]
sys.path.append(str(Path(__file__).parents[1]))
jax.config.update("jax_numpy_rank_promotion", "raise")

import test_reference_numerics as ref  # noqa: E402

import rowgeom  # noqa: E402

V, D, NUM_VALID = 40, 12, 30
# 20 row norms (in units of eps) around eps: 40 rows in +/- pairs.
NORMS = np.concatenate([ref.NORMS, [0.1, 0.6, 0.75, 0.95, 1.05, 1.2, 2.0, 5.0, 7.0, 20.0]])


def rel(a, b):
    return abs(float(a) / float(b) - 1.0) if b else abs(float(a))


def bracket_errors(lower, upper, s, vocab_axis, sweeps):
    """Relative errors of the bracket against its float64 definition (0 when exact)."""
    exact = ref.brute_diameter(s, vocab_axis)
    r_c, rms_c, vocab = ref.centroid_stats(s, vocab_axis)
    lower, upper = float(lower), float(upper)
    errors = {"upper": rel(upper, 2 * r_c),
              "order": max(lower / exact - 1.0, exact / upper - 1.0, 0.0)}
    if sweeps == 0:
        centroid = max(r_c, np.sqrt(2 * vocab / (vocab - 1)) * rms_c)
        errors["lower"] = rel(lower, min(centroid, 2 * r_c))
    else:  # an actual pair's length, never below r_c
        errors["lower"] = max(np.abs(ref.pair_distances(s, vocab_axis) - lower).min() / lower,
                              max(1.0 - lower / r_c, 0.0))
    return errors


def run(axis_type, inside: bool):
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    rng = np.random.default_rng(0)
    out = {}
    context = (lambda: jax.set_mesh(mesh)) if inside else contextlib.nullcontext
    table = ref.gaussian(rng, (V, D))
    padded = table.copy()
    padded[NUM_VALID:] = 1e3
    eps_rows = ref.rows_with_norms(rng, NORMS, D, ref.EPS)
    clusters = ref.diameter_input(rng, (V, D), 0, "clusters")
    for name, vocab_axis, spec, t in (("table", 0, P("vocab", None), lambda a: a),
                                      ("kernel", 1, P(None, "vocab"), lambda a: a.T)):
        shard = lambda a, spec=spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
        variants = {
            "rownorm": (table, {}),
            "rownorm_uncentred_input": (table, {"center_input": False}),
            "rownorm_padded": (padded, {"num_valid": NUM_VALID}),
            "rownorm_eps": (eps_rows, {"eps": ref.EPS}),
        }
        for check, (x, options) in variants.items():
            tx = rowgeom.projected_rownorm(vocab_axis=vocab_axis, **options)
            step = jax.jit(lambda u, tx=tx: tx.update(u, tx.init(u))[0])
            with context():
                got = np.asarray(step(shard(t(x))), np.float64)
            want = ref.ref_rownorm(t(x), vocab_axis, **options)
            out[f"{name}_{check}"] = float(np.abs(got - want).max())
        norms = np.linalg.norm(np.moveaxis(got, vocab_axis, 0), axis=1)
        out[f"{name}_rownorm_eps_norms"] = float(
            np.abs(norms - np.minimum(np.concatenate([NORMS, NORMS]), 1.0)).max())

        s = t(clusters)
        with context():
            diameter = rowgeom.row_diameter(shard(s), vocab_axis=vocab_axis, block_size=16)
            brackets = {k: rowgeom.row_diameter_bounds(shard(s), vocab_axis=vocab_axis, sweeps=k)
                        for k in (0, 2)}
            tracker = rowgeom.track_row_diameter(vocab_axis=vocab_axis)
            _, state = jax.jit(tracker.update)(shard(s), tracker.init(shard(s)))
        out[f"{name}_diameter"] = rel(diameter, ref.brute_diameter(s, vocab_axis))
        for k, (lower, upper) in brackets.items():
            for part, err in bracket_errors(lower, upper, s, vocab_axis, k).items():
                out[f"{name}_bracket{k}_{part}"] = err
        for part, err in bracket_errors(state.lower, state.upper, s, vocab_axis, 2).items():
            out[f"{name}_tracker_{part}"] = err
        rows, _ = ref._token_rows(s, vocab_axis)
        out[f"{name}_tracker_residual"] = rel(state.row_sum_residual,
                                              np.linalg.norm(rows.sum(axis=0)))
    return out


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    print(json.dumps({"auto_mesh": run(AxisType.Auto, True),
                      "explicit_mesh": run(AxisType.Explicit, True),
                      "auto_sharded_input": run(AxisType.Auto, False)}))
