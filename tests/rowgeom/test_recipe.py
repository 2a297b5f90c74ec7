"""lm_optimizer (rowgeom._recipe) against independent references, in NNX, jit and inject."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _geometry_shared import SMALL_LM_PATHS, shared_lm_optimizer, small_lm_tree, small_lm_values
from _nnx_models import D, TinyLM, V
from flax import nnx

import rowgeom
from rowgeom._structure import head_vocab_axis
from rowgeom._tree import tree_paths

LR, WD, BETA = 1e-2, 0.1, 0.95


def lm_loss(model, ids):
    logits = model(ids)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


IDS = np.random.default_rng(0).integers(0, V, size=(2, 8))


def flat(tree):
    return {"/".join(p): np.asarray(x, np.float64) for p, x in tree_paths(tree)}


@pytest.fixture(scope="module")
def params():
    """The small LM tree (_geometry_shared.SMALL_LM_PATHS: an embedding, one block, a final
    norm, a (d, V) head; nnx.to_pure_dict's layout) of device arrays drawn on the host (no
    initializer compile); test_recipe_defaults.py steps this tree with the same transforms,
    so in one process each update compiles once."""
    return small_lm_tree(small_lm_values(0))


def random_grads(params, seed):
    """Host arrays (a jitted update takes them as they are: no conversion compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), params)


def apply_updates(params, updates):
    """optax.apply_updates on the host (float32 + float32, the same rounding; eagerly each
    leaf's addition would compile on its own), placed back as device arrays like the first
    step's params (`jax.device_put`: no compile)."""
    return jax.device_put(jax.tree.map(lambda p, u: np.asarray(p) + np.asarray(u), params,
                                       updates))


def run_steps(tx, params, n=2):
    """n jitted steps on random gradients; returns [(params_before, grads, updates)], state."""
    update = jax.jit(tx.update)
    state, out = tx.init(params), []
    for i in range(n):
        grads = random_grads(params, seed=i)
        updates, state = update(grads, state, params)
        out.append((params, grads, updates))
        params = apply_updates(params, updates)
        if i == 0:  # jit's cache is the function's: another test may have filled it already
            cached = update._cache_size()
    assert update._cache_size() == cached  # the second step reuses the first step's compile
    return out, state


@pytest.fixture(scope="module")
def default_run(params):
    """Two steps of the default recipe (one compile shared by the reference tests, and in one
    process by test_recipe_defaults.py's and test_options_plan.py's steps of this tree)."""
    return run_steps(shared_lm_optimizer(LR), params)


def np_rownorm(m, vocab_axis, center=True, eps=1e-8):
    """Projected RowNorm reference: centre over tokens, normalise each token row, centre again."""
    x = np.moveaxis(np.asarray(m, np.float64), vocab_axis, 0)
    if center:
        x = x - x.mean(axis=0, keepdims=True)
    u = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)
    if center:
        u = u - u.mean(axis=0, keepdims=True)
    return np.moveaxis(u, 0, vocab_axis)


def np_diameter(s, vocab_axis):
    x = np.moveaxis(np.asarray(s, np.float64), vocab_axis, 0).reshape(s.shape[vocab_axis], -1)
    return np.sqrt(np.max(((x[:, None] - x[None]) ** 2).sum(-1)))


# ---------------------------------------------------------------- the head geometry, numerically


