"""Sharded equals unsharded (vocabulary-sharded heads under jit) and the communication contract,
on 8 simulated CPU devices.

The checks run in one subprocess for the module (`_sharded_checks.py`, which prints one JSON
object) because XLA_FLAGS must be set before jax is imported; a failure of it is reported once.
Run it alone with `python tests/_sharded_checks.py`.
"""

import pathlib

import pytest
from _subprocess import ModuleSubprocess

pytestmark = pytest.mark.slow  # one subprocess compiling every sharded variant
SCRIPT = pathlib.Path(__file__).with_name("_sharded_checks.py")
V, D = 512, 64


@pytest.fixture(scope="module")
def checks():
    proc = ModuleSubprocess.script(SCRIPT)
    yield proc
    proc.close()


@pytest.fixture
def results(checks):
    return checks.json()


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["table", "kernel"])
def test_vocab_sharded_rownorm_matches_unsharded(results, axis_type, layout):
    res = results[axis_type]
    assert res[f"rownorm_{layout}_diff"] <= 1e-6
    assert res[f"diameter_{layout}_diff"] <= 1e-5
    assert res[f"bounds_{layout}_diff"] <= 1e-5
    assert res[f"rownorm_{layout}_sharding"] == ("P('vocab', None)" if layout == "table"
                                                 else "P(None, 'vocab')")


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_feature_sharded_head_and_tracker_match_unsharded(results, axis_type):
    assert results[axis_type]["feature_sharded_diff"] <= 1e-5
    # every_k_steps=3 over three steps: measured on 1 and 3, kept on 2, as unsharded.
    assert results[axis_type]["tracker_every_k_diff"] <= 1e-5
    assert results[axis_type]["tracker_every_k_measured"] == [3, 3]


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["table", "kernel", "feature_sharded", "tracker_every_k"])
def test_head_update_moves_only_vectors(results, axis_type, layout):
    """Only reductions of d- or V-sized vectors cross devices: never the (V, d) head itself."""
    prefix = "rownorm_" if layout in ("table", "kernel") else ""
    key = f"{prefix}{layout}_collectives"
    found = results[axis_type][key]
    assert found, "expected the means / row norms to need an all-reduce across shards"
    assert any(op == "all-reduce" for op, _ in found), found
    for op, shape in found:
        dims = [int(n) for n in shape.split("[")[1].split("]")[0].split(",") if n]
        # A vector (at most one non-unit dimension, at most max(V, d) long), never a matrix.
        is_vector = len([n for n in dims if n > 1]) <= 1 and max(dims, default=1) <= max(V, D)
        assert is_vector, (op, shape)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_muon_matches_unsharded(results, axis_type):
    res = results[axis_type]
    assert res["muon_stack_diff"] <= 1e-5
    assert res["muon_mat_diff"] <= 1e-5
