"""The example trainer's loop, fast: gradient accumulation, the last evaluation, the head probe.

- `--optim.grad_accum_steps 2` on micro-batches of 4 sequences trains as one batch of 8 does,
  to float32 rounding (the Trainer against a Trainer without accumulation: `SHORT_RUN`'s, the
  same schedule), and leaves the parameters alone between micro-batches;
- the loop feeds micro-batch `(step - 1) * accum + k` to the `k`-th micro-step of optimizer step
  `step`: each micro-batch once, in order (read off the loop's own calls);
- a run resumed from the checkpoint of optimizer step 2 (micro step 4) trains step 3 next, on
  micro-batches 4 and 5 (then step 4 on 6 and 7), and ends with the uninterrupted run's metrics
  and train state, bit for bit (the step is `micro_step / accum`, not `micro_step`);
- `steps` = 4 with `eval.every` = 3: steps 3 and 4 are evaluated (the last step always is);
- the head probe's "step without decay" is `new - old + lr wd old` (its diameter against float64
  numpy), and within projected RowNorm's radius in the loop's evaluations.

The runs use the `test` model on `lm_corpus`'s token cache; every Trainer of one config is
built (and compiled) once for the session (`shared_trainers`).
"""

from __future__ import annotations

import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lm_fixtures import SHORT_RUN, deterministic_records, restore_on_one_device, short_run

from examples.lm import checkpointing, configs, data, metrics, optimizer, train
from examples.lm import sharding as mesh_lib

STEPS, SAVE_EVERY, EVAL_EVERY, ACCUM, MICRO_BATCH = 4, 2, 3, 2, 4

pytestmark = pytest.mark.usefixtures("no_plot")


@pytest.fixture(scope="module")
def root(lm_corpus, shared_trainers):
    return lm_corpus


def _cfg(root):
    """`SHORT_RUN` in micro-batches: checkpoints at 2 and 4, evaluations at 3 and (the last step)
    4, the probe's last two steps both evaluated (no probe-only steps). With probe steps the
    tracker measures every update whatever `eval.every`, so the optimizer is `SHORT_RUN`'s."""
    assert (SHORT_RUN["steps"], SHORT_RUN["checkpoint__every"]) == (STEPS, SAVE_EVERY)
    assert SHORT_RUN["eval__probe_last_steps"] == STEPS - EVAL_EVERY + 1
    return short_run(root, eval__every=EVAL_EVERY, optim__grad_accum_steps=ACCUM,
                     data__batch_size=MICRO_BATCH)


@pytest.fixture(scope="module")
def micro_batches():
    """The indices the loop asks of the training sampler, in order (reset per run)."""
    calls: list[int] = []
    real = train._Batches.get

    def get(self, index):
        if isinstance(self.source, data.BatchSampler) and self.source.seed != train.PROBE_SEED:
            calls.append(index)
        return real(self, index)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train._Batches, "get", get)
        yield calls


def _run(cfg, workdir, calls):
    calls.clear()
    out: list[str] = []
    train.train(cfg, workdir, progress=False, print_fn=out.append)
    return list(calls), out


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return tmp_path_factory.mktemp("lm_loop")


@pytest.fixture(scope="module")
def clean(root, workdirs, micro_batches):
    """An uninterrupted run: (workdir, training indices asked for, printed lines)."""
    workdir = workdirs / "clean"
    calls, out = _run(_cfg(root), workdir, micro_batches)
    return workdir, calls, out


def test_each_micro_batch_is_used_once_in_order(clean):
    _, calls, _ = clean
    assert calls == list(range(STEPS * ACCUM))


def test_the_last_step_is_evaluated(clean):
    workdir, _, out = clean
    records = metrics.read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if "val_loss" in r] == [EVAL_EVERY, STEPS]
    assert out[-1] == train.summary_line(records[-1])
    assert out[-1].startswith(f"final step {STEPS}:")


def test_head_step_of_the_loop_is_within_the_rownorm_radius(clean):
    """Projected RowNorm moves every token row by the head rate about a common centre: the step
    without decay has diameter <= 2 lr, and the full change (with decay) differs from it."""
    for r in metrics.read_metrics(clean[0]):
        if "val_loss" in r:
            assert 0 < r["head_step_diameter"] <= 2 * r["head_learning_rate"] * (1 + 1e-5)
            assert r["head_diameter"] != r["head_step_diameter"]


