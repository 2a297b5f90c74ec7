"""Every default of `lm_optimizer`, asserted directly: by the values it reports and by the steps
it takes on a tiny model, against float64 references written here from the documented chains.

Defaults covered: the base and group learning rates and `HEAD_LR_MULTIPLIERS` (RowNorm 5, AdamW 3,
Muon 3), decoupled weight decay (0.1 for matrices, 0 for vectors), momenta (0.95 Nesterov for
hidden matrices, a 0.95 EMA for the RowNorm head, AdamW b1 0.9, b2 0.95, eps 1e-8), five
"keller" Newton–Schulz steps scaled to RMS 0.2, the labels of a standard layout, and the head
tracker's cadence (the first update and every 10th). Each value test is paired with a check that
the reference with another value of the default differs from it, so a changed default fails an
assertion on a value here, never only an exception further down.
"""

import functools

import jax
import numpy as np
import pytest
from _geometry_shared import SMALL_D, SMALL_LM_PATHS, SMALL_V, shared_lm_optimizer
from _geometry_shared import small_lm_tree as tree

import rowgeom

# The small LM tree (tests/rowgeom/_geometry_shared.py), which test_recipe.py steps too: in one
# process the default recipe's update (and the AdamW and Muon heads') compiles once for both.
V, D = SMALL_V, SMALL_D
LR = 1e-2
PATHS = SMALL_LM_PATHS
# The label each leaf of the shared tree must get: the expectations below read them by path.
LABELS = {"embed/embedding": "embedding", "layers/0/attn/q_proj/kernel": "hidden",
          "layers/0/mlp/up_proj/kernel": "hidden", "layers/0/mlp_norm/scale": "vector",
          "final_norm/scale": "vector", "lm_head/kernel": "head"}
assert LABELS.keys() == PATHS.keys(), "the shared small LM tree changed: update LABELS"
HEAD = "lm_head/kernel"


def flat(t, prefix=""):
    out = {}
    for k, v in t.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}/")
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float64)
    return out


def zeros():
    return tree({p: np.zeros(s) for p, s in PATHS.items()})


