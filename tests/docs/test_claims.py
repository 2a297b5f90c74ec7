"""Claims the documentation pages make about the code, as tests of the code.

Each page names the test that checks its claim ("checked by `tests/docs/test_claims.py::test_x`").
Public API only; each property is compared with an independent float64 numpy computation or
shown to fail on a counter-example, so a wrong sentence (or a wrong library) fails here.
"""

from __future__ import annotations

import functools
import pathlib
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
import rowgeom.testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
MDN = rowgeom.MuonDimensionNumbers


@functools.cache
def _rownorm_program(option_sets: tuple):
    txs = [rowgeom.projected_rownorm(**dict(options)) for options in option_sets]
    return jax.jit(lambda g: [tx.update(g, tx.init(g))[0] for tx in txs])


def _rownorms(g, *option_sets: dict) -> list[np.ndarray]:
    """The projected RowNorm directions (radius 1) of `g` under each of `option_sets`, through
    the public transform: one jitted program for them all (eagerly, each op compiles its own)."""
    key = tuple(tuple(sorted(options.items())) for options in option_sets)
    return [np.asarray(u, np.float64) for u in _rownorm_program(key)(g)]


def _np_diameter(rows: np.ndarray) -> float:
    rows = np.asarray(rows, np.float64)
    return float(np.max(np.linalg.norm(rows[:, None] - rows[None], axis=-1), initial=0.0))


# ----------------------------------------------------------------------------- precision


def test_muon_iterates_in_the_input_dtype_unless_compute_dtype_is_set(rng):
    """index.md: Muon's Newton–Schulz iteration runs in the input dtype unless `compute_dtype`
    is set (RowNorm's float32 internals are the transform battery's)."""
    x = rng.standard_normal((16, 24)).astype(jnp.bfloat16)
    txs = [rowgeom.muon_orthogonalize(**options) for options in (
        {}, dict(compute_dtype=jnp.bfloat16), dict(compute_dtype=jnp.float32))]
    # One program for the four steps; the float32 reference takes the float32 input.
    outputs = jax.jit(lambda x: [tx.update(x, tx.init(x))[0] for tx in txs] + [
        txs[0].update(x.astype(jnp.float32), optax.EmptyState())[0]])(x)
    default, in_bf16, in_f32, reference = (np.asarray(u, np.float64) for u in outputs)
    np.testing.assert_array_equal(default, in_bf16)  # the input dtype, bit for bit
    assert not np.array_equal(default, in_f32)
    assert np.abs(in_f32 - reference).max() < np.abs(default - reference).max()


# ----------------------------------------------------------------------------- inject_hyperparams


# The static_args each transform needs under optax.inject_hyperparams: its non-float options.
# docs/guides/learning-rates.md and README.md list them; this test is what holds them true.
STATIC_ARGS = {
    "projected_rownorm": ("vocab_axis", "eps", "num_valid"),
    "clip_row_diameter": ("vocab_axis", "block_size"),
    "track_row_diameter": ("vocab_axis", "every_k_steps"),
    "muon_orthogonalize": ("ns_steps", "ns_coeffs", "dimension_numbers"),
}


G = np.ones((4, 10), np.float32)  # built on the host: nothing compiles at collection
G[0], G[1, 2] = 3.0, -1.0
OPTIONS = {  # every documented static argument passed, the floats too
    "projected_rownorm": dict(vocab_axis=1, eps=1e-8, num_valid=8),
    "clip_row_diameter": dict(max_diameter=0.01, vocab_axis=1, exact=True, block_size=4),
    "track_row_diameter": dict(vocab_axis=1, every_k_steps=2),
    "muon_orthogonalize": dict(ns_steps=5, rms_scale=0.2, ns_coeffs=np.array(
        [3.4445, -4.7750, 2.0315]), dimension_numbers=lambda params: {
        k: MDN(reduction_axis=1, output_axis=0) for k in params}),
}


