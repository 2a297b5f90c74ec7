"""rowgeom.testing assertions: each passes on correct input and trips on purpose with a message
naming the leaf path and the measured value, checked against independent float64 numpy values."""

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rowgeom
import rowgeom.testing as rt


def put(x, dtype=np.float32):
    """A jax array of `x` (numpy, or anything numpy reads) in `dtype`, converted on the host and
    put on the device: jnp.asarray, jnp.ones and eager casts or .at[] edits compile per shape."""
    return jax.device_put(np.asarray(x).astype(dtype))


@functools.cache
def _jitted(fn, **static):
    """A public function jitted once per options (eagerly, each of its operations compiles)."""
    return jax.jit(functools.partial(fn, **static))


def np_row_diameter(x, axis):
    rows = np.moveaxis(np.asarray(x, np.float64), axis, 0).reshape(np.shape(x)[axis], -1)
    return float(np.linalg.norm(rows[:, None] - rows[None], axis=-1).max())


def measured(message, name):
    """The number printed after `name = ` (or `name >= `) in an assertion message."""
    match = re.search(re.escape(name) + r" (?:=|>=) (-?[0-9.e+-]+|nan|inf)", message)
    assert match, message
    return float(match.group(1))


@pytest.fixture(scope="module")
def head():
    """A Flax-layout (d, V) head step inside a model-shaped tree, and its float64 diameter."""
    rng = np.random.default_rng(0)
    kernel = put(rng.standard_normal((8, 12)))
    tree = {"embed": {"embedding": put(np.zeros((12, 8)))}, "norm": {"scale": put(np.ones(8))},
            "lm_head": {"kernel": kernel}}
    return tree, np_row_diameter(kernel, 1)


# --- assert_row_diameter_at_most -----------------------------------------------------------


def test_row_diameter_exact_passes_at_the_diameter_and_trips_below(head):
    tree, diameter = head
    select = {"lm_head": 1}
    rt.assert_row_diameter_at_most(tree, diameter, vocab_axis=select)
    rt.assert_row_diameter_at_most(tree, diameter, vocab_axis={"lm_head/kernel": 1})
    with pytest.raises(AssertionError) as err:
        rt.assert_row_diameter_at_most(tree, 0.99 * diameter, vocab_axis=select)
    message = str(err.value)
    assert message.startswith("leaf 'lm_head/kernel': row diameter D = ")
    assert "(exact rowgeom.row_diameter, V = 12)" in message
    np.testing.assert_allclose(measured(message, "D"), diameter, rtol=1e-6)


def test_row_diameter_bracket_certifies_both_ways(head):
    tree, diameter = head
    kernel = tree["lm_head"]["kernel"]
    # Above the bracket's upper end (<= 2 D): certified without the O(V^2 d) scan.
    rt.assert_row_diameter_at_most(kernel, 2.0 * diameter, vocab_axis=1, method="bounds")
    with pytest.raises(AssertionError) as err:  # below its lower end (>= D / 2): certified
        rt.assert_row_diameter_at_most(kernel, 0.4 * diameter, vocab_axis=1, method="bounds")
    message = str(err.value)
    assert message.startswith("leaf '(root)': row diameter D >= ")
    assert "certified bracket rowgeom.row_diameter_bounds" in message
    lower = measured(message, "D")
    upper = float(re.search(r"<= D <= ([0-9.e+-]+)", message).group(1))
    assert lower <= diameter * (1 + 1e-6) and diameter <= upper * (1 + 1e-6)


def test_row_diameter_inconclusive_bracket():
    # Rows on a circle: the centroid bound 2 r_c overshoots D, so D itself is not certified.
    angles = np.linspace(0, 2 * np.pi, 7, endpoint=False)
    rows = put(np.stack([np.cos(angles), np.sin(angles)], 1))
    diameter = np_row_diameter(rows, 0)
    lower, upper = (float(b) for b in _jitted(rowgeom.row_diameter_bounds, vocab_axis=0)(rows))
    assert lower <= diameter < 0.99 * upper
    with pytest.raises(AssertionError, match=r"D <= bound .* not certified: "
                       r"rowgeom.row_diameter_bounds gives \[.*\] \(V = 7\); use method='exact'"):
        rt.assert_row_diameter_at_most(rows, diameter, vocab_axis=0, method="bounds")
    # "auto" above exact_max_vocab falls back to the exact value when the bracket is inconclusive.
    rt.assert_row_diameter_at_most(rows, diameter, vocab_axis=0, exact_max_vocab=2)


