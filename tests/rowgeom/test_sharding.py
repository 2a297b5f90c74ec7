"""Sharded equals unsharded, in every way users shard, and the communication contract, on 8
simulated CPU devices.

The checks run in one subprocess for the module (`_sharded_checks.py`, which prints one JSON
object) because XLA_FLAGS must be set before jax is imported; a failure of it is reported once.
Run it alone with `python tests/rowgeom/_sharded_checks.py`.

Modes: Auto or Explicit mesh axes, inside or outside `jax.set_mesh`, arrays placed by
`jax.device_put` or by `jax.jit(out_shardings=...)`. Layouts: a vocabulary-sharded `(V, d)` table
and `(d, V)` kernel, and a feature-sharded `(d, V)` kernel (as FSDP shards it).
"""

import pathlib

import pytest
from _subprocess import ModuleSubprocess

pytestmark = pytest.mark.slow  # one subprocess compiling every sharded variant
SCRIPT = pathlib.Path(__file__).with_name("_sharded_checks.py")
MODES = [f"{axes}/{where}/{placement}" for axes in ("auto", "explicit")
         for where in ("outside_set_mesh", "in_set_mesh")
         for placement in ("device_put", "out_shardings")]
V, D = 512, 64  # as in _sharded_checks.py
LAYOUTS = ["table_vocab_sharded", "kernel_vocab_sharded", "kernel_feature_sharded"]
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


@pytest.fixture(scope="module")
def checks():
    proc = ModuleSubprocess.script(SCRIPT)
    yield proc
    proc.close()


@pytest.fixture
def results(checks):
    return checks.json()


def _case(results, mode, layout, name):
    case = results["head"][f"{mode}/{layout}/{name}"]
    assert case["error"] is None, case["error"]
    return case


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_head_transforms_run_and_match_unsharded(results, mode, layout):
    """No error, and the unsharded result: float32 rounding (1e-6 for the unit-scale RowNorm
    step, 1e-5 relative for the statistics)."""
    for name in VECTOR_ONLY + GATHER_ONCE:
        case = _case(results, mode, layout, name)
        assert case["diff"] <= (1e-6 if name == "projected_rownorm" else 1e-5), (name, case)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_head_updates_keep_the_parameter_sharding(results, mode, layout):
    """An update comes back sharded like its parameter (Explicit: by type; Auto: as compiled)."""
    for name in UPDATES:
        assert _case(results, mode, layout, name)["spec"] == SPECS[layout], name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_no_collective_moves_head_sized_data(results, mode, layout):
    """The O(Vd) operations move only reduced vectors: each collective at most one V- or
    d-vector, all of them together less than one device's shard of the head (an eighth). The
    exact diameter gathers the rows once: the head's bytes plus vectors, nothing in its scan."""
    head, vector = results["head_bytes"], 4 * max(V, D)
    for name in VECTOR_ONLY:
        case = _case(results, mode, layout, name)
        assert case["max_bytes"] <= vector, (name, case["collectives"])
        assert case["total_bytes"] < head / 8, (name, case["collectives"])
    for name in GATHER_ONCE:
        case = _case(results, mode, layout, name)
        assert case["total_bytes"] <= 1.1 * head, (name, case["collectives"])
        assert not case["in_loop"], (name, case["in_loop"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_projection_needs_an_all_reduce(results, layout):
    """The means (vocabulary-sharded) or the row norms (feature-sharded) cross shards: an
    all-reduce, so the byte bounds above are about real communication, not its absence."""
    case = _case(results, MODES[0], layout, "projected_rownorm")
    assert any(op == "all-reduce" for op, _ in case["collectives"]), case["collectives"]


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_tracker_every_k_steps_on_a_feature_sharded_kernel(results, axis_type):
    res = results["tracker_every_k"][axis_type]
    assert res["diff"] <= 1e-5
    # every_k_steps=3 over three steps: measured on 1 and 3, kept on 2, as unsharded.
    assert res["measured"] == [3, 3]
    assert 0 < res["total_bytes"] < results["head_bytes"] / 8, res["collectives"]
    assert res["max_bytes"] <= 4 * max(V, D), res["collectives"]


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_muon_matches_unsharded(results, axis_type):
    res = results["muon"][axis_type]
    assert res["stack_diff"] <= 1e-5
    assert res["mat_diff"] <= 1e-5