def test_inject_hyperparams_needs_the_documented_static_args():
    documented = STATIC_ARGS  # every public transform but lm_optimizer
    params = {"w": G}
    pairs = {name: (getattr(rowgeom, name)(**OPTIONS[name]), optax.inject_hyperparams(
        getattr(rowgeom, name), static_args=static)(**OPTIONS[name]))
        for name, static in documented.items()}
    # Each transform's plain and injected step, all in one jitted program (not one each).
    steps = jax.jit(lambda p: {name: [tx.update(p, tx.init(p), p)[0] for tx in pair]
                               for name, pair in pairs.items()})(params)
    for name, static in documented.items():
        make, options = getattr(rowgeom, name), OPTIONS[name]
        want, got = steps[name]
        jax.tree.map(functools.partial(np.testing.assert_array_equal, err_msg=name), got, want)
        for missing in static:
            short = tuple(a for a in static if a != missing)
            broken = optax.inject_hyperparams(make, static_args=short)(**options)
            try:
                out = jax.jit(broken.update)(params, broken.init(params), params)[0]
            except TypeError as err:
                # A callable dimension_numbers is called as a schedule, with the step count.
                assert missing in str(err) or missing == "dimension_numbers", (name, err)
                # The static_args an error suggests are the documented ones (no others).
                for suggested in re.findall(r"static_args=\(([^)]*)\)", str(err)):
                    assert set(re.findall(r"'(\w+)'", suggested)) <= set(static), (name, err)
                continue
            # Not an error: then the argument was evaluated as a schedule, and the step differs.
            assert missing == "dimension_numbers" and not all(
                np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(
                    want), strict=True)), (name, missing)


# ----------------------------------------------------------------------------- the RowNorm step


def _zero_mean_rows(rng, v, d):
    """(V, d) rows of mean 0: row 3 zero, row 7 of norm 1e-3 (below the test's eps)."""
    x = rng.standard_normal((v, d))
    x[3] = 0.0
    x[7] = 1e-3 * np.ones(d) / np.sqrt(d)
    x[0] -= x.sum(axis=0)
    return x


def test_every_row_moves_by_exactly_r_up_to_a_common_shift(rng):
    """s_i = -r (u_i - ū): every row is at distance r·||u_i|| from the common point c = r·ū,
    i.e. exactly r for rows with ||x_i|| >= eps, less below eps and 0 for a zero row."""
    v, d, r, eps = 24, 6, 0.37, 1e-2
    for offset in (0.0, 5.0):
        x = _zero_mean_rows(rng, v, d)
        g = (x + offset * rng.standard_normal(d)).astype(np.float32)
        s = -r * _rownorms(g, dict(vocab_axis=0, eps=eps))[0]
        xc = g.astype(np.float64) - g.astype(np.float64).mean(axis=0)  # centred, float64
        norms = np.linalg.norm(xc, axis=1)
        u = xc / np.maximum(norms, eps)[:, None]
        shift = s + r * u                                  # = r·ū for every row
        long = norms >= eps
        common = shift[long].mean(axis=0)
        np.testing.assert_allclose(shift[long], np.broadcast_to(common, shift[long].shape),
                                   atol=2e-6 * r)
        # Rows below eps: float32 centring's rounding is amplified by 1/eps there.
        np.testing.assert_allclose(shift[~long], np.broadcast_to(common, shift[~long].shape),
                                   atol=1e-4 * r)
        distance = np.linalg.norm(s - common, axis=1)
        np.testing.assert_allclose(distance[long], r, rtol=2e-6)
        assert np.all(distance <= r * (1 + 2e-6))
        assert _np_diameter(s) <= 2 * r * (1 + 2e-6)
        # Below eps: row 7 moves by r·||x_7||/eps = r/10, the zero row 3 (up to rounding) not.
        np.testing.assert_allclose(distance[7], 0.1 * r, rtol=1e-2)
        assert distance[3] < 1e-4 * r
    # The rows' own lengths are not r (the docs say so too).
    lengths = np.linalg.norm(s, axis=1)
    assert lengths[long].max() - lengths[long].min() > 0.05 * r


