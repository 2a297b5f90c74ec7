"""Whole-matrix sharded Muon on 8 simulated CPU devices, in the fast subset.

The matrices of each shape group are padded with zero matrices to a multiple of the device
count, split along the batch axis (one whole matrix per device), orthogonalized and gathered
back: the first `batch` matrices, in the order they went in. These tests compare every result
with the same update on one device (a zero matrix padded in front, or the last `batch` matrices
taken back, moves results between leaves or replaces them with zeros: relative error about 1),
on a padded 1-D mesh (10 + 5 + 5 matrices of three shapes on 8 devices), a 2-D mesh (the batch
split over two axes), fewer matrices than devices, one wide matrix split along its long side,
Explicit axes (each update keeps its parameter's sharding) and replicated updates; and read what
the compiled update communicates (only the all-to-alls there and back; all-reduces of the Gram
matrices for the long-side split; one mesh axis at a time on the 2-D mesh; nothing for
replicated Explicit updates).

One subprocess for the module (`_muon_sharded_checks.py --fast`, XLA_FLAGS set before jax is
imported, each check compiled once with XLA's optimizations off); the whole matrix of modes and
the Newton–Schulz step-count comparison are in test_muon_sharded.py (slow).
"""

import pathlib

import pytest
from _subprocess import ModuleSubprocess

SCRIPT = pathlib.Path(__file__).with_name("_muon_sharded_checks.py")
FAST = ["auto_inside", "data_fsdp_auto", "few_auto", "wide_auto", "explicit_outside",
        "replicated_explicit"]


@pytest.fixture(scope="module")
def checks():
    proc = ModuleSubprocess.script(SCRIPT, "--fast", timeout_s=180)
    yield proc
    proc.close()


@pytest.fixture
def results(checks):
    return checks.json()


def test_fast_checks_ran(results):
    assert sorted(results) == sorted(FAST)


@pytest.mark.parametrize("name", FAST)
def test_sharded_equals_one_device(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["rel_err"] <= 1e-5


def test_explicit_updates_keep_their_parameters_sharding(results):
    assert results["explicit_outside"]["sharding_moved"] == []
    assert results["replicated_explicit"]["sharding_moved"] == []


@pytest.mark.parametrize("name", ["auto_inside", "few_auto", "explicit_outside"])
def test_each_matrix_moves_once_each_way(results, name):
    """FSDP over 8: only all-to-alls, about two per-device shares of the padded stacks."""
    res = results[name]
    assert set(res["bytes"]) == {"all-to-all"}, res["bytes"]
    assert 2 * res["spread_bytes"] <= res["bytes"]["all-to-all"] <= 2.5 * res["spread_bytes"]


def test_two_axis_mesh_moves_the_stack_one_axis_at_a_time(results):
    """(data 2, fsdp 4), updates split over fsdp: the stack moves one mesh axis at a time, out
    and back (all-to-alls; all-gathers over data on the way back, since Auto axes do not say
    the updates are replicated there), each kind about two shares of the padded stacks. Moved
    over both axes at once, the partitioner would gather whole stacks (about nine shares)."""
    res = results["data_fsdp_auto"]
    assert set(res["bytes"]) == {"all-to-all", "all-gather"}, res["bytes"]
    assert res["bytes"]["all-to-all"] <= 2.5 * res["spread_bytes"]
    assert res["bytes"]["all-gather"] <= 2.5 * res["spread_bytes"]


def test_one_wide_matrix_is_split_along_its_long_side(results):
    """(32, 1024) on 8 devices: a column share per device each way, and the (32, 32) Gram
    matrices all-reduced (not the matrix moved whole to one device)."""
    res = results["wide_auto"]
    assert set(res["bytes"]) == {"all-to-all", "all-reduce"}, res["bytes"]
    assert res["bytes"]["all-to-all"] <= 2 * 32 * 1024 * 4 / 8
    assert ["all-reduce", "f32[1,32,32]"] in res["collectives"]


def test_replicated_explicit_updates_stay_local(results):
    assert results["replicated_explicit"]["collectives"] == []