def test_rownorm_head_step_equals_the_fp64_reference(default_run):
    steps, _ = default_run
    head_lr, mom = rowgeom.HEAD_LR_MULTIPLIERS["rownorm"] * LR, 0.0
    for before, grads, updates in steps:
        w, g = flat(before)["lm_head/kernel"], flat(grads)["lm_head/kernel"]
        mom = BETA * mom + (1 - BETA) * g  # EMA momentum, before the normalisation
        expected = -head_lr * (np_rownorm(mom, vocab_axis=1) + WD * w)
        got = flat(updates)["lm_head/kernel"]
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-7)
        # The tokens of a (d, V) kernel are its columns: the wrong axis is far off.
        wrong = -head_lr * (np_rownorm(mom, vocab_axis=0) + WD * w)
        assert np.abs(got - wrong).max() > 1e-3
        # Without weight decay every token column moves by at most head_lr (radius r = lr).
        assert np_diameter(got + head_lr * WD * w, 1) <= 2 * head_lr * (1 + 1e-5)
        # What the docstring says: every row lies at distance exactly head_lr from the common
        # point head_lr * nbar (nbar: mean of the unit centred momentum rows), while the rows'
        # own norms spread around head_lr.
        rows = (got + head_lr * WD * w).T
        x = mom.T - mom.T.mean(axis=0)
        nbar = (x / np.linalg.norm(x, axis=1, keepdims=True)).mean(axis=0)
        np.testing.assert_allclose(np.linalg.norm(rows - head_lr * nbar, axis=1), head_lr,
                                   rtol=1e-4)
        norms = np.linalg.norm(rows, axis=1)
        assert norms.max() - norms.min() > 1e-3 * head_lr
        assert np.all(np.abs(norms / head_lr - 1) <= np.linalg.norm(nbar) * (1 + 1e-4))


def test_hidden_step_is_muon_of_the_nesterov_momentum(default_run):
    steps, _ = default_run
    muon = rowgeom.muon_orthogonalize()
    # Jitted: one compile for both steps (eagerly, every operation compiles on its own).
    orthogonalize = jax.jit(lambda u: muon.update(u, optax.EmptyState())[0])
    buf = 0.0
    for before, grads, updates in steps:
        path = "layers/0/mlp/up_proj/kernel"
        w, g = flat(before)[path], flat(grads)[path]
        buf = BETA * buf + g  # optax.trace, Nesterov: g + beta * buf
        polar = orthogonalize({"w": (g + BETA * buf).astype(np.float32)})
        expected = -LR * (np.asarray(polar["w"], np.float64) + WD * w)
        np.testing.assert_allclose(flat(updates)[path], expected, rtol=2e-5, atol=1e-7)
        # RMS-matched Muon: the direction has RMS 0.2 (up to Newton-Schulz's band).
        assert 0.1 < np.sqrt(np.mean(np.asarray(polar["w"]) ** 2)) < 0.3


def np_adamw_updates(grads, params, *, lr, b1, b2, eps, weight_decay):
    """AdamW's successive updates in float64 (Loshchilov & Hutter; optax.adamw's chain):
    bias-corrected moments, then the decoupled decay, times -lr."""
    m = v = 0.0
    out = []
    for t, (g, w) in enumerate(zip(grads, params, strict=True), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        direction = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        out.append(-lr * (direction + weight_decay * w))
    return out


def test_embeddings_and_vectors_get_adamw(default_run):
    steps, _ = default_run
    cases = {"embed/embedding": WD, "layers/0/mlp_norm/scale": 0.0}  # path: weight decay
    for path, weight_decay in cases.items():
        refs = np_adamw_updates([flat(grads)[path] for _, grads, _ in steps],
                                [flat(before)[path] for before, _, _ in steps],
                                lr=LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay)
        for i, ((_, _, updates), ref) in enumerate(zip(steps, refs, strict=True)):
            np.testing.assert_allclose(flat(updates)[path], ref, rtol=1e-5, atol=1e-8,
                                       err_msg=f"{path} step {i}")


def check_bracket(stats, head_update):
    """The recorded O(Vd) bracket holds the exact diameter of the real head step."""
    lower, upper = (float(jax.tree.leaves(x)[0]) for x in (stats.lower, stats.upper))
    exact = np_diameter(np.asarray(head_update), vocab_axis=1)
    assert 0 < lower <= exact * (1 + 1e-5) and exact <= upper * (1 + 1e-5)


def test_diagnostics_record_the_first_head_step_then_every_tenth(params, default_run):
    steps, state = default_run  # two steps: by default the tracker measured only the first
    stats = rowgeom.read_row_diameter(state)
    assert stats.measured_at == {"lm_head/kernel": 1} and stats.count == {"lm_head/kernel": 2}
    check_bracket(stats, flat(steps[0][2])["lm_head/kernel"])
    steps, state = run_steps(
        rowgeom.lm_optimizer(LR, head=rowgeom.HeadOptions(track_every_k_steps=1)), params, n=2)
    stats = rowgeom.read_row_diameter(state)
    assert stats.measured_at == {"lm_head/kernel": 2}
    check_bracket(stats, flat(steps[-1][2])["lm_head/kernel"])


def test_tied_head_is_uncentred_rownorm_on_the_table_rows():
    rng = np.random.default_rng(3)
    params = {"wte": {"embedding": rng.normal(size=(V, D)).astype(np.float32)},
              "h": {"0": {"mlp": {"c_fc": rng.normal(size=(D, D)).astype(np.float32)}}}}
    with pytest.raises(ValueError, match="tied"):
        rowgeom.lm_optimizer(LR).init(params)
    steps, _ = run_steps(rowgeom.lm_optimizer(LR, tied="head"), params, n=1)
    before, grads, updates = steps[0]
    w, g = flat(before)["wte/embedding"], flat(grads)["wte/embedding"]
    expected = -rowgeom.HEAD_LR_MULTIPLIERS["rownorm"] * LR * (
        np_rownorm((1 - BETA) * g, vocab_axis=0, center=False) + WD * w)
    np.testing.assert_allclose(flat(updates)["wte/embedding"], expected, rtol=2e-5, atol=1e-7)


# ---------------------------------------------------------------- frameworks and transformations


def train_step(model, optimizer, ids):
    loss, grads = nnx.value_and_grad(lm_loss)(model, ids)
    return loss, optimizer.update(model, grads)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["rownorm", "adamw", "muon"])
