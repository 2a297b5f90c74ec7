"""Runs in its own process with 8 simulated CPU devices (see test_transform_battery.py).

For every battery case and every mesh layout, two jitted update steps on sharded inputs are
compared with the same steps on unsharded inputs. Prints one JSON object on its last line:
``{layout: {case: {"updates": rel. difference, "state": rel. difference, "param_specs": [...],
"resharded": [...]} | {"error": text}}}``; a case that raises is reported, not fatal, so one
failure does not hide the rest.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _battery_cases as bc  # noqa: E402

AUTO = AxisType.Auto
EXPLICIT = AxisType.Explicit
# "8" and "2x4": Auto axes; "8-explicit": the 8-way layout with Explicit axes (what
# jax.make_mesh gives by default), where sharding is part of every array's type.
LAYOUTS = ("8", "2x4", "8-explicit")


def _spec(shape, layout):
    """Where a leaf is split. The vocabulary axis (size V or VPAD) is sharded when the mesh axis
    divides it; V = 100 does not divide by 8, so on the 8-way mesh such a head is split along
    its feature axis instead (as FSDP does), and on the 2x4 mesh its vocabulary goes 4 ways."""
    if len(shape) == 1:
        return P("data") if layout == "2x4" else P("x")
    vocab = next((i for i, n in enumerate(shape) if n in (bc.V, bc.VPAD)), 1)
    other = 1 - vocab
    spec = [None, None]
    if layout == "2x4":
        spec[vocab], spec[other] = "model", "data"
    elif shape[vocab] % 8 == 0:
        spec[vocab] = "x"
    else:
        spec[other] = "x"
    return P(*spec)


def _mesh(layout):
    if layout == "2x4":
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    return jax.make_mesh((8,), ("x",), axis_types=(EXPLICIT if "explicit" in layout else AUTO,))


def _spec_str(x):
    """The array's PartitionSpec without trailing Nones (P('x', None) and P('x') are equal)."""
    spec = list(x.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return str(P(*spec))


def _two_steps(tx, params, grads):
    step = bc.step(tx)
    state = tx.init(params)
    outs = []
    for g in grads:
        updates, state = step(g, state, params)
        outs.append(updates)
    return outs, state


def _rel_diff(got, want):
    """Max over leaves of max|got - want| / max|want| (each leaf on its own scale)."""
    la, lb = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(la) == len(lb), (len(la), len(lb))
    worst = 0.0
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.size:
            scale = max(float(np.max(np.abs(y))), 1e-30)
            worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return worst


def run_case(case, layout, want):
    params = bc.params_for(case)
    grads = [bc.grads_for(params, seed) for seed in (0, 10)]
    tx = case.build()
    mesh = _mesh(layout)

    def place(tree):
        return jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, _spec(x.shape, layout))), tree)

    with jax.set_mesh(mesh):
        placed = place(params)
        got_updates, got_state = _two_steps(tx, placed, [place(g) for g in grads])
        placed_specs = [_spec_str(x) for x in jax.tree.leaves(placed)]
        update_specs = [_spec_str(x) for x in jax.tree.leaves(got_updates[-1])]
    return {"updates": _rel_diff(got_updates, want[0]), "state": _rel_diff(got_state, want[1]),
            "param_specs": placed_specs,
            # leaves whose update is not sharded like its parameter: (param spec, update spec)
            "resharded": [(p, u) for p, u in zip(placed_specs, update_specs, strict=True)
                          if p != u]}


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {layout: {} for layout in LAYOUTS}
    for case in bc.CASES:
        params = bc.params_for(case)
        grads = [bc.grads_for(params, seed) for seed in (0, 10)]
        want = _two_steps(case.build(), params, grads)  # unsharded, once per case
        for layout in LAYOUTS:
            try:
                out[layout][case.name] = run_case(case, layout, want)
            except Exception:  # reported per case; the test shows the traceback
                out[layout][case.name] = {"error": traceback.format_exc(limit=6)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
