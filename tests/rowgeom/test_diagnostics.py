"""track_row_diameter / read_row_diameter: correct O(Vd) stats, stable state, found anywhere."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _geometry_shared import shared_lm_optimizer, small_lm_tree, small_lm_values, tracker_hlo
from flax import nnx

import rowgeom
from benchmarks.hlo_passes import computations, head_traffic
from rowgeom import RowDiameterStats, read_row_diameter, track_row_diameter


def np_diameter(s, axis=0):
    x = np.moveaxis(np.asarray(s, np.float64), axis, 0).reshape(np.shape(s)[axis], -1)
    return float(np.sqrt(np.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)).max())


def avals(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves]


def test_stats_bracket_exact_diameter_and_residual(rng):
    s = rng.normal(size=(9, 31)) + 0.7  # (d, V) Dense layout, not zero-sum
    tx = track_row_diameter(vocab_axis=1)
    updates = jax.device_put(s.astype(np.float32))  # placed, not converted: no compile
    update = jax.jit(tx.update)  # one compile for both updates (eagerly: one per operation)
    out, stats = update(updates, tx.init(updates))
    chex.assert_trees_all_equal(out, updates)
    assert isinstance(stats, RowDiameterStats)
    exact = np_diameter(s, 1)
    assert float(stats.lower) <= exact * (1 + 1e-5)
    assert exact <= float(stats.upper) * (1 + 1e-5)
    x = s.T - s.T.mean(axis=0)
    np.testing.assert_allclose(stats.upper, 2 * np.linalg.norm(x, axis=1).max(), rtol=1e-5)
    np.testing.assert_allclose(stats.row_sum_residual, np.linalg.norm(s.sum(axis=1)), rtol=1e-5)
    # A centred (gauge-fixed) step has no row-sum residual.
    centred = np.asarray(updates) - np.asarray(updates).mean(axis=1, keepdims=True)  # float32
    _, stats = update(centred, tx.init(updates))
    assert float(stats.row_sum_residual) < 1e-4


def test_state_structure_is_stable_and_eval_shape_works(rng):
    params = {"head": jax.device_put(np.zeros((16, 4), np.float32)),
              "norm": jax.device_put(np.ones(4, np.float32)), "skip": None}
    tx = track_row_diameter(vocab_axis={"head": 0, "norm": None, "skip": None})
    init_state = tx.init(params)
    assert avals(jax.eval_shape(tx.init, params)) == avals(init_state)
    chex.assert_trees_all_equal(init_state.lower["head"], np.zeros((), np.float32))
    assert init_state.upper["norm"] is None
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    updates, new_state = jax.jit(tx.update)(grads, init_state)
    assert avals(new_state) == avals(init_state)  # a jitted train step compiles once
    chex.assert_trees_all_equal(updates, grads)
    assert float(new_state.upper["head"]) > 0


def test_read_row_diameter_in_nested_states(rng):
    params = {"head": np.zeros((4, 24), np.float32), "w": np.zeros((4, 4), np.float32),
              "b": np.zeros(4, np.float32)}  # host arrays: no compile per shape
    labels = {"head": "head", "w": "hidden", "b": "hidden"}
    head_tx = optax.inject_hyperparams(lambda learning_rate: optax.chain(
            optax.sgd(learning_rate), track_row_diameter(vocab_axis=1)))(learning_rate=0.1)
    inner = optax.partition({"head": head_tx, "hidden": optax.adam(1e-3)}, labels)
    tx = optax.MultiSteps(optax.chain(optax.clip(1e3), inner), every_k_schedule=1)
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    # init and the first update in one jitted program (eagerly, init compiles an op per leaf)
    updates, state = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
    stats = read_row_diameter(state)
    assert set(stats.lower) == {"head"}  # plain arrays by path; the other partition is absent
    step = np.asarray(updates["head"])
    exact = np_diameter(step, 1)
    assert float(stats.lower["head"]) <= exact * (1 + 1e-5) <= float(stats.upper["head"]) * (
            1 + 1e-5) ** 2
    np.testing.assert_allclose(stats.row_sum_residual["head"],
                               np.linalg.norm(step.sum(axis=1)), rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_equal(read_row_diameter(state, which="head"), stats)


def test_read_row_diameter_errors_and_which(rng):
    params = jax.device_put(rng.normal(size=(10, 3)).astype(np.float32))
    tx = optax.chain(track_row_diameter(vocab_axis=0), optax.scale(2.0),
                     track_row_diameter(vocab_axis=0))
    _, state = jax.jit(tx.update)(params, tx.init(params))  # one compile, not one per operation
    with pytest.raises(ValueError, match="holds 2 RowDiameterStats"):
        read_row_diameter(state)
    first, second = read_row_diameter(state, which=0), read_row_diameter(state, which=-1)
    np.testing.assert_allclose(second.upper, 2 * float(first.upper), rtol=1e-6)
    with pytest.raises(ValueError, match="which=2 is out of range"):
        read_row_diameter(state, which=2)
    with pytest.raises(ValueError, match="matches 0 of the RowDiameterStats"):
        read_row_diameter(state, which="head")
    with pytest.raises(ValueError, match="holds no RowDiameterStats"):
        read_row_diameter(jax.eval_shape(optax.adam(1e-3).init, params))  # traced: no compile
    with pytest.raises(ValueError, match=r"leaf \['b'\]: params must have rank >= 2"):
        track_row_diameter(vocab_axis=0).init({"b": np.ones(3, np.float32)})


class _Lm(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(12, 4, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(4, 4, use_bias=False, rngs=rngs)])
        self.lm_head = nnx.Linear(4, 12, use_bias=False, rngs=rngs)


@functools.cache
def _lm_values():
    """`_Lm`'s parameters (a pure dict), drawn on the host: no initializer runs, so nothing
    compiles (nnx.jit of the initializers is a program of its own)."""
    abstract = nnx.state(nnx.eval_shape(lambda: _Lm(nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: (rng.standard_normal(x.shape) / 2).astype(np.float32),
                        nnx.to_pure_dict(abstract))


def _lm_model():
    """An `_Lm` holding `_lm_values()` (placed on the device: no compile)."""
    model = nnx.eval_shape(lambda: _Lm(nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.device_put(_lm_values()))
    nnx.update(model, state)
    return model


WRAPPED = {"plain": lambda: rowgeom.lm_optimizer(1e-2),
           "multi_steps": lambda: optax.MultiSteps(rowgeom.lm_optimizer(1e-2), 1),
           "inject": lambda: optax.inject_hyperparams(rowgeom.lm_optimizer)(learning_rate=1e-2),
           "apply_if_finite": lambda: optax.apply_if_finite(rowgeom.lm_optimizer(1e-2), 3)}


def _grads_state(params):
    """Fixed gradients for `_Lm`'s parameters, an nnx.State of Variables as nnx.grad returns,
    drawn on the host (placed: no compile)."""
    return jax.tree.map(lambda p: jax.device_put(
        (1 + np.arange(p.size).reshape(p.shape) % 3).astype(np.float32)), params)


@functools.cache
def _wrapped_first_updates():
    """``{wrapper: (updates, state)}``: the first update of each optax wrapper of WRAPPED from
    its init, on `_lm_values()`: one jitted program for the four (a program each would be four
    compiles; eagerly, every operation of the recipe compiles on its own)."""
    params = jax.device_put(_lm_values())
    grads = nnx.to_pure_dict(_grads_state(nnx.state(_lm_model(), nnx.Param)))
    txs = {wrapper: make() for wrapper, make in WRAPPED.items()}
    return jax.jit(lambda g, p: {wrapper: tx.update(g, tx.init(p), p)
                                 for wrapper, tx in txs.items()})(grads, params)


@pytest.mark.parametrize("wrapper", [*WRAPPED, "nnx"])
def test_read_row_diameter_gives_plain_arrays_by_head_path_through_wrappers(wrapper):
    """The same {"lm_head/kernel": array} through every wrapper, nnx.Optimizer included."""
    if wrapper == "nnx":
        model = _lm_model()
        optimizer = nnx.Optimizer(model, rowgeom.lm_optimizer(1e-2), wrt=nnx.Param)
        before = np.array(model.lm_head.kernel[...])
        grads_state = _grads_state(nnx.state(model, nnx.Param))
        nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads_state)
        state = optimizer.opt_state
        step = np.asarray(model.lm_head.kernel[...]) - before
    else:
        updates, state = _wrapped_first_updates()[wrapper]
        step = np.asarray(updates["lm_head"]["kernel"])
    stats = read_row_diameter(state)
    for field in stats:
        assert list(field) == ["lm_head/kernel"]
        value = field["lm_head/kernel"]
        assert isinstance(value, jax.Array) and value.shape == ()
    exact = np_diameter(step, 1)
    assert float(stats.lower["lm_head/kernel"]) <= exact * (1 + 1e-5)
    assert exact <= float(stats.upper["lm_head/kernel"]) * (1 + 1e-5)


def test_partial_vocab_axis_tree_leaves_unnamed_leaves_untouched(rng):
    params = {"lm_head": {"kernel": np.zeros((4, 10), np.float32)},
              "layers": {"w": np.zeros((4, 4), np.float32)}, "norm": np.ones(4, np.float32)}
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    partials = ({"lm_head": 1}, {"lm_head": {"kernel": 1}})
    trackers = [track_row_diameter(vocab_axis=partial) for partial in partials]
    rownorms = [rowgeom.projected_rownorm(vocab_axis=partial) for partial in partials]
    results = jax.jit(lambda g: [  # one compile for both spellings and both transforms
        (tx.update(g, tx.init(params))[1], rn.update(g, rn.init(params))[0])
        for tx, rn in zip(trackers, rownorms, strict=True)])(grads)
    for partial, (state, out) in zip(partials, results, strict=True):
        assert state.lower["layers"]["w"] is None and state.lower["norm"] is None, partial
        assert float(state.upper["lm_head"]["kernel"]) > 0, partial
        chex.assert_trees_all_equal(out["layers"], grads["layers"])  # unnamed: untouched
        assert np.abs(np.asarray(out["lm_head"]["kernel"]).sum(axis=1)).max() < 1e-5, partial
    with pytest.raises(ValueError, match=r"names \['lm_haed'\]"):  # a typo is never silent
        track_row_diameter(vocab_axis={"lm_haed": 1}).init(params)


# --------------------------------------------------------------------------- every_k_steps


def _tracked_tree(rng, n):
    """n update trees with a (d, V) head, an untracked matrix and a masked leaf."""
    return [{"lm_head": {"kernel": (rng.normal(size=(6, 40)) * (i + 1)).astype(np.float32)},
             "w": rng.normal(size=(4, 4)).astype(np.float32),  # host arrays: no compile
             "skip": optax.MaskedNode()} for i in range(n)]


AXES = {"lm_head": 1, "w": None, "skip": None}


@functools.cache
def _tracker_step(k):
    """The tracker of `_tracked_tree`'s head measuring every k-th update, and its jitted update
    with the state donated (it can be: a fixed layout), shared by the tests below: one compile
    per k whether a test runs it or reads its compiled HLO."""
    tx = track_row_diameter(vocab_axis=AXES, every_k_steps=k)
    return tx, jax.jit(tx.update, donate_argnums=1)


def test_every_k_steps_measures_steps_1_k_2k_and_keeps_stats_between(rng):
    k, n = 3, 7  # 2k + 1 updates: measured 1, 3, 6; kept on 2, 4, 5, 7
    updates = _tracked_tree(rng, n)
    every, step = _tracker_step(k)
    each, step_each = _tracker_step(1)  # k = 1 (the default) too
    state, state_each = every.init(updates[0]), each.init(updates[0])
    assert avals(jax.eval_shape(every.init, updates[0])) == avals(state)
    assert avals(state) == avals(state_each)  # every_k_steps changes no state layout
    assert int(state.measured_at["lm_head"]["kernel"]) == 0
    measured = []
    for i, u in enumerate(updates, start=1):
        before = jax.tree.map(np.asarray, state)
        out, state = step(u, state)
        _, state_each = step_each(u, state_each)
        chex.assert_trees_all_equal(out, u)
        assert state.lower["w"] is None and isinstance(state.upper["skip"], optax.MaskedNode)
        assert int(state.count["lm_head"]["kernel"]) == i
        at = int(state.measured_at["lm_head"]["kernel"])
        if i == 1 or i % k == 0:
            measured.append(i)
            assert at == i
            for field in ("lower", "upper", "row_sum_residual"):  # the k=1 tracker's values
                np.testing.assert_array_equal(getattr(state, field)["lm_head"]["kernel"],
                                              getattr(state_each, field)["lm_head"]["kernel"])
            exact = np_diameter(u["lm_head"]["kernel"], 1)
            assert float(state.lower["lm_head"]["kernel"]) <= exact * (1 + 1e-5)
        else:  # off-step: the measured fields are kept bit for bit
            assert at == int(before.measured_at["lm_head"]["kernel"]) < i
            for field in ("lower", "upper", "row_sum_residual"):
                np.testing.assert_array_equal(getattr(state, field)["lm_head"]["kernel"],
                                              getattr(before, field)["lm_head"]["kernel"])
    assert measured == [1, 3, 6]
    assert step._cache_size() == 1  # one compile for measured and kept steps alike
    stats = read_row_diameter(state)
    assert stats.measured_at == {"lm_head/kernel": 6} and stats.count == {"lm_head/kernel": 7}


_HLO_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_HLO_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_HLO_BRANCHES = re.compile(
    r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+)")


def _reduces_outside_conditionals(hlo: str) -> tuple[int, int]:
    """(reduce ops run unconditionally, reduce ops inside conditional branches) of compiled HLO."""
    bodies, entry = computations(hlo)

    def reachable(roots, through_branches):
        seen, todo = set(), list(roots)
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            for line in bodies[c]:
                todo += _HLO_CALLS.findall(line)
                for group, single in _HLO_BRANCHES.findall(line):
                    if through_branches:
                        todo += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
                        todo += [single] if single else []
        return seen

    def reduces(comps):
        return sum(1 for c in comps for line in bodies[c]
                   if (m := _HLO_OPCODE.match(line)) and m.group(1).startswith("reduce"))

    always = reachable([entry], through_branches=False)
    anywhere = reachable([entry], through_branches=True)
    return reduces(always), reduces(anywhere - always)


def test_off_steps_run_no_reduction_in_the_compiled_step(rng):
    """The O(Vd) passes live only in the measuring branch of an XLA conditional (on CPU and GPU
    only the taken branch runs); with k = 1 they run unconditionally (the check can fail)."""
    u = _tracked_tree(rng, 1)[0]  # a (d, V) head beside an untracked and a masked leaf
    counts = {}
    for k in (1, 3):  # the every_k test's programs (one compile each for both tests)
        tx, step = _tracker_step(k)
        counts[k] = _reduces_outside_conditionals(step.lower(u, tx.init(u)).compile().as_text())
    assert counts[1][0] > 0  # k = 1: the reductions are in the step itself
    assert counts[3][0] == 0 and counts[3][1] > 0, counts  # k > 1: only in a branch


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_tracker_after_an_in_place_step_copies_nothing(vocab_axis):
    """Chained after a head step written in place over its donated input, the tracker reads that
    buffer as it is: the compiled step holds no copy of the head (a sliced or unit-axis view of
    it made XLA copy the donated input every measured step)."""
    shape = (4096, 256) if vocab_axis == 0 else (256, 4096)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=vocab_axis), optax.scale(-1e-3),
                     track_row_diameter(vocab_axis=vocab_axis))
    step = jax.jit(tx.update, donate_argnums=(0, 1))
    hlo = step.lower(spec, jax.eval_shape(tx.init, spec)).compile().as_text()
    head = f"f32[{shape[0]},{shape[1]}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and head in line]
    assert not copies, copies


@pytest.mark.parametrize("formulation", ("cpu", "xla"))
def test_tracker_reads_the_update_four_times(formulation):
    """A measured step reads the update as often as the bracket needs and no more: the row sum
    (which is also the centroid's), the centred norms and the two sweeps."""
    for shape, axis in (((1024, 96), 0), ((96, 1024), 1)):
        # The measured step's stats (the updates pass through), compiled once per process for
        # this module and test_tracker_passes.py.
        traffic = head_traffic(tracker_hlo(shape, axis, formulation), 1024 * 96)
        assert (round(traffic.reads), round(traffic.writes)) == (4, 0), traffic.ops


def test_every_k_steps_counts_only_applied_inner_updates(rng):
    """Under MultiSteps the tracker counts optimizer steps; a step skipped by apply_if_finite
    is not counted (the whole inner state is kept)."""
    g = rng.normal(size=(5, 3)).astype(np.float32)  # host arrays: no conversion compile
    tx = optax.MultiSteps(track_row_diameter(vocab_axis=0, every_k_steps=2), every_k_schedule=2)
    step = jax.jit(tx.update)
    state = tx.init(g)
    for _ in range(5):  # micro-steps 1..5: two optimizer steps (2, 4)
        _, state = step(g, state)
    stats = read_row_diameter(state)
    assert (int(stats.measured_at), int(stats.count)) == (2, 2)
    tx = optax.apply_if_finite(track_row_diameter(vocab_axis=0, every_k_steps=2), 3)
    state, step = tx.init(g), jax.jit(tx.update)  # one compile, not one per operation
    nan = g.copy()
    nan[0, 0] = np.nan
    for x in (g, nan, g):
        _, state = step(x, state)
    stats = read_row_diameter(state)
    assert (int(stats.measured_at), int(stats.count)) == (2, 2)
    assert np.isfinite(float(stats.upper))


def test_a_nan_shows_in_the_stats_only_when_its_update_is_measured(rng):
    """docs/reliability.md: with every_k_steps = k > 1 the stats describe updates 1, k, 2k, ...
    only; a NaN in an update between them passes through (the update stays NaN) but never
    reaches the stats, while a NaN in a measured update does. lm_optimizer's head likewise."""
    k = 4
    g = rng.normal(size=(5, 7)).astype(np.float32)  # host arrays: no compile per operation
    nan = g.copy()
    nan[1, 2] = np.nan
    tx = track_row_diameter(vocab_axis=0, every_k_steps=k)
    step = jax.jit(tx.update)
    for nan_at, shows in ((2, False), (3, False), (k, True)):
        state = tx.init(g)
        for i in range(1, 2 * k):
            out, state = step(nan if i == nan_at else g, state)
            assert np.isnan(out).any() == (i == nan_at)  # passed through, never replaced
            stats = read_row_diameter(state)
            finite = all(np.isfinite(float(f)) for f in stats[:3])
            assert finite == (not shows or i < nan_at), (nan_at, i)
    # The small LM tree and the default recipe (test_recipe.py's: in one process its jitted
    # update compiles once for both), which measures updates 1, 10, 20, ... by default.
    values = small_lm_values(0)
    params = small_lm_tree({path: np.ones_like(x) for path, x in values.items()})
    grads = small_lm_tree(values)
    head = values["lm_head/kernel"].copy()
    head[0] = np.nan
    bad = small_lm_tree({**values, "lm_head/kernel": head})
    opt = shared_lm_optimizer(1e-2)
    update, state = jax.jit(opt.update), opt.init(params)
    for x in (grads, bad, grads):
        out, state = update(x, state, params)
    assert np.isnan(out["lm_head"]["kernel"]).any()  # the momentum carries the NaN on
    stats = read_row_diameter(state)
    assert stats.measured_at == {"lm_head/kernel": 1} and np.isfinite(
        float(stats.upper["lm_head/kernel"]))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (2.5, TypeError),
                                        (True, TypeError), ("3", TypeError)])
