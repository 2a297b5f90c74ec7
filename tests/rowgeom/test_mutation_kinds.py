"""Fast checks for two kinds of bug a held-out mutation test found surviving the fast subset
(issue 35, "Tests that catch what slipped through"); each is a mutant of
benchmarks/mutation_test.py:

- sharded Muon padding a whole extra block of zero matrices when the stack already divides the
  devices (results unchanged; twice the work and traffic): the number of matrices Newton–Schulz
  iterates on, read from the traced update under an abstract 8-device mesh (no devices needed);
- masked RowNorm's overflow guard taking its scale from the padding rows too: huge valid rows
  (the guard's rescaled branch) beside padding rows holding inf or float32's largest values,
  against a float64 reference of the valid rows alone, in both formulations and both layouts,
  with and without the input centring (each takes the guard's scale in its own code).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from rowgeom import muon_orthogonalize, rownorm_direction

DEVICES = 8


@pytest.mark.parametrize("count", [8, 16, 10, 3])
def test_sharded_muon_pads_only_up_to_a_multiple_of_the_devices(count):
    """`count` matrices (4, 6) of one shape on an 8-device mesh: Newton–Schulz runs on
    ceil(count / 8) * 8 of them (the zero matrices that fill the last block, none when 8
    divides `count`), as its (b, 4, 4) Gram matrices show."""
    mesh = AbstractMesh((DEVICES,), ("fsdp",), axis_types=(AxisType.Auto,))
    tx = muon_orthogonalize()
    updates = {f"w{i}": jnp.zeros((4, 6), jnp.float32) for i in range(count)}
    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda u: tx.update(u, tx.init(u))[0])(updates))
    batches = {int(b) for b in re.findall(r"f32\[(\d+),4,4\]", jaxpr)}
    want = -(-count // DEVICES) * DEVICES
    if count < DEVICES:  # few matrices: whole on a device each, or split along the long side
        assert batches <= {want, count}, batches
    else:
        assert batches == {want}, (batches, want)


def _reference(x: np.ndarray, num_valid: int, axis: int, center_input: bool) -> np.ndarray:
    """Projected RowNorm of the first `num_valid` token rows in float64; padding rows zero."""
    rows = np.moveaxis(np.asarray(x, np.float64), axis, 0)[:num_valid]
    centred = rows - rows.mean(0) if center_input else rows
    y = centred / np.linalg.norm(centred, axis=1, keepdims=True)
    out = np.zeros((x.shape[axis],) + rows.shape[1:])
    out[:num_valid] = y - y.mean(0)
    return np.moveaxis(out, 0, axis)


@functools.cache
def _project(impl, vocab_axis, center_input, num_valid):
    """One jitted program per formulation, layout and centring (both fills share it)."""
    return jax.jit(lambda u: rownorm_direction(u, vocab_axis=vocab_axis, num_valid=num_valid,
                                               center_input=center_input, impl=impl))


@pytest.mark.parametrize("center_input", [True, False], ids=["centred", "uncentred"])
@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("vocab_axis", [0, 1])
@pytest.mark.parametrize("fill", [np.inf, 3e38], ids=["inf", "max"])
def test_masked_overflow_guard_scales_by_the_valid_rows_only(impl, vocab_axis, fill,
                                                             center_input):
    """Valid entries near 2**60 (squared norms overflow float32: the guard rescales) and padding
    rows holding `fill`: the result is the valid rows' projection, padding zero. A scale taken
    from the padding too is 0 (inf) or about 2**-127 (float32's largest), which turns the valid
    rows into NaN or denormals. With and without the input centring: each takes its guard's
    scale in its own code."""
    rng = np.random.default_rng(0)
    vocab, d, num_valid = 13, 6, 10
    x = rng.standard_normal((vocab, d)) * 2.0**60
    x[num_valid:] = fill
    x[num_valid:, 0] = -fill
    x = x if vocab_axis == 0 else x.T
    got = np.asarray(_project(impl, vocab_axis, center_input, num_valid)(
        jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, _reference(x, num_valid, vocab_axis, center_input),
                               rtol=0, atol=1e-6)
