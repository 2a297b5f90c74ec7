"""rowgeom.testing assertions on a vocabulary-sharded head over 8 CPU devices (Auto and
Explicit mesh axes; `sharded` tests: `python -m pytest -q -m sharded`, tests/conftest.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rowgeom
import rowgeom.testing as rt

pytestmark = [pytest.mark.sharded, pytest.mark.usefixtures("sharded_devices")]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_assertions_on_a_vocab_sharded_head(axis_type):
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((8, 48)).astype(np.float32)  # Flax (d, V) head
    hidden = rng.standard_normal((5, 8)).astype(np.float32)
    rows = kernel.T.astype(np.float64)
    exact = float(np.linalg.norm(rows[:, None] - rows[None], axis=-1).max())
    mesh = jax.make_mesh((8,), ("vocab",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        head = jax.device_put(kernel, NamedSharding(mesh, P(None, "vocab")))
        tree = {"lm_head": {"kernel": head}}
        # The step in one program (run eagerly, each of its ops would compile on its own); the
        # assertions below run eagerly, as users call them.
        direction = jax.jit(functools.partial(rowgeom.rownorm_direction, vocab_axis=1))
        step = {"lm_head": {"kernel": direction(head)}}
        assert len(step["lm_head"]["kernel"].sharding.device_set) == 8
        rt.assert_row_diameter_at_most(step, 2.0, vocab_axis=1, method="exact")
        rt.assert_row_diameter_at_most(step, 4.001, vocab_axis=1, method="bounds")  # 2 r_c <= 4
        rt.assert_rows_zero_sum(step, vocab_axis=1)
        rt.assert_hilbert_perturbation_at_most(step, jnp.asarray(hidden), 2.0, vocab_axis=1)
        rt.assert_optimizer_does_not_retrace(
            optax.chain(rowgeom.projected_rownorm(vocab_axis=1), optax.sgd(0.1)), tree, tree)
        # The sharded head's own diameter trips the assertion, with the exact method's message.
        with pytest.raises(AssertionError) as err:
            rt.assert_row_diameter_at_most(tree, 0.5 * exact, vocab_axis=1)
    assert "leaf 'lm_head/kernel': row diameter D = " in str(err.value)
    assert "(exact rowgeom.row_diameter, V = 48)" in str(err.value)