def random_tree(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return tree({p: scale * rng.standard_normal(s) for p, s in PATHS.items()})


def steps(tx, grads_list, params, update=None):
    """Updates of successive jitted steps, all at the same params (no decay at zero params)."""
    state, out = tx.init(params), []
    update = jax.jit(tx.update) if update is None else update
    for grads in grads_list:
        updates, state = update(grads, state, params)
        out.append(flat(updates))
    return out, state


# One compiled step of the default recipe, shared by the tests of its defaults (and, in one
# process, by test_recipe.py's: the same transform object, so the same jit cache).
DEFAULT = shared_lm_optimizer(LR)
DEFAULT_UPDATE = jax.jit(DEFAULT.update)


def default_steps(grads_list, params):
    return steps(DEFAULT, grads_list, params, DEFAULT_UPDATE)


@pytest.fixture(scope="module")
def two_steps():
    """Two default steps at zero params: ``(g1, g2, (u1, u2), state)`` as flat float64 dicts.

    The head's first gradient has its token rows in +/- pairs; the embedding's and the vectors'
    gradients range from 1e-10 to 1 in magnitude (so AdamW's eps matters).
    """
    rng = np.random.default_rng(2)
    g1, g2 = flat(random_tree(3)), flat(random_tree(4))
    half = rng.standard_normal((D, V // 2))
    g1[HEAD] = np.concatenate([half, -half], axis=1)
    for path in ("embed/embedding", "final_norm/scale"):
        shape = PATHS[path]
        magnitudes = np.logspace(-10, 0, int(np.prod(shape))).reshape(shape)
        g1[path] = magnitudes * rng.choice([-1.0, 1.0], size=shape)
        g2[path] = magnitudes * rng.standard_normal(shape)
    updates, state = default_steps([tree(g1), tree(g2)], zeros())
    return g1, g2, updates, state


# --- float64 references of the documented chains ----------------------------------------------


def ref_rownorm(x, vocab_axis):
    rows = np.moveaxis(np.asarray(x, np.float64), vocab_axis, 0)
    rows = rows - rows.mean(axis=0)
    u = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-8)
    return np.moveaxis(u - u.mean(axis=0), 0, vocab_axis)


@functools.cache
def _polars(options):
    """One jitted program for the polar factors of a list of inputs, by `newton_schulz` with
    one ``(steps, coeffs)`` each (eagerly, every operation of the iteration would compile on
    its own; a program per option would be a compile each)."""
    return jax.jit(lambda xs: [rowgeom.newton_schulz(x, steps=steps, coeffs=coeffs)
                               for x, (steps, coeffs) in zip(xs, options, strict=True)])


def ref_muons(grads, variants):
    """For each variant (keywords momentum=0.95, nesterov=True, steps=5, coeffs="keller",
    rms=0.2), the last of successive Muon directions: trace -> polar factor ->
    rms * sqrt(max(m, n)); their polar factors from one program."""
    directions, options = [], []
    for variant in variants:
        momentum, nesterov = variant.get("momentum", 0.95), variant.get("nesterov", True)
        buf = 0.0
        for g in grads:
            buf = momentum * buf + g
            direction = g + momentum * buf if nesterov else buf
        directions.append(np.asarray(direction, np.float32))  # host: no conversion compile
        options.append((variant.get("steps", 5), variant.get("coeffs", "keller")))
    polars = _polars(tuple(options))(directions)
    return [variant.get("rms", 0.2) * np.sqrt(max(direction.shape)) * np.asarray(p, np.float64)
            for variant, direction, p in zip(variants, directions, polars, strict=True)]


def ref_muon(grads, **variant):
    """The last of successive Muon directions (see `ref_muons`)."""
    return ref_muons(grads, [variant])[0]


def ref_adam(grads, *, b1=0.9, b2=0.95, eps=1e-8):
    """The last of successive bias-corrected Adam directions."""
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        direction = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return direction


def np_row_diameter(s, vocab_axis):
    """Exact row diameter in float64, every pair (an independent reference: no compile)."""
    x = np.moveaxis(np.asarray(s, np.float64), vocab_axis, 0).reshape(np.shape(s)[vocab_axis], -1)
    return float(np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1).max()))


def far(a, b, tol):
    """True when `a` and `b` differ by more than `tol` somewhere (so a check at `tol` can tell
    the default from the alternative)."""
    return bool(np.abs(np.asarray(a) - np.asarray(b)).max() > tol)


# --- the values group_options reports ---------------------------------------------------


def test_head_lr_multipliers_are_the_head_studys_and_read_only():
    assert dict(rowgeom.HEAD_LR_MULTIPLIERS) == {"rownorm": 5.0, "adamw": 3.0, "muon": 3.0}
    with pytest.raises(TypeError):
        rowgeom.HEAD_LR_MULTIPLIERS["rownorm"] = 1.0  # type: ignore[index]


@pytest.mark.parametrize("head, multiplier, head_momentum",
                         [("rownorm", 5.0, 0.95), ("adamw", 3.0, 0.9), ("muon", 3.0, 0.95)])
def test_group_hyperparameters_default_to_the_documented_values(head, multiplier,
                                                                head_momentum):
    hp = rowgeom.group_options(LR, head=head)
    assert set(hp) == {"hidden", "head", "embedding", "vector", "router"}
    expected = {  # group: (learning rate, weight decay, momentum or AdamW b1)
        "hidden": (LR, 0.1, 0.95),
        "head": (multiplier * LR, 0.1, head_momentum),
        "embedding": (LR, 0.1, 0.9),
        "vector": (LR, 0.0, 0.9),
        "router": (LR, 0.1, 0.95),  # MoE routers: the hidden group's Muon by default
    }
    for group, (lr, wd, mom) in expected.items():
        got = hp[group]
        assert (got.learning_rate, got.weight_decay, got.momentum) == pytest.approx(
            (lr, wd, mom), rel=1e-12), group
    # A schedule stays a schedule, scaled alike.
    sched = rowgeom.group_options(lambda count: LR * (1 + count), head=head)
    for group, (lr, _, _) in expected.items():
        rate = sched[group].learning_rate
        assert callable(rate) and float(rate(3)) == pytest.approx(4 * lr, rel=1e-6), group


