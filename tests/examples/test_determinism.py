"""Determinism on CPU: the same seed and config give bit-identical loss trajectories.

Two fresh runs of the example trainer (`SHORT_RUN`; one Trainer, `shared_trainers`: the same
compiled functions, each run from its own fresh state) write `metrics.jsonl` files whose
deterministic fields (every float in full precision; not the wall-clock throughput keys) are
identical, and a different seed changes them, so the comparison can fail. The optimizers
alone are checked the same way on a small softmax-regression problem for every head geometry.
(Across processes and interruptions, see test_crash_resume.py.)
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _lm_fixtures import deterministic_records, short_run

import rowgeom
from examples.lm import train


def _run(root, workdir, **changes):
    train.train(short_run(root, **changes), workdir, progress=False, print_fn=lambda *a: None)
    # Everything but the wall-clock throughput, as the bytes json writes.
    return "".join(json.dumps(r) + "\n" for r in deterministic_records(workdir)).encode()


@pytest.mark.slow
def test_same_seed_same_trajectory(lm_corpus, shared_trainers, tmp_path):
    first, second = _run(lm_corpus, tmp_path / "a"), _run(lm_corpus, tmp_path / "b")
    assert first == second
    other = _run(lm_corpus, tmp_path / "seed1", seed=1)
    losses = lambda raw: [json.loads(line)["train_loss"] for line in raw.splitlines()]
    assert len(losses(first)) == 4 and losses(other) != losses(first)


def _problem(seed=0):
    # Built in numpy and placed on the device as they are (no operation compiled for them).
    rng = np.random.default_rng(seed)
    params = jax.device_put({
        "embed": {"embedding": rng.standard_normal((32, 8)).astype(np.float32)},
        "layers": {"0": {"mlp": {"kernel": (rng.standard_normal((8, 8)) / 3).astype(np.float32)}}},
        "final_norm": {"scale": np.ones(8, np.float32)},
        "lm_head": {"kernel": (rng.standard_normal((8, 32)) / 3).astype(np.float32)}})
    tokens = rng.integers(0, 32, (64,)).astype(np.int32)
    targets = rng.integers(0, 32, (64,)).astype(np.int32)

    def loss(p):
        h = jnp.tanh(p["embed"]["embedding"][tokens] @ p["layers"]["0"]["mlp"]["kernel"])
        logits = (h * p["final_norm"]["scale"][None, :]) @ p["lm_head"]["kernel"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return params, loss


@pytest.mark.parametrize("head", ["rownorm", "adamw", "muon"])
def test_optimizer_trajectories_are_bit_identical(head):
    def trajectory():
        params, loss = _problem()
        tx = rowgeom.lm_optimizer(3e-2, head=head)  # a fresh optimizer and a fresh jit

        @jax.jit
        def step(p, s):
            value, grads = jax.value_and_grad(loss)(p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        state, values = tx.init(params), []
        for _ in range(6):
            params, state, value = step(params, state)
            values.append(np.asarray(value))
        return np.stack(values), params

    (values_a, params_a), (values_b, params_b) = trajectory(), trajectory()
    assert values_a.tobytes() == values_b.tobytes()
    assert values_a[-1] < values_a[0]  # it trains
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