def test_nnx_optimizer_steps_under_nnx_jit(head):
    model = TinyLM(nnx.Rngs(1))
    before = flat(nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, rowgeom.lm_optimizer(LR, head=head), wrt=nnx.Param)
    step = nnx.jit(train_step)
    losses, head_steps = [], []
    for _ in range(3):
        loss, updates = step(model, optimizer, IDS)
        losses.append(float(loss))
        head_steps.append(flat(updates)["lm_head/kernel"])
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    after = flat(nnx.state(model, nnx.Param))
    assert all(not np.allclose(after[p], before[p]) for p in before)
    # Every head is tracked, so experiments can compare their diameters (by default measured on
    # the first step, then every tenth).
    stats = rowgeom.read_row_diameter(optimizer.opt_state)
    assert stats.measured_at == {"lm_head/kernel": 1} and stats.count == {"lm_head/kernel": 3}
    check_bracket(stats, head_steps[0])


def test_inject_hyperparams_scales_every_group_linearly(params):
    tx = optax.inject_hyperparams(rowgeom.lm_optimizer)(learning_rate=LR)
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "weight_decay"}  # the float rates
    # Options objects and the flat keywords stay static: never injected.
    grads, update = random_grads(params, 0), jax.jit(tx.update)
    u1, state1 = update(grads, state, params)
    hyperparams = {**state.hyperparams, "learning_rate": jnp.float32(2 * LR)}
    doubled = state._replace(hyperparams=hyperparams)
    u2, _ = update(grads, doubled, params)
    for path, x in flat(u1).items():
        np.testing.assert_allclose(flat(u2)[path], 2 * x, rtol=1e-5, atol=1e-9, err_msg=path)
    # Same compiled function for the next step (hyperparameters are arrays, not constants).
    update(grads, state1, params)
    assert update._cache_size() == 1


def test_inject_hyperparams_static_args(params):
    # Option objects pass through inject_hyperparams as static options.
    tx = optax.inject_hyperparams(rowgeom.lm_optimizer)(
        learning_rate=LR, muon=rowgeom.MuonOptions(ns_steps=3),
        head=rowgeom.HeadOptions(vocab_axis=1))
    assert set(tx.init(params).hyperparams) == {"learning_rate", "weight_decay"}
    tx = optax.inject_hyperparams(rowgeom.lm_optimizer, static_args=rowgeom.STATIC_ARGS)(
        learning_rate=LR, labels=rowgeom.label_params)
    state = tx.init(params)
    assert not set(rowgeom.STATIC_ARGS) & set(state.hyperparams)
    # A callable `labels` not listed in static_args is mistaken for a schedule: caught.
    with pytest.raises(TypeError, match="labels must be.*static_args"):
        optax.inject_hyperparams(rowgeom.lm_optimizer)(
            learning_rate=LR, labels=rowgeom.label_params).init(params)