def test_overrides_replace_only_their_group():
    hp = rowgeom.group_options(LR, weight_decay=0.2, groups={
        "head": rowgeom.GroupOptions(learning_rate=0.5, weight_decay=0.05),
        "vector": rowgeom.GroupOptions(weight_decay=0.01)})
    assert hp["hidden"].weight_decay == hp["embedding"].weight_decay == 0.2
    assert hp["head"].weight_decay == 0.05 and hp["head"].learning_rate == 0.5
    assert hp["vector"].weight_decay == 0.01
    assert hp["hidden"].learning_rate == hp["embedding"].learning_rate == LR


def test_default_labels_and_describe():
    params = zeros()
    labels = flat_labels(rowgeom.label_params(params))
    assert labels == LABELS
    rows = {row.path: row for row in rowgeom.describe(params, LR)}
    assert set(rows) == set(PATHS)
    hp = rowgeom.group_options(LR)
    for path, label in LABELS.items():
        row = rows[path]
        assert row.label == label, path
    plan = rowgeom.describe(params, LR)
    assert plan.groups == dict(hp)
    assert "RowNorm" in rows[HEAD].geometry and "1" in rows[HEAD].geometry  # vocab axis 1
    assert plan.groups["head"].learning_rate == pytest.approx(5 * LR)
    assert "Muon" in rows["layers/0/mlp/up_proj/kernel"].geometry