def test_every_k_steps_validation(bad, error):
    with pytest.raises(error, match=r"every_k_steps must be (an int|>= 1)"):
        track_row_diameter(vocab_axis=0, every_k_steps=bad)
    with pytest.raises((TypeError, ValueError), match="track_every_k_steps must be"):
        rowgeom.lm_optimizer(1e-3, head=rowgeom.HeadOptions(track_every_k_steps=bad))


def test_every_k_steps_under_inject_hyperparams():
    g = np.ones((4, 3), np.float32) + np.arange(3.0, dtype=np.float32)[None, :]
    track_row_diameter(vocab_axis=0, every_k_steps=np.int64(2))  # any integer type
    injected = optax.inject_hyperparams(track_row_diameter, static_args=("vocab_axis",))(
        vocab_axis=0, every_k_steps=2)
    with pytest.raises(TypeError, match=r"every_k_steps must be a Python int, got a traced "
                                        r"array; .*static_args=\('vocab_axis', 'every_k_steps'"):
        jax.jit(injected.update)(g, injected.init(g))
    static = optax.inject_hyperparams(track_row_diameter,
                                      static_args=("vocab_axis", "every_k_steps"))(
        vocab_axis=0, every_k_steps=2)
    _, state = jax.jit(static.update)(g, static.init(g))
    assert int(read_row_diameter(state).measured_at) == 1