def test_outer_centring_changes_neither_decrease_nor_diameter_of_a_zero_sum_gradient(rng):
    g = rng.standard_normal((20, 5))
    for zero_sum in (True, False):
        grad = (g - g.mean(axis=0) if zero_sum else g + 1.0).astype(np.float32)
        centred, plain = _rownorms(grad, *(dict(vocab_axis=0, center_output=c)
                                           for c in (True, False)))
        decrease = [float(np.sum(grad * s)) for s in (centred, plain)]
        np.testing.assert_allclose(_np_diameter(centred), _np_diameter(plain), rtol=1e-5)
        np.testing.assert_allclose(centred.sum(axis=0), 0.0, atol=1e-5)  # the gauge
        if zero_sum:
            np.testing.assert_allclose(decrease[0], decrease[1], rtol=1e-5)
        else:  # the counter-example: 1ᵀG != 0 and the outer P changes the decrease
            assert abs(decrease[0] - decrease[1]) > 1e-2 * abs(decrease[1])


def test_rescaled_padded_step_diameter_over_valid_and_all_rows():
    """geometry.md: rescale="exact" with num_valid measures D over the valid rows; with the
    output centring the padding rows' zero step is the valid mean (D over all rows the same),
    without it the diameter over all rows can far exceed the budget."""
    g = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 0.0], [7.0, 7.0]], np.float32)  # 2, 3: padding
    txs = {centre: rowgeom.projected_rownorm(vocab_axis=0, num_valid=2, rescale="exact",
                                             center_input=centre, center_output=centre)
           for centre in (True, False)}
    stats = rowgeom.track_row_diameter(vocab_axis=0)

    @jax.jit  # both steps and the tracker in one program (eagerly: 49 compiles of single ops)
    def steps(g):
        s = {centre: tx.update(g, tx.init(g))[0] for centre, tx in txs.items()}
        _, state = stats.update(s[False], stats.init(g))
        return s, state.lower

    steps, tracked = steps(g)
    for centre in (True, False):
        s = np.asarray(steps[centre], np.float64)
        np.testing.assert_array_equal(s[2:], 0.0)
        np.testing.assert_allclose(_np_diameter(s[:2]), 2.0, rtol=1e-5)
        if centre:
            np.testing.assert_allclose(_np_diameter(s), 2.0, rtol=1e-5)
        else:
            assert _np_diameter(s) > 4.0
            assert float(tracked) > 4.0  # the tracker sees all rows


# ----------------------------------------------------------------------------- geometry facts


def test_rmsnorm_output_norm_is_at_most_sqrt_d_times_the_largest_gain(rng):
    d = 64

    @jax.jit  # one program for both gains (eagerly, each op compiles its own)
    def rmsnorm(scale, x):
        norm = nnx.RMSNorm(d, rngs=nnx.Rngs(0))
        norm.scale[...] = scale
        return norm(x)

    scale = rng.uniform(-2.0, 1.5, d).astype(np.float32)
    x = (rng.standard_normal((200, d)) * rng.uniform(1e-3, 1e3, (200, 1))).astype(np.float32)
    bound = np.sqrt(d) * np.abs(scale).max()
    h = np.linalg.norm(np.asarray(rmsnorm(scale, x), np.float64), axis=-1)
    assert np.all(h <= bound * (1 + 1e-5))
    h = np.linalg.norm(np.asarray(rmsnorm(np.full(d, 1.5, np.float32), x), np.float64),
                       axis=-1)  # a constant gain attains it
    np.testing.assert_allclose(h, np.sqrt(d) * 1.5, rtol=1e-4)


def test_row_diameter_is_bounded_by_the_usual_norms(rng):
    """D(S) <= 2 max_i ||s_i - c|| (any c), <= sqrt(2) ||S||_2, <= 2 sqrt(d) max|S_ij|."""
    for v, d in [(2, 3), (9, 4), (30, 7)]:
        s = rng.standard_normal((v, d)) * rng.uniform(0.1, 3.0, (v, 1))
        exact = float(rowgeom.row_diameter(s.astype(np.float32), vocab_axis=0))
        np.testing.assert_allclose(exact, _np_diameter(s), rtol=1e-5)
        for c in [s.mean(axis=0), rng.standard_normal(d) * 5, s[0]]:
            assert exact <= 2 * np.linalg.norm(s - c, axis=1).max() * (1 + 1e-5)
        assert exact <= np.sqrt(2) * np.linalg.norm(s, 2) * (1 + 1e-5)
        assert exact <= 2 * np.sqrt(d) * np.abs(s).max() * (1 + 1e-5)
    a = rng.standard_normal(5)
    pair = np.stack([a, -a])  # antipodal rows attain the first two
    np.testing.assert_allclose(_np_diameter(pair), np.sqrt(2) * np.linalg.norm(pair, 2))
    np.testing.assert_allclose(_np_diameter(pair), 2 * np.linalg.norm(pair, axis=1).max())