def test_schedules_per_group(default_run):
    sched = lambda count: LR * (1.0 + count)  # doubles from step 0 to step 1
    embed_sched = lambda count: LR * (3.0 - count)
    tx = rowgeom.lm_optimizer(
        sched, groups={"embedding": rowgeom.GroupOptions(learning_rate=embed_sched)})
    # The head's derived rate (5x) is a schedule too; the embedding follows its own.
    factor = lambda path, i: 3.0 - i if path == "embed/embedding" else 1.0 + i
    params = default_run[0][0][0]
    state, update = tx.init(params), jax.jit(tx.update)
    # Replay the default run: same params and gradients, so only the rates differ.
    for i, (before, grads, const) in enumerate(default_run[0]):
        updates, state = update(grads, state, before)
        for path, x in flat(const).items():
            np.testing.assert_allclose(flat(updates)[path], factor(path, i) * x,
                                       rtol=1e-5, atol=1e-9, err_msg=f"{path} step {i}")


# ---------------------------------------------------------------- labels, axes and errors


def test_optax_contrib_muon_sends_embedding_and_head_to_muon_but_lm_optimizer_does_not(params):
    """Regression: optax's default 2-D rule is the defect rowgeom's labels exist to avoid."""

    def holds(state, group):  # which blocks have state (so a step) in this group
        return {name for path, _ in tree_paths(state.inner_states[group])
                for name in ("embed", "layers", "lm_head") if name in path}

    assert holds(optax.contrib.muon(LR).init(params), "muon") == {"embed", "layers", "lm_head"}
    ours = rowgeom.lm_optimizer(LR).init(params)
    assert holds(ours, "hidden") == {"layers"}
    assert holds(ours, "head") == {"lm_head"}
    assert holds(ours, "embedding") == {"embed"}