def test_resumed_run_continues_at_the_optimizer_step(root, workdirs, clean, micro_batches):
    """Killed in step 3, after the checkpoint of step 2: resumed from it (micro step 4), it
    trains step 3 on micro-batches 4 and 5 (and step 4 on 6 and 7) and ends where the
    uninterrupted run did."""
    cfg, (clean_dir, _, _) = _cfg(root), clean
    killed = workdirs / "killed"
    shutil.copytree(clean_dir, killed)
    shutil.rmtree(killed / "checkpoints" / str(STEPS))
    lines = (killed / metrics.METRICS_FILE).read_text().splitlines(keepends=True)
    (killed / metrics.METRICS_FILE).write_text("".join(lines[:SAVE_EVERY]))
    ckpt = checkpointing.Checkpointer(killed / "checkpoints")
    try:
        assert ckpt.latest_step() == SAVE_EVERY
    finally:
        ckpt.close()

    calls, out = _run(cfg, killed, micro_batches)
    assert any(line.startswith(f"resumed from step {SAVE_EVERY} ") for line in out), out
    assert calls == list(range(SAVE_EVERY * ACCUM, STEPS * ACCUM))
    assert deterministic_records(killed) == deterministic_records(clean_dir)
    state, meta = restore_on_one_device(killed / "checkpoints", STEPS)
    want, want_meta = restore_on_one_device(clean_dir / "checkpoints", STEPS)
    assert meta == want_meta and meta["step"] == STEPS
    assert int(state["micro_step"]) == STEPS * ACCUM
    jax.tree.map(np.testing.assert_array_equal, state, want)


def test_a_sigterm_while_the_last_checkpoint_is_written_does_not_kill_it(root, workdirs, clean,
                                                                         micro_batches,
                                                                         monkeypatch):
    """The preemption handler stays until the run's last save is written: a SIGTERM then is a
    notice the finished run needs no more (it ends normally, its last checkpoint complete), not
    the default action, which would kill the process with the checkpoint half-written."""
    default = []  # the handler in place before the run: what the signal meets after it
    previous = signal.signal(signal.SIGTERM, lambda *a: default.append(a[0]))
    real = train._close

    def close(ckpt):
        os.kill(os.getpid(), signal.SIGTERM)
        real(ckpt)

    monkeypatch.setattr(train, "_close", close)
    workdir = workdirs / "sigterm_at_close"
    try:
        _run(_cfg(root), workdir, micro_batches)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert default == []
    ckpt = checkpointing.Checkpointer(workdir / "checkpoints")
    try:
        assert ckpt.latest_step() == STEPS
    finally:
        ckpt.close()
    assert deterministic_records(workdir) == deterministic_records(clean[0])


def _one_device():
    return mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _tokens(rng, cfg, batch, sharding):
    """Random (inputs, targets) placed as the loop places a batch (its compiled step's input)."""
    shape = (batch, cfg.seq_len)
    return tuple(jax.device_put(rng.integers(0, cfg.model.num_tokens, shape).astype(np.int32),
                                sharding) for _ in range(2))


def test_accumulation_trains_like_the_larger_batch(root, shared_trainers, clean):
    """Two optimizer steps: two micro-batches of 4 accumulated, against their 8 sequences as one
    batch without accumulation (`SHORT_RUN`: the same model, seed, schedule and tracker); between
    the micro-batches of a step the parameters do not move."""
    cfg, mesh = _cfg(root), _one_device()
    one = shared_trainers(cfg, mesh)
    big_cfg = short_run(root)
    assert big_cfg.data.batch_size == ACCUM * MICRO_BATCH and big_cfg.optim.grad_accum_steps == 1
    # The configs differ in the accumulation and the evaluations' cadence alone, which (with
    # probe steps) leaves the tracker measuring every update in both.
    mine, theirs = configs.flatten(cfg), configs.flatten(big_cfg)
    assert {k for k in mine if mine[k] != theirs[k]} == {
        "optim.grad_accum_steps", "data.batch_size", "eval.every"}
    assert optimizer.track_every_k_steps(cfg) == optimizer.track_every_k_steps(big_cfg) == 1
    big = shared_trainers(big_cfg, mesh)
    rng, placed = np.random.default_rng(0), mesh_lib.batch_sharding(mesh)
    with jax.set_mesh(mesh):  # as the loop runs them: its compiled functions
        state, ref = one.init(), big.init()
        jax.tree.map(np.testing.assert_array_equal, state["params"], ref["params"])
        for _ in range(2):
            micro = [_tokens(rng, cfg, MICRO_BATCH, placed) for _ in range(ACCUM)]
            before = jax.device_get(state["params"])
            state, first = one.train_step(state, *micro[0], one.rates)
            jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), before)
            state, second = one.train_step(state, *micro[1], one.rates)
            batch = (np.concatenate([np.asarray(x) for x in parts])
                     for parts in zip(*micro, strict=True))
            ref, loss = big.train_step(ref, *(jax.device_put(x, placed) for x in batch),
                                       big.rates)
            np.testing.assert_allclose((float(first) + float(second)) / 2, float(loss),
                                       rtol=1e-6)
            after = jax.device_get(state["params"])
            moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), after, before)
            assert min(jax.tree.leaves(moved)) > 0  # every parameter moved at the step's end
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                         after, jax.device_get(ref["params"]))
    assert int(state["micro_step"]) == 2 * ACCUM and int(ref["micro_step"]) == 2


