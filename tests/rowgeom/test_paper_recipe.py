"""The paper's recipe (arXiv 2608.22253, Table 2), built through the public options alone and
checked step by step, under jit, against float64 numpy written from the paper's equations.

- Backbone: Nesterov Muon, peak lr 8e-3, momentum 0.95 (``b = 0.95 b + g``, direction
  ``g + 0.95 b``), decoupled weight decay 0.1, 5 Newton–Schulz steps with (3.4445, −4.7750,
  2.0315) on the input divided by its Frobenius norm + 1e-5, the polar factor of an
  ``m × n`` (out × in) weight scaled by ``√max(1, m/n)``.
- Input embedding: AdamW, peak lr 4e-3, β = (0.9, 0.999), eps 1e-10, weight decay 0.1.
- AdamW head: β = (0.9, 0.999), eps 1e-10, weight decay 0.1.
- RowNorm head: EMA ``B = 0.95 B + 0.05 G``, bias-corrected by ``1 − 0.95^t``, token rows
  normalised with eps 1e-8, no weight decay (rowgeom's projected RowNorm: centred before and
  after, the paper's quotient-space direction). The bias correction divides every row by the
  same factor, so it changes the direction only through rows shorter than eps.
- Every rate: linear warmup, then cosine decay to 10 % of the peak (a schedule per group).
"""

import jax
import numpy as np
import optax
import pytest

import rowgeom

V, D, F = 40, 8, 24
T, WARMUP = 10, 2
KELLER = (3.4445, -4.7750, 2.0315)
PEAKS = {"hidden": 8e-3, "embedding": 4e-3, "adamw_head": 4e-3, "rownorm_head": 3.2e-3}


def schedule(peak):
    """The paper's schedule: warmup to the peak, cosine to 10 % of it at step T."""
    return optax.warmup_cosine_decay_schedule(0.1 * peak, peak, WARMUP, T, end_value=0.1 * peak)


def recipe(head: str) -> optax.GradientTransformation:
    """The paper's recipe with an AdamW or RowNorm head, through rowgeom's public options."""
    muon = rowgeom.MuonOptions(momentum=0.95, nesterov=True, ns_steps=5, ns_coeffs="keller",
                               eps=1e-5, scale="keller")
    adam = rowgeom.AdamOptions(b1=0.9, b2=0.999, eps=1e-10)
    if head == "rownorm":
        head_options = rowgeom.HeadOptions(optimizer="rownorm", momentum=0.95,
                                           bias_correction=True, eps=1e-8)
        head_group = rowgeom.GroupOptions(learning_rate=schedule(PEAKS["rownorm_head"]),
                                          weight_decay=0.0)
    else:
        head_options = rowgeom.HeadOptions(optimizer="adamw")
        head_group = rowgeom.GroupOptions(learning_rate=schedule(PEAKS["adamw_head"]),
                                          weight_decay=0.1)
    groups = {"hidden": rowgeom.GroupOptions(learning_rate=schedule(PEAKS["hidden"])),
              "embedding": rowgeom.GroupOptions(learning_rate=schedule(PEAKS["embedding"])),
              "head": head_group}
    return rowgeom.lm_optimizer(PEAKS["hidden"], head=head_options, muon=muon, adam=adam,
                                weight_decay=0.1, groups=groups)