def test_cross_entropy_head_gradient_is_zero_sum(rng):
    """An untied head's cross-entropy gradient has zero-sum token rows (1ᵀG = 0), with or
    without label smoothing; a z-loss breaks it (the counter-example)."""
    v, d, n = 50, 8, 32
    w = rng.standard_normal((v, d)).astype(np.float32)
    h = rng.standard_normal((n, d)).astype(np.float32)
    y = rng.integers(0, v, n).astype(np.int32)

    def losses(w):
        logits = h @ w.T
        plain = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        smooth = optax.softmax_cross_entropy(
            logits, optax.smooth_labels(jax.nn.one_hot(y, v), 0.1)).mean()
        z_loss = plain + 1e-2 * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return plain, smooth, z_loss

    # The three gradients in one program (not one each).
    grads = jax.jit(lambda w: [jax.grad(lambda w, i=i: losses(w)[i])(w) for i in range(3)])(w)
    for grad, name in zip(grads, ("plain", "smooth", "z_loss"), strict=True):
        grad = np.asarray(grad, np.float64)
        residual = np.linalg.norm(grad.sum(axis=0)) / np.abs(grad).sum()
        if name == "z_loss":
            assert residual > 1e-3, residual
        else:
            assert residual < 1e-6, (name, residual)


def test_ratio_is_one_for_one_feature_two_tokens_and_rank_one(rng):
    """geometry.md: the common ball loses nothing for d = 1, V = 2 or a rank-1 gradient."""
    pytest.importorskip("clarabel")
    rho = 2.0
    u = rng.standard_normal((6, 1))
    cases = {"d = 1": rng.standard_normal((7, 1)), "V = 2": rng.standard_normal((2, 4)),
             "rank 1": u @ rng.standard_normal((1, 3))}
    for name, g in cases.items():
        g = g - g.mean(axis=0)  # the canonical, zero-sum case
        _, value = rowgeom.testing.diameter_oracle(g, rho)
        rownorm = rho / 2 * np.linalg.norm(g, axis=1).sum()  # Theorem 2's value at r = rho/2
        np.testing.assert_allclose(rownorm / value, 1.0, rtol=1e-5, err_msg=name)
    g = rng.standard_normal((6, 3))  # and a generic gradient loses something
    g -= g.mean(axis=0)
    assert (rho / 2 * np.linalg.norm(g, axis=1).sum()
            < 0.99 * rowgeom.testing.diameter_oracle(g, rho)[1])


# ----------------------------------------------------------------------------- checkpoints


def _head_leaves(tx, params):
    inner = jax.eval_shape(tx.init, params).inner_states["head"].inner_state
    return sorted((jax.tree_util.keystr(p).split(".")[-1].split("[")[0], tuple(x.shape),
                   str(x.dtype)) for p, x in jax.tree_util.tree_leaves_with_path(inner))