def test_row_diameter_auto_falls_back_to_exact():
    # Two farthest-point sweeps miss this set's diametral pair ([-3, 0], [4, 0]): D = 7 lies
    # strictly inside the bracket, so only the exact scan can show that D > 6.9.
    rows = put([[-2.5, 1.5], [2.5, 1.5], [3.0, 0.0], [-3.0, 0.0], [1.0, 1.0],
                [-1.0, -4.0], [4.0, 0.0]])
    lower, upper = (float(b) for b in _jitted(rowgeom.row_diameter_bounds, vocab_axis=0)(rows))
    assert lower < 6.9 < 7.0 == np_row_diameter(rows, 0) < upper
    with pytest.raises(AssertionError) as err:
        rt.assert_row_diameter_at_most({"head": rows}, 6.9, vocab_axis=0, exact_max_vocab=2)
    assert str(err.value) == (
        f"leaf 'head': row diameter D = 7 > bound 6.9 (exact rowgeom.row_diameter after the "
        f"inconclusive bracket [{lower:.8g}, {upper:.8g}], V = 7)")


def test_row_diameter_bounds_bracket_rows_with_a_large_offset():
    rng = np.random.default_rng(3)
    rows = put(rng.standard_normal((2, 8)) + 1e5 * rng.standard_normal(8))
    diameter = np_row_diameter(rows, 0)
    lower, upper = (float(b) for b in _jitted(rowgeom.row_diameter_bounds, vocab_axis=0)(rows))
    assert lower <= diameter * (1 + 1e-6) and diameter <= upper * (1 + 1e-6), (lower, diameter,
                                                                               upper)
    # Certified even at bound = D: the assertion measures pivoted rows, so the upper end is tight.
    rt.assert_row_diameter_at_most(rows, diameter, vocab_axis=0, method="bounds")


def test_row_diameter_nnx_state_paths_and_nan():
    class Head(nnx.Module):
        def __init__(self, rngs):
            self.lm_head = nnx.Linear(8, 12, use_bias=False, rngs=rngs)

    # Built abstractly and given a numpy draw (its random init, run eagerly, compiled each op)
    state = nnx.state(nnx.eval_shape(lambda: Head(nnx.Rngs(0))), nnx.Param)  # nnx.Param leaves
    kernel = np.random.default_rng(5).standard_normal((8, 12)).astype(np.float32)
    nnx.replace_by_pure_dict(state, {"lm_head": {"kernel": put(kernel)}})
    diameter = np_row_diameter(state["lm_head"]["kernel"].get_value(), 1)
    rt.assert_row_diameter_at_most(state, diameter, vocab_axis=1)
    with pytest.raises(AssertionError, match=r"^leaf 'lm_head/kernel': row diameter D = "):
        rt.assert_row_diameter_at_most(state, diameter / 2, vocab_axis=1)
    bad = np.zeros((12, 8), np.float32)
    bad[1, 0] = np.nan
    bad = put(bad)
    for kwargs in ({}, {"exact_max_vocab": 1}):  # exact, and the bracket's exact fallback
        with pytest.raises(AssertionError, match=r"row diameter D = nan > bound 1 "):
            rt.assert_row_diameter_at_most({"w": bad}, 1.0, vocab_axis=0, **kwargs)


def test_row_diameter_bad_arguments(head):
    tree, _ = head
    with pytest.raises(ValueError, match=r"vocab_axis names \[.lm_haed.\], which are not in"):
        rt.assert_row_diameter_at_most(tree, 1.0, vocab_axis={"lm_haed": 1})
    with pytest.raises(ValueError, match=r"leaf .norm/scale.: expected an array of rank >= 2 "):
        rt.assert_row_diameter_at_most(tree, 1.0, vocab_axis=0)
    with pytest.raises(TypeError, match="leaf 'w': expected a floating array, got dtype int32"):
        rt.assert_row_diameter_at_most({"w": put(np.ones((3, 2)), np.int32)}, 1.0, vocab_axis=0)
    with pytest.raises(ValueError, match="bound must be finite and >= 0"):
        rt.assert_row_diameter_at_most(tree, -1.0, vocab_axis={"lm_head": 1})
    with pytest.raises(TypeError, match="call them outside jax.jit"):
        jax.jit(lambda x: rt.assert_row_diameter_at_most(x, 1.0, vocab_axis=0))(
            put(np.ones((3, 2))))