def model(seed=0, scale=0.02):
    """Untied embedding and head, one block of bias-free linears, no vector parameters (the
    paper's RMSNorms have no gain): Flax layouts, kernels (in, out), head (d, V). Drawn on the
    host as float32 (a tree of numpy arrays: the jitted update takes it as it is, and no eager
    operation compiles a program of its own)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (scale * rng.standard_normal(shape)).astype(np.float32)
    return {"embed": {"embedding": normal(V, D)},
            "layers": {"0": {"attn": {"query": {"kernel": normal(D, D)}},
                             "mlp": {"up": {"kernel": normal(D, F)},
                                     "down": {"kernel": normal(F, D)}}}},
            "lm_head": {"kernel": normal(D, V)}}


# --- float64 references, from the paper's equations ------------------------------------------


def np_muon_direction(g):
    """``√max(1, out/in) · NS5(g / (||g||_F + 1e-5))`` of a Flax kernel ``(in, out)``."""
    x = g / (np.linalg.norm(g) + 1e-5)
    transpose = x.shape[0] > x.shape[1]
    x = x.T if transpose else x
    a, b, c = KELLER
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if transpose else x
    fan_in, fan_out = g.shape
    return np.sqrt(max(1.0, fan_out / fan_in)) * x


class NpMuon:
    def __init__(self, lr, wd):
        self.lr, self.wd, self.b = lr, wd, None

    def step(self, t, g, w):
        self.b = g if self.b is None else 0.95 * self.b + g
        direction = np_muon_direction(g + 0.95 * self.b)
        return -self.lr(t) * (direction + self.wd * w)


class NpAdamW:
    def __init__(self, lr, wd):
        self.lr, self.wd, self.m, self.v = lr, wd, 0.0, 0.0

    def step(self, t, g, w):
        self.m = 0.9 * self.m + 0.1 * g
        self.v = 0.999 * self.v + 0.001 * g**2
        m_hat, v_hat = self.m / (1 - 0.9 ** (t + 1)), self.v / (1 - 0.999 ** (t + 1))
        return -self.lr(t) * (m_hat / (np.sqrt(v_hat) + 1e-10) + self.wd * w)


class NpRowNorm:
    """Bias-corrected EMA 0.95, then projected RowNorm over the token rows (the columns of a
    (d, V) kernel), eps 1e-8, no decay."""

    def __init__(self, lr):
        self.lr, self.ema = lr, 0.0

    def step(self, t, g, w):
        self.ema = 0.95 * self.ema + 0.05 * g
        rows = (self.ema / (1 - 0.95 ** (t + 1))).T  # (V, d)
        x = rows - rows.mean(axis=0)
        y = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
        return -self.lr(t) * (y - y.mean(axis=0)).T


def np_schedule(peak):
    """`schedule(peak)` from its definition: linear from 0.1·peak to the peak over WARMUP steps,
    then a half cosine from the peak to 0.1·peak at step T."""
    def rate(t):
        if t < WARMUP:
            return 0.1 * peak + 0.9 * peak * t / WARMUP
        return 0.1 * peak + 0.9 * peak * 0.5 * (1 + np.cos(np.pi * (t - WARMUP) / (T - WARMUP)))
    return rate


def references(head):
    lr = np_schedule
    hidden = lr(PEAKS["hidden"])
    refs = {("embed", "embedding"): NpAdamW(lr(PEAKS["embedding"]), 0.1),
            ("layers", "0", "attn", "query", "kernel"): NpMuon(hidden, 0.1),
            ("layers", "0", "mlp", "up", "kernel"): NpMuon(hidden, 0.1),
            ("layers", "0", "mlp", "down", "kernel"): NpMuon(hidden, 0.1)}
    refs["lm_head", "kernel"] = (NpRowNorm(lr(PEAKS["rownorm_head"])) if head == "rownorm"
                                 else NpAdamW(lr(PEAKS["adamw_head"]), 0.1))
    return refs


def get(tree, path):
    for key in path:
        tree = tree[key]
    return np.asarray(tree, np.float64)


@pytest.mark.parametrize("head", ["rownorm", "adamw"])
def test_the_papers_recipe_matches_its_equations_step_by_step(head):
    tx = recipe(head)
    plan = rowgeom.describe(model(), PEAKS["hidden"], head=head)
    assert {row.path: row.label for row in plan} == {
        "embed/embedding": "embedding", "layers/0/attn/query/kernel": "hidden",
        "layers/0/mlp/up/kernel": "hidden", "layers/0/mlp/down/kernel": "hidden",
        "lm_head/kernel": "head"}
    params = model()
    state = tx.init(params)
    step = jax.jit(tx.update)
    refs = references(head)
    for t in range(3):
        grads = model(seed=t + 1, scale=1.0)  # gradients of order 1
        updates, state = step(grads, state, params)
        for path, ref in refs.items():
            want = ref.step(t, get(grads, path), get(params, path))
            np.testing.assert_allclose(get(updates, path), want, rtol=2e-4,
                                       atol=2e-6 * np.abs(want).max(),
                                       err_msg=f"{'/'.join(path)} step {t + 1}")
        params = jax.tree.map(lambda p, u: (p + np.asarray(u)).astype(np.float32), params,
                              updates)  # optax.apply_updates, on the host
    if head == "rownorm":  # the tracker sees the head's step: D <= 2·lr
        stats = rowgeom.read_row_diameter(state)
        assert float(stats.upper["lm_head/kernel"]) <= 2 * np_schedule(PEAKS["rownorm_head"])(2) * (
            1 + 1e-5)


def test_the_recipe_needs_no_special_case():
    """Every number of the recipe is a field of a public options object, and the plan the
    chains are written from prints it."""
    text = str(rowgeom.describe(model(), PEAKS["hidden"], groups={
        "head": rowgeom.GroupOptions(learning_rate=schedule(3.2e-3), weight_decay=0.0)}))
    assert "RowNorm, vocab axis 1  schedule  0" in text
    assert "Muon, in 0 out 1" in text