def test_head_state_holds_what_the_checkpointing_guide_lists():
    d, v = 16, 100
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731  (shapes only)
    params = {"embed": {"embedding": f32(v, d)}, "layers": {"0": {"mlp": {"up": {"kernel": f32(
        d, 64)}}}}, "norm": {"scale": f32(d)}, "lm_head": {"kernel": f32(d, v)}}
    tracker = [("count", (), "int32"), ("lower", (), "float32"), ("measured_at", (), "int32"),
               ("row_sum_residual", (), "float32"), ("upper", (), "float32")]
    rownorm = _head_leaves(rowgeom.lm_optimizer(1e-3), params)
    assert rownorm == sorted([("count", (), "int32"), ("ema", (d, v), "float32"), *tracker])
    schedule = _head_leaves(rowgeom.lm_optimizer(optax.constant_schedule(1e-3)), params)
    assert sorted(schedule) == sorted([*rownorm, ("count", (), "int32")])
    adamw = _head_leaves(rowgeom.lm_optimizer(1e-3, head="adamw"), params)
    assert adamw == sorted([("count", (), "int32"), ("mu", (d, v), "float32"),
                            ("nu", (d, v), "float32"), *tracker])
    # Half the memory: one (d, V) moment against two.
    size = lambda leaves: sum(int(np.prod(s)) for _, s, _ in leaves if s)  # noqa: E731
    assert 2 * size(rownorm) == size(adamw) == 2 * d * v
    # The structure follows the options and the kind of rate, not the float values.
    structure = lambda tx: jax.tree.structure(jax.eval_shape(tx.init, params))  # noqa: E731
    base = structure(rowgeom.lm_optimizer(1e-3))
    assert base == structure(rowgeom.lm_optimizer(
        2e-3, groups={"head": rowgeom.GroupOptions(learning_rate=1e-2)}, weight_decay=0.0,
        head=rowgeom.HeadOptions(momentum=0.5), muon=rowgeom.MuonOptions(momentum=0.8)))
    for other in (rowgeom.lm_optimizer(optax.constant_schedule(1e-3)),
                  rowgeom.lm_optimizer(1e-3, head="adamw"),
                  rowgeom.lm_optimizer(1e-3, head=rowgeom.HeadOptions(track=False))):
        assert structure(other) != base


_KILLED_SAVE = """
import os, pathlib, sys, time
import jax.numpy as jnp
from examples.lm import checkpointing
ckpt = checkpointing.Checkpointer(sys.argv[1])
ckpt.save(int(sys.argv[2]), {"a": jnp.ones((2048, 2048))}, {"step": int(sys.argv[2])})
# Killed while the save is in flight (it is never finalized): once its temporary directory
# exists, which orbax creates on a thread of its own (exiting at once raced it under load).
deadline = time.monotonic() + 60
while not any(p.name.startswith(sys.argv[2] + ".") for p in pathlib.Path(sys.argv[1]).iterdir()):
    if time.monotonic() > deadline:
        sys.exit("the save's temporary directory never appeared")
    time.sleep(0.001)
os._exit(0)
"""


def test_a_killed_saves_temporary_directory_goes_when_its_step_is_saved_again(tmp_path):
    """reliability.md: a killed save leaves a temporary directory that restores ignore; orbax
    replaces it when the same step is saved again, and one of a step never saved again stays."""
    from examples.lm import checkpointing

    ckdir = tmp_path / "ck"
    ckpt = checkpointing.Checkpointer(ckdir)
    ckpt.save(1, {"a": jnp.asarray(np.zeros(4, np.float32))}, {"step": 1})  # nothing compiled
    ckpt.close()
    for step in (2, 3):
        subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(ckdir), str(step)], cwd=ROOT,
                       check=True, timeout=120)
    temporary = lambda: sorted(p.name for p in ckdir.iterdir() if "tmp" in p.name)  # noqa: E731
    assert [name.split(".")[0] for name in temporary()] == ["2", "3"], temporary()
    ckpt = checkpointing.Checkpointer(ckdir)
    assert ckpt.latest_step() == 1  # the half-written ones are never listed
    ckpt.save(2, {"a": jnp.asarray(np.ones(4, np.float32))}, {"step": 2})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    assert [name.split(".")[0] for name in temporary()] == ["3"], temporary()
    ckpt.close()


# ----------------------------------------------------------------------------- the recipe in a loop


def _small_lm(rng):
    """An embedding and a head (no hidden matrix: Muon's compile would dominate the test)."""
    params = {"embed": {"embedding": rng.standard_normal((40, 8)).astype(np.float32)},
              "lm_head": {"kernel": rng.standard_normal((8, 40)).astype(np.float32)}}
    grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
    return params, grads