# --- assert_rows_zero_sum ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_zero_sum_passes_on_projected_rownorm_and_trips_on_the_gradient(dtype):
    rng = np.random.default_rng(1)
    grad = put(rng.standard_normal((8, 12)) + 0.3, dtype)  # (d, V), not zero-sum
    tree = {"lm_head": {"kernel": grad}}
    step = {"lm_head": {"kernel": _jitted(rowgeom.rownorm_direction, vocab_axis=1)(grad)}}
    rt.assert_rows_zero_sum(step, vocab_axis=1)
    with pytest.raises(AssertionError) as err:
        rt.assert_rows_zero_sum(tree, vocab_axis=1)
    message = str(err.value)
    assert message.startswith("leaf 'lm_head/kernel': token rows do not sum to zero: ")
    rows = np.asarray(grad, np.float64).T
    total = rows.sum(0)
    reference = np.linalg.norm(total) / (12 * np.linalg.norm(rows, axis=1).max())
    np.testing.assert_allclose(measured(message, "max_i ||s_i||)"), reference, rtol=1e-3)
    np.testing.assert_allclose(measured(message, "||sum_i s_i||"), np.linalg.norm(total),
                               rtol=1e-3)
    worst = int(np.argmax(np.abs(total)))
    assert f"worst feature ({worst},) sums to {total[worst]:.4g}" in message


def test_zero_sum_padded_rows():
    rng = np.random.default_rng(2)
    grad = put(rng.standard_normal((12, 8)))  # (V, d), 3 padded rows
    step = np.asarray(_jitted(rowgeom.rownorm_direction, vocab_axis=0, num_valid=9)(grad))
    rt.assert_rows_zero_sum(put(step), vocab_axis=0, num_valid=9)
    with pytest.raises(AssertionError, match=r"token rows do not sum to zero"):
        moved = step.copy()
        moved[3] += np.float32(0.1)
        rt.assert_rows_zero_sum(put(moved), vocab_axis=0, num_valid=9)
    leaky = step.copy()
    leaky[10, 2] = 0.25
    leaky = put(leaky)
    with pytest.raises(AssertionError) as err:
        rt.assert_rows_zero_sum({"head": leaky}, vocab_axis=0, num_valid=9)
    assert str(err.value) == (
        "leaf 'head': padded token rows (index >= num_valid = 9) must be zero: row 10 has "
        "max |entry| = 0.25 (1 non-zero padded rows, V = 12)")


# --- assert_hilbert_perturbation_at_most ---------------------------------------------------


def test_hilbert_perturbation_theorem_1_is_tight():
    rng = np.random.default_rng(3)
    step = rng.standard_normal((16, 5))  # (V, d)
    diameter = np_row_diameter(step, 0)
    a, b = np.unravel_index(np.argmax(np.linalg.norm(step[:, None] - step[None], axis=-1)),
                            (16, 16))
    far = 2.5 * (step[a] - step[b]) / np.linalg.norm(step[a] - step[b])  # attains ||h|| D
    hidden = np.concatenate([rng.standard_normal((3, 5)), far[None]])
    kernel = put(step.T)  # Flax (d, V) layout
    tree = {"lm_head": {"kernel": kernel}}
    rt.assert_hilbert_perturbation_at_most(tree, put(hidden), diameter,
                                           vocab_axis=1)
    with pytest.raises(AssertionError) as err:
        rt.assert_hilbert_perturbation_at_most(tree, put(hidden),
                                               0.9 * diameter, vocab_axis=1)
    message = str(err.value)
    assert message.startswith("leaf 'lm_head/kernel': Hilbert perturbation at hidden[3] is ")
    reference = np.ptp(np.asarray(kernel, np.float64).T @ hidden[3])
    np.testing.assert_allclose(reference, 2.5 * diameter, rtol=1e-6)
    value = float(re.search(r"hidden\[3\] is ([0-9.e+-]+)", message).group(1))
    np.testing.assert_allclose(value, reference, rtol=1e-5)
    assert "||h|| * bound = 2.5 * " in message
    with pytest.raises(ValueError, match=r"leaf 'lm_head/kernel': hidden must have last "):
        rt.assert_hilbert_perturbation_at_most(tree, put(np.ones((2, 4))), 1.0, vocab_axis=1)


# --- assert_labels_equal -------------------------------------------------------------------


class TinyLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(10, 4, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs)])
        self.norm = nnx.RMSNorm(4, rngs=rngs)
        self.lm_head = nnx.Linear(4, 10, use_bias=False, rngs=rngs)


ROUTING = {"embed": "embedding", "layers": "hidden", "layers/0/bias": "vector",
           "norm": "vector", "lm_head": "head"}


def abstract_state():
    """The model's parameters as nnx.Param Variables of ShapeDtypeStructs (no compute)."""
    return nnx.state(nnx.eval_shape(lambda: TinyLM(nnx.Rngs(0))), nnx.Param)


def test_labels_equal_on_nnx_variable_trees():
    state = abstract_state()  # Variables, as nnx.Optimizer hands them to tx.init
    labels = rowgeom.label_params(state)
    rt.assert_labels_equal(labels, ROUTING)
    plain = nnx.to_pure_dict(state)  # a plain nested dict, as tx.update sees the params
    rt.assert_labels_equal(rowgeom.label_params(plain), labels)  # a labels tree as expected
    boxed = jax.tree.map(lambda v, label: v.replace(label), state, labels,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    rt.assert_labels_equal(boxed, ROUTING)  # labels still inside nnx.Variable boxes


def test_labels_equal_readable_diff():
    labels = rowgeom.label_params(abstract_state())
    wrong = {**ROUTING, "lm_head/kernel": "embedding", "decoder": "hidden"}
    del wrong["norm"]
    with pytest.raises(AssertionError) as err:
        rt.assert_labels_equal(labels, wrong)
    assert str(err.value) == (
        "labels differ from the expected routing (1 of 5 leaves):\n"
        "  lm_head/kernel: got 'head', expected 'embedding'\n"
        "1 leaves not covered by the expected routing:\n"
        "  norm/scale: got 'vector', no expected label covers it\n"
        "1 expected paths match no leaf:\n"
        "  decoder: expected 'hidden', but no leaf has this path")


# --- assert_optimizer_does_not_retrace -----------------------------------------------------


def _moment_in_float32():
    """A momentum whose bfloat16 state comes back float32: the second step retraces."""
    def init(params):
        return {"mu": jax.tree.map(lambda p: jnp.zeros_like(p, jnp.bfloat16), params)}

    def update(updates, state, params=None):
        mu = jax.tree.map(lambda m, g: 0.9 * m.astype(jnp.float32) + g, state["mu"], updates)
        return mu, {"mu": mu}

    return optax.GradientTransformation(init, update)


def test_no_retrace_passes_for_rowgeom_and_trips_on_a_dtype_drift():
    params = {"lm_head": {"kernel": put(np.ones((4, 10)))}}
    grads = {"lm_head": {"kernel": put(np.random.default_rng(4).standard_normal((4, 10)))}}
    rt.assert_optimizer_does_not_retrace(
        optax.chain(rowgeom.projected_rownorm(vocab_axis=1), optax.sgd(0.1)), params, grads)
    with pytest.raises(AssertionError) as err:
        rt.assert_optimizer_does_not_retrace(_moment_in_float32(), params, grads)
    assert str(err.value) == (
        "optimizer step 1 retraced (chex.assert_max_traces(n=1) tripped): these inputs changed "
        "their abstract value since step 0:\n"
        "  opt_state/mu/lm_head/kernel: bfloat16[4, 10] -> float32[4, 10]")
    shapes = lambda step: {"lm_head": {"kernel": put(np.ones((4, 10 + step)))}}  # noqa: E731
    with pytest.raises(AssertionError, match=r"grads/lm_head/kernel: float32\[4, 10\] -> "
                                             r"float32\[4, 11\]"):
        rt.assert_optimizer_does_not_retrace(optax.sgd(0.1), params, shapes)


# --- the module itself ---------------------------------------------------------------------


def test_assertions_import_without_hypothesis():
    # A meta-path hook that refuses hypothesis: rowgeom.testing must still import and work;
    # rowgeom.testing.strategies must say how to install it.
    code = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "hypothesis" or name.startswith("hypothesis."):
            raise ImportError("No module named 'hypothesis'")
sys.meta_path.insert(0, Refuse())
import jax.numpy as jnp
import rowgeom.testing
rowgeom.testing.assert_rows_zero_sum(jnp.array([[1.0], [-1.0]]), vocab_axis=0)
assert "hypothesis" not in sys.modules
try:
    import rowgeom.testing.strategies
except ImportError as err:
    print(err)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pip install 'rowgeom[testing]'" in proc.stdout