def _np_diameter(matrix, vocab_axis):
    rows = np.moveaxis(np.asarray(matrix, np.float64), vocab_axis, 0)
    sq = np.sum(rows * rows, axis=1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * rows @ rows.T
    return float(np.sqrt(max(float(d2.max()), 0.0)))


def test_head_probe_step_without_decay_adds_the_decay_back(root, shared_trainers, clean):
    """The probe of one real (accumulated) update, against float64 numpy: the diameter of the
    full change `new - old` and of the step `new - old + lr wd old`, with a rate and decay large
    enough that `new - old - lr wd old` would be far off."""
    cfg, mesh = _cfg(root), _one_device()
    trainer = shared_trainers(cfg, mesh)
    rng, lr, wd = np.random.default_rng(1), 0.5, 0.4
    with jax.set_mesh(mesh):  # as the loop runs them: its compiled functions
        state = trainer.init()
        old = trainer.head_of(state["params"], state["rest"])
        for _ in range(ACCUM):
            placed = mesh_lib.batch_sharding(mesh)
            state, _ = trainer.train_step(state, *_tokens(rng, cfg, MICRO_BATCH, placed),
                                          trainer.rates)
        new = trainer.head_of(state["params"], state["rest"])
        inputs = _tokens(rng, cfg, cfg.eval.hilbert_sequences, mesh_lib.replicated(mesh))[0]
        # Typed as the loop passes them: the schedule's weak float32, the decay a float32.
        probe = jax.device_get(trainer.head_probe(state["params"], state["rest"], old, inputs,
                                                  jnp.asarray(lr), jnp.float32(wd)))
    old, new = np.asarray(old, np.float64), np.asarray(new, np.float64)
    vocab_axis = new.shape.index(cfg.model.num_tokens)  # (d, V): 1
    assert trainer.exact_diameter and new.shape[1 - vocab_axis] == cfg.model.d_model
    change, step = new - old, new - old + lr * wd * old
    np.testing.assert_allclose(probe["head_diameter"], _np_diameter(change, vocab_axis),
                               rtol=1e-5)
    np.testing.assert_allclose(probe["head_step_diameter"], _np_diameter(step, vocab_axis),
                               rtol=1e-5)
    # The sign matters: with the decay subtracted the diameter is another number.
    wrong = _np_diameter(new - old - lr * wd * old, vocab_axis)
    assert abs(wrong - probe["head_step_diameter"]) > 1e-2 * wrong


def test_the_groups_rates_are_the_steps_argument(root, shared_trainers, clean):
    """Configs that differ only in their groups' rates and decays lower to one train step (a
    rate sweep compiles it once), and the step reads each group's rate from its argument: with
    the head's rate doubled, the head's update doubles and every other parameter's is the same,
    bit for bit."""
    cfg, mesh = short_run(root), _one_device()
    trainer = shared_trainers(cfg, mesh)
    swept = configs.override(cfg, {"optim.learning_rate": 0.031, "optim.weight_decay": 0.2,
                                   "optim.head_learning_rate": 0.7,
                                   "optim.embedding_learning_rate": 0.011})
    other = train.Trainer(swept, mesh)
    rng, placed = np.random.default_rng(2), mesh_lib.batch_sharding(mesh)
    batch = _tokens(rng, cfg, cfg.data.batch_size, placed)
    lowered = [t.train_step.lower(t.abstract_state, *batch, t.abstract_rates).as_text()
               for t in (trainer, other)]
    assert lowered[0] == lowered[1]
    assert jax.device_get(other.rates) != jax.device_get(trainer.rates)
    head = trainer.rates["head"]
    doubled = {**trainer.rates, "head": {**head, "learning_rate": 2 * head["learning_rate"]}}
    with jax.set_mesh(mesh):
        before = jax.device_get(trainer.init()["params"])
        after = [jax.device_get(trainer.train_step(trainer.init(), *batch, rates)[0]["params"])
                 for rates in (trainer.rates, doubled)]
    flat = [dict(jax.tree_util.tree_leaves_with_path(p)) for p in (before, *after)]
    for path, old in flat[0].items():
        once, twice = flat[1][path] - old, flat[2][path] - old
        if "lm_head" in jax.tree_util.keystr(path):
            np.testing.assert_allclose(twice, 2 * once, rtol=1e-4, atol=1e-7)
            assert np.abs(once).max() > 0
        else:
            np.testing.assert_array_equal(flat[2][path], flat[1][path])