def test_lm_optimizer_update_needs_params_and_clipping_goes_first(rng):
    """getting-started.md: update without params raises; clipping the raw gradients leaves the
    RowNorm head step at its radius (the direction is scale-free), clipping the finished
    updates to the same norm shrinks it."""
    params, grads = _small_lm(rng)
    tx = rowgeom.lm_optimizer(1e-2, weight_decay=0.0)
    with pytest.raises(ValueError, match="requires the current value of parameters"):
        jax.eval_shape(lambda g, p: tx.update(g, tx.init(p)), grads, params)  # traced only

    def head_diameter(tx, grads, params):
        updates, _ = tx.update(grads, tx.init(params), params)
        return rowgeom.row_diameter(updates["lm_head"]["kernel"], vocab_axis=1)

    chains = (tx, optax.chain(optax.clip_by_global_norm(1e-3), tx),
              optax.chain(tx, optax.clip_by_global_norm(1e-3)))
    # One compiled program for the three (run eagerly, each op would compile on its own).
    plain, first, after = (float(d) for d in jax.jit(
        lambda g, p: [head_diameter(chain, g, p) for chain in chains])(grads, params))
    np.testing.assert_allclose(first, plain, rtol=1e-5)
    assert 1.5 * 5e-2 < plain <= 2 * 5e-2 * (1 + 1e-5)  # the head's radius: 5 * lr
    assert after < 0.5 * plain


def test_an_injected_rate_changed_in_nnx_optimizer_scales_the_next_step(rng):
    """learning-rates.md: under nnx.Optimizer the injected rates live in
    optimizer.opt_state.hyperparams; setting one scales the next step without a new trace (plain
    optax: tests/rowgeom/test_recipe.py::test_inject_hyperparams_scales_every_group_linearly)."""
    tx = optax.inject_hyperparams(rowgeom.lm_optimizer)(learning_rate=1e-3, weight_decay=0.0)

    class TinyLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(40, 8, rngs=rngs)
            self.lm_head = nnx.Linear(8, 40, use_bias=False, rngs=rngs)

    @nnx.jit  # built by one program (eagerly, each initialiser and zero state compiles its own)
    def build():
        model = TinyLM(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = build()
    rates = optimizer.opt_state.hyperparams
    assert set(rates) == {"learning_rate", "weight_decay"}
    traces = []

    @nnx.jit
    def step(model, optimizer, g):
        traces.append(None)
        optimizer.update(model, g)

    g = nnx.state(model, nnx.Param)
    g = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), g)
    moved = []
    for rate in (1e-3, 3e-3):
        rates["learning_rate"][...] = rate
        old = np.asarray(model.lm_head.kernel[...])
        step(model, optimizer, g)
        # D of the head's step over its token rows (the kernel's columns), float64 on the host
        moved.append(_np_diameter((np.asarray(model.lm_head.kernel[...]) - old).T))
    assert 2.5 * moved[0] < moved[1] <= 2 * 5 * 3e-3 * (1 + 1e-5), moved  # the head: 5 * lr
    assert len(traces) == 1


# ----------------------------------------------------------------------------- momentum spellings


def test_trace_and_ema_momenta_give_the_same_rownorm_step(rng):
    """getting-started.md: before projected RowNorm, `optax.trace(m)`, `optax.ema(m)` (debiased,
    optax's default) and `optax.ema(m, debias=False)` (what lm_optimizer uses unless
    HeadOptions(bias_correction=True)) differ by a positive factor per step, which the row
    normalisation removes: the steps agree, except for rows shorter than eps."""
    grads = [rng.standard_normal((8, 30)).astype(np.float32) for _ in range(3)]
    m = 0.95
    spellings = (optax.trace(decay=m), optax.ema(decay=m), optax.ema(decay=m, debias=False))

    @jax.jit  # every step below in one program (eagerly, each op compiles its own)
    def run(grads):
        steps = []
        for momentum in spellings:
            tx = optax.chain(momentum, rowgeom.projected_rownorm(vocab_axis=1))
            state, out = tx.init(grads[0]), []
            for g in grads:
                update, state = tx.update(g, state)
                out.append(update)
            steps.append(out)
        # The momenta themselves, one step from zero (trace, undebiased ema).
        momenta = [momentum.update(grads[0], momentum.init(grads[0]))[0]
                   for momentum in (spellings[0], spellings[2])]
        return steps, momenta

    (trace, *others), (t_mom, e_mom) = jax.tree.map(lambda x: np.asarray(x, np.float64),
                                                    run(grads))
    for other in others:
        for a, b in zip(trace, other, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The momenta themselves differ: trace = ema / (1 - m) = debiased ema * (1 - m^t) / (1 - m).
    np.testing.assert_allclose(e_mom, (1 - m) * t_mom, rtol=1e-6)
