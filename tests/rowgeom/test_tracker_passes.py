"""The tracker's passes over the update (benchmarks/hlo_passes.py) and its rescaled branch.

The row-diameter bracket reads the update four times on the path that always runs (the row sum,
the centred norms, one matrix-vector product per sweep); when its upper end is outside float32's
safe range a branch recomputes the centred norms only, at a power-of-two scale, in two passes on
TPU (sibling maxima and a scaled sum, then the norms: benchmarks/bench_tpu.py), and the sweeps
run once after it at that scale. These tests hold the counts on XLA:CPU and the branch's results
against float64.
"""

import functools
import re

import jax
import numpy as np
import pytest
from _geometry_shared import tracker_hlo

import rowgeom
from benchmarks.hlo_passes import head_traffic
from rowgeom._geometry import _bounds_and_sum, _take_row, _token_view

VOCAB, DIM = 1024, 96


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("axis", [0, 1])
def test_tracker_reads_four_times_and_its_rescaling_branch_only_the_norms(axis, impl):
    """Four reads and no write of the update's size on the path that runs, whatever the layout;
    the rescaling branch reads it at most four times (XLA:CPU runs its three sibling reductions
    as three reads; the TPU compiler fuses them into one) and writes nothing: no scaled copy of
    the rows, and the sweeps are not in it. A sweep's rows of a (d, V) kernel come from the
    aligned 128-token block that holds them (4 takes of 128 tokens here); a few rows more are
    read where the pair lengths and the centre are taken."""
    shape = (VOCAB, DIM) if axis == 0 else (DIM, VOCAB)
    traffic = head_traffic(tracker_hlo(shape, axis, impl), VOCAB * DIM)  # shared
    takes = 4 * (128 if axis == 1 else 1) / VOCAB
    assert 4 <= traffic.reads <= 4 + takes + 0.05 and traffic.writes == 0, traffic.ops
    costly = [b for b in traffic.branches if b.reads or b.writes]
    assert len(costly) == 1, traffic.branches
    assert costly[0].reads <= 4 and costly[0].writes == 0, costly[0].ops
    assert not [op for op in costly[0].ops if op[1] in ("dot", "gather")], costly[0].ops


def test_loop_trip_count_read_from_the_loop_when_the_backend_records_none():
    """The TPU compiler records no known_trip_count: the sweeps' loop is counted from its
    condition (counter < 2) and initial counter, as XLA:CPU's record says."""
    hlo = tracker_hlo((VOCAB, DIM), 0, "xla")
    assert "known_trip_count" in hlo
    stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", hlo)
    assert "known_trip_count" not in stripped
    full, bare = head_traffic(hlo, VOCAB * DIM), head_traffic(stripped, VOCAB * DIM)
    assert (full.reads, full.writes) == (bare.reads, bare.writes)
    assert round(bare.reads) == 4


def _edge_cases():
    rng = np.random.default_rng(3)
    return {
        "ordinary": rng.standard_normal((300, 17)),
        "sum_overflows": rng.standard_normal((300, 17)) * 1e36 + 1e37,
        "huge_spread": rng.standard_normal((300, 17)) * 1e37,
        "tiny": rng.standard_normal((300, 17)) * 1e-30,
        "tiny_spread_on_offset": 1e-25 + rng.standard_normal((300, 17)) * 1e-27,
        "tiny_spread_beside_a_constant_column": np.concatenate(
            [np.ones((300, 1)), rng.standard_normal((300, 16)) * 1e-35], axis=1),
        "zeros": np.zeros((300, 17)),
    }


@functools.cache
def _bounds_jit(impl):
    """The bracket (two sweeps) of a (300, 17) input with tokens along axis 0 and of a (17, 300)
    one along axis 1, in one program per formulation: every edge case is that shape, so they
    share its compile."""
    bounds = lambda u, axis: _bounds_and_sum(u, axis=axis, sweeps=2, impl=impl)[:2]  # noqa: E731
    return jax.jit(lambda u0, u1: (bounds(u0, 0), bounds(u1, 1)))


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("case", sorted(_edge_cases()))
def test_bracket_on_both_paths_matches_float64(case, impl):
    """On the fast path and through the rescaling branch (rows too large or too close for
    float32 squares, a row sum that overflows): lower <= D <= upper, the upper end is
    2 max ||x_i - xbar|| of float64, and the lower end at least max ||x_i - xbar||."""
    x = _edge_cases()[case].astype(np.float32)
    rows = x.astype(np.float64)
    exact = max((np.linalg.norm(a - b) for a in rows for b in rows), default=0.0)
    r_c = np.linalg.norm(rows - rows.mean(axis=0), axis=1).max()
    both = _bounds_jit(impl)(x, np.ascontiguousarray(x.T))  # numpy: no conversion compiles
    for axis, bounds in enumerate(both):
        lower, upper = (float(v) for v in bounds)
        assert np.isfinite([lower, upper]).all()
        assert lower <= exact * (1 + 1e-5) and exact <= upper * (1 + 1e-5), (axis, lower, upper)
        np.testing.assert_allclose(upper, 2 * r_c, rtol=1e-5, err_msg=f"axis={axis}")
        assert lower >= r_c * (1 - 1e-5), (axis, lower, r_c)


def test_tracker_stats_are_the_brackets_on_the_rescaling_branch():
    u = _edge_cases()["tiny_spread_on_offset"].astype(np.float32)
    tx = rowgeom.track_row_diameter(vocab_axis=0)
    stats = jax.jit(lambda u: tx.update(u, tx.init(u))[1])(u)  # one compile (eagerly: 18)
    # row_diameter_bounds(u, vocab_axis=0) (two sweeps, "xla"), in the edge cases' program
    lower, upper = _bounds_jit("xla")(u, np.ascontiguousarray(u.T))[0]
    assert (float(stats.lower), float(stats.upper)) == (float(lower), float(upper))
    np.testing.assert_allclose(float(stats.row_sum_residual),
                               np.linalg.norm(np.asarray(u, np.float64).sum(axis=0)), rtol=1e-5)


@pytest.mark.parametrize("vocab", [128, 300, 1000])
def test_a_row_taken_from_its_block_is_the_row(vocab):
    """`_take_row` of a (d, V) view picks the row from its aligned 128-token block (the last
    block ends at V); a NaN elsewhere in the block does not reach it."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((7, vocab)).astype(np.float32)
    view, t = _token_view(jax.device_put(x), 1)  # placed, not converted: no compile
    take = jax.jit(lambda v, i: _take_row(v, t, i))
    for index in sorted({0, 1, 127, min(128, vocab - 1), vocab // 2, vocab - 129, vocab - 1}):
        if index < 0:
            continue
        np.testing.assert_array_equal(take(view, np.int32(index)), x[:, index:index + 1])
        poisoned = x.copy()
        poisoned[:, index - 1 if index else index + 1] = np.nan
        got = take(_token_view(jax.device_put(poisoned), 1)[0], np.int32(index))
        np.testing.assert_array_equal(got, x[:, index:index + 1])
