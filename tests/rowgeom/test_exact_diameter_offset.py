"""The exact row diameter stays accurate under a large common row offset.

The paper's authors (arXiv 2608.22253) measured D(S_t) at V = 50,257 by blocked pairwise distances
and hit float32 cancellation when the rows share a large common offset: ``sq_i + sq_j - 2<s_i,
s_j>`` then subtracts numbers of size ``||offset||^2`` to get ``D^2``. `rowgeom.row_diameter`
removes the common part before the Gram products (it centres the rows, exactly in the sense that
the centroid's own rounding is one vector shared by every row, which no pair distance sees), so
the products only ever see vectors of length at most ``D``. JAX runs with x64 off here, so there is
no float64 accumulation to fall back on: the reference is a numpy float64 brute force over every
pair of the same float32 input.
"""

import numpy as np
import pytest

import rowgeom


def _brute_force(rows: np.ndarray) -> float:
    """max_{i<j} ||s_i - s_j|| in float64, by direct differences (no Gram products): a block of
    rows against every later row, the squared differences summed one feature at a time (a
    (block, V, d) array of differences is ten times the memory traffic, and three times the
    time, for the same numbers)."""
    x = rows.astype(np.float64)
    xt = np.ascontiguousarray(x.T)
    best = 0.0
    for start in range(0, len(x), 512):
        block = x[start:start + 512]
        d2 = np.zeros((len(block), len(x) - start))
        for k in range(x.shape[1]):
            diff = block[:, k, None] - xt[k, None, start:]
            d2 += diff * diff
        best = max(best, float(d2.max()))
    return float(np.sqrt(best))


@pytest.mark.parametrize("offset,spread", [(1e3, 1e-3), (1e3, 1.0), (1.0, 1e-6)])
def test_exact_diameter_under_a_common_offset_matches_float64(offset, spread):
    rng = np.random.default_rng(0)
    num_rows, dim = 2500, 48  # three row blocks of the triangular scan at block_size 1024
    rows = rng.standard_normal((num_rows, dim)) * spread + rng.standard_normal(dim) * offset
    rows = rows.astype(np.float32)
    want = _brute_force(rows)
    # Without removing the offset, float32 Gram products could not resolve D: ||offset||^2
    # times float32's epsilon exceeds D^2 by orders of magnitude in the first case.
    for got in (rowgeom.row_diameter(rows, vocab_axis=0),
                rowgeom.row_diameter(rows.T, vocab_axis=1)):  # a Flax (d, V) kernel
        assert float(got) == pytest.approx(want, rel=1e-5)