def test_head_vocab_axis_inference():
    assert head_vocab_axis(("lm_head", "kernel"), (D, V), None) == 1
    assert head_vocab_axis(("wte", "embedding"), (V, D), None) == 0
    assert head_vocab_axis(("lm_head", "weight"), (V, D), None) == 0
    assert head_vocab_axis(("output", "w"), (D, V), V) == 1  # the one axis of size V
    for path, shape in ((("output", "w"), (D, V)), (("lm_head", "kernel"), (D, 2, V))):
        with pytest.raises(ValueError, match=r"HeadOptions\(vocab_axis"):
            head_vocab_axis(path, shape, None)
    # With the vocabulary size known from the embedding, the one axis of size V is the vocab axis.
    params = {"embed": np.zeros((V, D), np.float32), "output": {"w": np.zeros((D, V), np.float32)}}
    steps, _ = run_steps(rowgeom.lm_optimizer(LR, head=rowgeom.HeadOptions(track=False)), params,
                         n=1)
    got = flat(steps[0][2])["output/w"]
    assert np.abs(got.sum(axis=1)).max() < 1e-5  # centred over the inferred vocab axis 1
    # A square head (V == d) named neither kernel nor weight: an error naming it, then the fix.
    square = {"embed": np.zeros((D, D), np.float32), "output": {"w": np.zeros((D, D), np.float32)}}
    with pytest.raises(ValueError, match=r"output/w.*HeadOptions\(vocab_axis"):
        rowgeom.lm_optimizer(LR).init(square)
    rowgeom.lm_optimizer(LR, head=rowgeom.HeadOptions(vocab_axis=1)).init(square)


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="head must be one of"):
        rowgeom.lm_optimizer(LR, head="sgd")
    with pytest.raises(ValueError, match="tied must be"):
        rowgeom.lm_optimizer(LR, tied=True)
    with pytest.raises(TypeError, match="HeadOptions.vocab_axis must be an int"):
        rowgeom.HeadOptions(vocab_axis=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'head_lr'"):
        rowgeom.lm_optimizer(LR, head_lr=1e-3)
    with pytest.raises(ValueError, match=r"groups: unknown group\(s\) \['lm_head'\]"):
        rowgeom.lm_optimizer(LR, groups={"lm_head": rowgeom.GroupOptions(weight_decay=0.0)})
    with pytest.raises(TypeError, match="labels must be"):
        rowgeom.lm_optimizer(LR, labels="hidden")


def test_empty_head_group_raises_unless_tied_is_said(params):
    labels = rowgeom.label_params(params)
    labels["lm_head"]["kernel"] = "hidden"  # a user labelling that forgot the head
    with pytest.raises(ValueError, match=r"no parameter is labelled 'head'.*tied='embedding'"):
        rowgeom.lm_optimizer(LR, labels=labels).init(params)
    rowgeom.lm_optimizer(LR, labels=labels, tied="embedding").init(params)  # said: fine
    with pytest.raises(ValueError, match=r"tied='head'\): no parameter is labelled 'head'"):
        rowgeom.lm_optimizer(LR, labels=labels, tied="head").init(params)


@pytest.mark.parametrize("head", ["adamw", "muon"])
def test_default_head_rates_come_from_group_options(head):
    """One source of truth: the head's step size is the rate group_options reports,
    HEAD_LR_MULTIPLIERS[head] (3) times the base rate, as the head study chose."""
    rate = rowgeom.group_options(LR, head=head)["head"].learning_rate
    assert rate == pytest.approx(3 * LR)
    # The first step from zero params (no weight-decay term): the head's direction times its
    # rate alone. test_recipe_defaults.py's transform and tree: in one process, one compile.
    tx = shared_lm_optimizer(LR, head=head)
    zeros = small_lm_tree({path: np.zeros(shape) for path, shape in SMALL_LM_PATHS.items()})
    grads = random_grads(zeros, seed=0)
    updates, _ = jax.jit(tx.update)(grads, tx.init(zeros), zeros)
    step = np.asarray(updates["lm_head"]["kernel"], np.float64)
    if head == "adamw":  # first AdamW step: -lr * g / (|g| + eps), so max |step| = lr
        assert np.abs(step).max() == pytest.approx(rate, rel=1e-3)
    else:  # Muon of the first Nesterov momentum (1 + beta) g, times the rate
        orth = rowgeom.muon_orthogonalize()
        momentum = ((1 + BETA) * grads["lm_head"]["kernel"]).astype(np.float32)
        want = jax.jit(lambda u: orth.update(u, orth.init(u))[0])(momentum)
        np.testing.assert_allclose(step, -rate * np.asarray(want), rtol=1e-4, atol=1e-8)


@pytest.mark.slow
def test_head_num_valid_matches_the_recipe_on_the_real_rows():
    """A vocabulary padded from 52 to 64 tokens: with HeadOptions(num_valid=52) every update equals
    the recipe's on the 52 real rows alone, and the padding rows get exactly zero."""
    real = 52
    params = {"embed": {"embedding": jnp.zeros((V, D))}, "lm_head": {"kernel": jnp.zeros((D, V))},
              "layers": {"0": {"mlp": {"up_proj": {"kernel": jnp.zeros((D, 2 * D))}}}}}
    cut = lambda t: {**t, "embed": {"embedding": t["embed"]["embedding"][:real]},
                     "lm_head": {"kernel": t["lm_head"]["kernel"][:, :real]}}
    key = jax.random.key(3)
    params = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"].at[:, real:].set(0)
    padded_tx = rowgeom.lm_optimizer(LR, head=rowgeom.HeadOptions(num_valid=real))
    real_tx = rowgeom.lm_optimizer(LR)
    padded_state, real_state = padded_tx.init(params), real_tx.init(cut(params))
    padded_update, real_update = jax.jit(padded_tx.update), jax.jit(real_tx.update)
    for k in jax.random.split(jax.random.key(4), 2):
        grads = jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params)
        grads["lm_head"]["kernel"] = grads["lm_head"]["kernel"].at[:, real:].set(0)
        up_padded, padded_state = padded_update(grads, padded_state, params)
        up_real, real_state = real_update(cut(grads), real_state, cut(params))
        head = np.asarray(up_padded["lm_head"]["kernel"])
        np.testing.assert_allclose(head[:, :real], up_real["lm_head"]["kernel"], atol=1e-6)
        assert np.all(head[:, real:] == 0)
    with pytest.raises(TypeError, match="HeadOptions.num_valid"):
        rowgeom.HeadOptions(num_valid=52.0)