def flat_labels(t, prefix=""):
    out = {}
    for k, v in t.items():
        out |= flat_labels(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


# --- the steps lm_optimizer takes --------------------------------------------------------------


def test_zero_gradients_leave_only_the_decoupled_decay_of_each_group():
    """With zero gradients every direction is zero (Muon, RowNorm and AdamW of 0 are 0), so
    each update is ``-lr_group * wd_group * W``: 0.1 for matrices at their group's rate (the
    head at 5x), 0 for vectors."""
    params = random_tree(1)
    grads = tree({p: np.zeros(s) for p, s in PATHS.items()})  # host zeros: no compile
    (updates,), _ = default_steps([grads], params)
    w = flat(params)
    expected_factor = {"embedding": LR * 0.1, "hidden": LR * 0.1, "head": 5 * LR * 0.1,
                       "vector": 0.0}
    for path, label in LABELS.items():
        np.testing.assert_allclose(updates[path], -expected_factor[label] * w[path],
                                   rtol=1e-6, atol=1e-12, err_msg=path)


def test_rownorm_head_step_ema_rate_and_diameter(two_steps):
    """At zero params the second step is ``-5 lr · P rownorm(P m)`` with the EMA
    ``m = 0.95 m + 0.05 g`` (no Nesterov, no debiasing); its diameter is ``5 lr`` times the
    reference's, at most 2·5·lr."""
    g1, g2, (_, second), _ = two_steps
    m = 0.05 * (0.95 * g1[HEAD] + g2[HEAD])
    want = -5 * LR * ref_rownorm(m, vocab_axis=1)
    np.testing.assert_allclose(second[HEAD], want, atol=1e-7)
    # Other momenta (or Nesterov) move the head elsewhere, beyond that tolerance.
    for other in (0.05 * (0.9 * g1[HEAD] + g2[HEAD]),
                  g2[HEAD] + 0.95 * (g2[HEAD] + 0.95 * g1[HEAD])):
        assert far(-5 * LR * ref_rownorm(other, vocab_axis=1), want, 1e-5)
    diameter = np_row_diameter(second[HEAD], vocab_axis=1)
    ref_diameter = np_row_diameter(ref_rownorm(m, 1), vocab_axis=1)
    assert diameter == pytest.approx(5 * LR * ref_diameter, rel=1e-5)
    assert diameter <= 2 * 5 * LR * (1 + 1e-5)


def test_rownorm_head_step_uses_the_whole_radius_on_antipodal_rows(two_steps):
    """The first head gradient's token rows come in +/- pairs: every direction row is a unit
    vector about the centre 0, so the step's diameter is exactly 2 · 5 · lr, and the tracker
    (last in the head chain, which after two steps still holds update 1's stats) records
    exactly that as both ends of its bracket."""
    _, _, (first, _), state = two_steps
    assert np_row_diameter(first[HEAD], vocab_axis=1) == pytest.approx(2 * 5 * LR, rel=1e-5)
    stats = rowgeom.read_row_diameter(state)
    assert stats.measured_at == {HEAD: 1} and stats.count == {HEAD: 2}
    assert float(stats.lower[HEAD]) == pytest.approx(2 * 5 * LR, rel=1e-5)
    assert float(stats.upper[HEAD]) == pytest.approx(2 * 5 * LR, rel=1e-5)
    assert float(stats.row_sum_residual[HEAD]) < 1e-6


@pytest.mark.parametrize("path", ["layers/0/mlp/up_proj/kernel", "layers/0/attn/q_proj/kernel"])
def test_hidden_step_is_nesterov_muon_with_five_keller_steps_at_rms_02(two_steps, path):
    g1, g2, (_, second), _ = two_steps
    grads = [g1[path], g2[path]]
    others = (dict(nesterov=False), dict(momentum=0.9), dict(steps=4), dict(steps=6),
              dict(coeffs="polar_express"), dict(rms=0.25))
    default, *alternatives = ref_muons(grads, [{}, *others])  # one compile for all seven
    want = -LR * default
    np.testing.assert_allclose(second[path], want, rtol=1e-5, atol=1e-7)
    # Each other default would be told apart by the comparison above.
    for other, alternative in zip(others, alternatives, strict=True):
        assert far(-LR * alternative, want, 1e-5), other
    rms = np.sqrt(np.mean(np.square(second[path]))) / LR
    assert 0.15 < rms < 0.21  # step RMS about 0.2 lr (up to the Newton-Schulz band)


@pytest.mark.parametrize("path", ["embed/embedding", "final_norm/scale"])
def test_embedding_and_vector_steps_are_adamw_b1_09_b2_095_eps_1e8(two_steps, path):
    """Two AdamW steps on gradients from 1e-10 to 1 (so eps matters), at zero params."""
    g1, g2, (_, second), _ = two_steps
    grads = [g1[path], g2[path]]
    want = -LR * ref_adam(grads)
    np.testing.assert_allclose(second[path], want, rtol=1e-4, atol=1e-9)
    for other in (dict(b1=0.95), dict(b2=0.999), dict(eps=1e-7)):
        assert far(-LR * ref_adam(grads, **other), want, 1e-4 * LR), other


def test_adamw_and_muon_heads_use_three_times_the_rate():
    g1, g2 = random_tree(11), random_tree(12)
    grads = [flat(g1)[HEAD], flat(g2)[HEAD]]
    (_, adam_step), _ = steps(shared_lm_optimizer(LR, head="adamw"), [g1, g2], zeros())
    np.testing.assert_allclose(adam_step[HEAD], -3 * LR * ref_adam(grads), rtol=1e-4, atol=1e-9)
    (_, muon_step), _ = steps(shared_lm_optimizer(LR, head="muon"), [g1, g2], zeros())
    np.testing.assert_allclose(muon_step[HEAD], -3 * LR * ref_muon(grads), rtol=1e-5, atol=1e-7)


def test_head_tracker_measures_the_first_update_and_every_tenth():
    params = zeros()
    state, update = DEFAULT.init(params), DEFAULT_UPDATE
    grads = random_tree(13)
    seen = {}
    for n in range(1, 21):
        _, state = update(grads, state, params)
        stats = rowgeom.read_row_diameter(state)
        assert stats.count == {HEAD: n}
        seen[n] = int(stats.measured_at[HEAD])
    assert {n: seen[n] for n in (1, 2, 9, 10, 11, 19, 20)} == {
        1: 1, 2: 1, 9: 1, 10: 10, 11: 10, 19: 10, 20: 20}
    # What it measured is that step's: here every step is the same, D = 5 lr * D(reference).
    stats = rowgeom.read_row_diameter(state)
    d = np_row_diameter(ref_rownorm(0.05 * flat(grads)[HEAD], 1), vocab_axis=1)
    assert float(stats.lower[HEAD]) <= 5 * LR * d * (1 + 1e-5) <= float(stats.upper[HEAD]) * (
        1 + 1e-5)
