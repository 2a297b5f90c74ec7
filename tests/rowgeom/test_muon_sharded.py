"""Sharded Muon on 8 simulated CPU devices: whole matrices on one device each, in every mode.

Every way users shard the updates (Auto or Explicit axes, inside or outside `jax.set_mesh`,
arrays placed by `device_put`, by Flax NNX sharding annotations or by a `jit`'s
`out_shardings`, eager calls, 2-D meshes, scanned stacks, fewer matrices than devices) gives
the single-device result; under Explicit axes each update keeps its parameter's sharding; and
the compiled program's collectives do not grow with the number of Newton–Schulz steps (none
inside the iteration), where the partitioner's own placement (`shard_matrices=False`)
communicates in every step.

The checks run in one subprocess for the module (`_muon_sharded_checks.py`, which prints one
JSON object) because XLA_FLAGS must be set before jax is imported; run it alone with
`python tests/rowgeom/_muon_sharded_checks.py [NAME ...]`.
"""

import pathlib

import pytest
from _subprocess import ModuleSubprocess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one subprocess, ~30 compiles
SCRIPT = pathlib.Path(__file__).with_name("_muon_sharded_checks.py")

ALL = ["auto_inside", "auto_outside", "explicit_inside", "explicit_outside",
       "auto_jit_out_shardings", "explicit_jit_out_shardings", "auto_jit_in_shardings",
       "auto_nnx", "explicit_nnx", "auto_eager", "explicit_eager", "scanned_auto",
       "scanned_explicit", "data_fsdp_auto", "data_fsdp_explicit", "fsdp_tensor_auto",
       "fsdp_tensor_explicit", "few_auto", "wide_auto", "wide_explicit", "replicated_explicit",
       "replicated_auto", "few_off", "off_auto",
       "off_explicit", "lm_auto_inside", "lm_auto_outside", "lm_fsdp_tensor_auto",
       "lm_explicit_inside", "lm_explicit_outside_untracked", "lm_explicit_outside"]
EXPLICIT = [n for n in ALL if "explicit" in n]
# Compiled, with the matrices spread over the devices (a mesh is visible and shard_matrices).
SPREAD = [n for n in ALL if n not in ("auto_jit_in_shardings", "auto_eager", "explicit_eager",
                                      "replicated_explicit", "few_off", "off_auto",
                                      "off_explicit", "wide_auto", "wide_explicit")]
ONE_AXIS = ["auto_inside", "auto_outside", "explicit_inside", "explicit_outside",
            "auto_jit_out_shardings", "explicit_jit_out_shardings", "auto_nnx", "explicit_nnx",
            "scanned_auto", "scanned_explicit", "few_auto"]


@pytest.fixture(scope="module")
def checks():
    # Started at collection of the first test; its own timeout stays below the module's.
    proc = ModuleSubprocess.script(SCRIPT, timeout_s=840)
    yield proc
    proc.close()


@pytest.fixture
def results(checks):
    return checks.json()


def test_every_check_ran(results):
    assert sorted(results) == sorted(ALL)
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors


@pytest.mark.parametrize("name", ALL)
def test_sharded_equals_one_device(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["rel_err"] <= 1e-5


@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_update_keeps_its_parameter_sharding(results, name):
    assert results[name]["sharding_moved"] == []


@pytest.mark.parametrize("name", SPREAD)
def test_no_collective_inside_newton_schulz(results, name):
    """Five and eight steps compile to the same collectives: the iteration itself is local."""
    per_steps = results[name]["collectives_per_steps"]
    assert per_steps["5"] == per_steps["8"] > 0, per_steps
    # Gram matrices of split matrices would be summed across devices: no all-reduce of a
    # square (batch of) matrices. lm_optimizer's other all-reduces are the head's: vector
    # reductions and the two pivot rows its RowNorm takes from a vocabulary-sharded head.
    for op, shape in results[name]["collectives"]:
        if op == "all-reduce":
            dims = [int(n) for n in shape.split("[")[1].rstrip("]").split(",") if n]
            assert not (len(dims) >= 2 and dims[-1] == dims[-2] > 1), (op, shape)


@pytest.mark.parametrize("name", ONE_AXIS)
def test_one_axis_mesh_moves_each_matrix_once_each_way(results, name):
    """FSDP over 8: only all-to-alls, about two per-device shares of the padded stacks (one
    there, one back; a square matrix sharded on its other axis is moved once more)."""
    res = results[name]
    assert set(res["bytes"]) == {"all-to-all"}, res["bytes"]
    assert 2 * res["spread_bytes"] <= res["bytes"]["all-to-all"] <= 2.5 * res["spread_bytes"]


def test_partitioner_placement_communicates_in_every_step(results):
    """The contrast that makes the two tests above meaningful: with shard_matrices=False the
    partitioner gathers the split matrices anew in each Newton–Schulz step."""
    for name in ("off_auto", "few_off"):
        per_steps = results[name]["collectives_per_steps"]
        assert per_steps["8"] > per_steps["5"], (name, per_steps)
        assert results[name]["bytes"].get("all-gather", 0) > 4 * results[name]["spread_bytes"]
    assert (sum(results["off_auto"]["bytes"].values())
            > 10 * sum(results["auto_inside"]["bytes"].values()))


@pytest.mark.parametrize("name", ["wide_auto", "wide_explicit"])
def test_few_wide_matrices_are_split_along_their_long_side(results, name):
    """One (32, 1024) matrix on 8 devices: split along its 1024 columns, each step sums its
    (32, 32) Gram matrix across devices (one all-reduce per step), the matrix itself moves once
    each way (a column share per device), and nothing is gathered."""
    res = results[name]
    per_steps = res["collectives_per_steps"]
    assert per_steps["8"] - per_steps["5"] == 3, per_steps
    assert set(res["bytes"]) <= {"all-to-all", "all-reduce"}, res["bytes"]
    matrix = 32 * 1024 * 4
    assert res["bytes"]["all-to-all"] <= 2 * matrix / 8
    for op, shape in res["collectives"]:
        if op == "all-reduce":
            assert shape in ("f32[1,32,32]", "f32[1]", "f32[]"), shape


def test_replicated_auto_updates_are_split_then_gathered(results):
    """Auto axes do not say that the updates are replicated: the batch is split (locally, no
    all-to-all) and the results are all-gathered, once."""
    res = results["replicated_auto"]
    assert set(res["bytes"]) == {"all-gather"}, res["bytes"]
    assert res["bytes"]["all-gather"] <= 8 * res["spread_bytes"]
    assert res["collectives_per_steps"]["5"] == res["collectives_per_steps"]["8"]


def test_replicated_explicit_updates_stay_local(results):
    """Under Explicit axes replicated updates are known to be whole on every device: nothing
    moves (each device orthogonalizes every matrix, as on one device)."""
    res = results["replicated_explicit"]
    assert res["collectives"] == [] and res["collectives_per_steps"] == {"5": 0, "8": 0}


def test_no_visible_mesh_falls_back_to_the_partitioner(results):
    """Host arrays given to a jit with in_shardings outside jax.set_mesh: no mesh is visible
    while tracing, so nothing is constrained (the partitioner's placement, same result)."""
    res = results["auto_jit_in_shardings"]
    assert res["collectives_per_steps"] == results["off_auto"]["collectives_per_steps"]
