"""rowgeom.testing assertions on a vocabulary-sharded head over 8 simulated CPU devices
(Auto and Explicit mesh axes), in a subprocess: XLA_FLAGS must be set before jax is imported."""

import sys

import pytest
from _subprocess import ModuleSubprocess

SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import rowgeom, rowgeom.testing as rt

rng = np.random.default_rng(0)
kernel = rng.standard_normal((8, 48)).astype(np.float32)            # Flax (d, V) head
hidden = rng.standard_normal((5, 8)).astype(np.float32)
rows = kernel.T.astype(np.float64)
exact = float(np.linalg.norm(rows[:, None] - rows[None], axis=-1).max())
for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        head = jax.device_put(kernel, NamedSharding(mesh, P(None, "vocab")))
        tree = {"lm_head": {"kernel": head}}
        step = {"lm_head": {"kernel": rowgeom.rownorm_direction(head, vocab_axis=1)}}
        assert len(step["lm_head"]["kernel"].sharding.device_set) == 8
        rt.assert_row_diameter_at_most(step, 2.0, vocab_axis=1, method="exact")
        rt.assert_row_diameter_at_most(step, 4.001, vocab_axis=1, method="bounds")  # 2 r_c <= 4
        rt.assert_rows_zero_sum(step, vocab_axis=1)
        rt.assert_hilbert_perturbation_at_most(step, jnp.asarray(hidden), 2.0, vocab_axis=1)
        rt.assert_optimizer_does_not_retrace(
            optax.chain(rowgeom.projected_rownorm(vocab_axis=1), optax.sgd(0.1)), tree, tree)
        try:
            rt.assert_row_diameter_at_most(tree, 0.5 * exact, vocab_axis=1)
        except AssertionError as err:
            print(axis_type.name, err)
        else:
            raise SystemExit("the sharded head's diameter did not trip the assertion")
"""


@pytest.mark.slow
def test_assertions_on_a_vocab_sharded_head():
    proc = ModuleSubprocess([sys.executable, "-c", SCRIPT])
    try:
        stdout = proc.stdout()
    finally:
        proc.close()
    lines = stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["Auto", "Explicit"], stdout
    for line in lines:
        assert "leaf 'lm_head/kernel': row diameter D = " in line
        assert "(exact rowgeom.row_diameter, V = 48)" in line
