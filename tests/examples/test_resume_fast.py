"""Exact resumption of the example trainer, fast enough for the fast subset (in-process, 4 steps).

An uninterrupted run of the tiny `test` config saves checkpoints at steps 2 and 4. What a run
killed after step 3 leaves on disk is then made from it: the checkpoint of step 4 is removed and
metrics.jsonl keeps the lines of steps 1-3 (step 3 was logged, its checkpoint never written) and
the start of step 4's (the machine stopped in the middle of writing it). The
same `train` call on that workdir must resume from checkpoint 2, train step 3 next, and end with
the uninterrupted run's metrics (every field but the wall-clock ones, bit for bit: losses, the
head-step probe and tracker stats of step 3) and its final train state, bit for bit.

The crash matrix (kills at every point of a save, SIGTERM, subprocess launches) stays in
test_crash_resume.py, marked slow.
"""

import shutil

import jax
import numpy as np
import pytest
from _lm_fixtures import SHORT_RUN, deterministic_records, short_run

from examples.lm import checkpointing, metrics, train

# `SHORT_RUN`: 4 steps, checkpoints and evaluations at 2 and 4, the head probe on the last two
# steps, so step 3 (the first step after the resume) records the head step's diameter and the
# tracker's bracket.
STEPS, SAVE_EVERY, RESUME_FROM = SHORT_RUN["steps"], SHORT_RUN["checkpoint__every"], 2
_cfg = short_run

pytestmark = pytest.mark.usefixtures("no_plot")  # conftest.py: no metrics.png at a run's end


@pytest.fixture(scope="module")
def root(lm_corpus, shared_trainers):
    # The resumed run reuses the clean run's compiled functions (a fresh process's: see
    # test_crash_resume.py), and those of the other modules' runs of `SHORT_RUN` in this
    # process (test_bad_input.py's).
    return lm_corpus


def _saved_steps(workdir):
    ckpt = checkpointing.Checkpointer(workdir / "checkpoints")
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


def test_resumed_run_trains_the_next_step_and_matches_the_uninterrupted_run(root, tmp_path,
                                                                            final_checkpoint):
    cfg, quiet = _cfg(root), lambda *args, **kwargs: None
    clean = tmp_path / "clean"
    train.train(cfg, clean, progress=False, print_fn=quiet)
    want = deterministic_records(clean)
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert sorted(_saved_steps(clean)) == [RESUME_FROM, STEPS]
    first_after = want[RESUME_FROM]  # step 3: its loss, the head probe and the tracker's stats
    assert {"train_loss", "head_step_diameter", "tracked_lower", "tracked_upper"} <= set(
        first_after)

    # A run killed after step 3: checkpoint 2 is the latest, step 3's metrics line was written,
    # and step 4's was cut short.
    killed = tmp_path / "killed"
    shutil.copytree(clean, killed)
    shutil.rmtree(killed / "checkpoints" / str(STEPS))
    lines = (killed / metrics.METRICS_FILE).read_text().splitlines(keepends=True)
    (killed / metrics.METRICS_FILE).write_text(
        "".join(lines[:RESUME_FROM + 1]) + lines[RESUME_FROM + 1][:25])
    assert _saved_steps(killed) == [RESUME_FROM]

    out = []
    train.train(cfg, killed, progress=False, print_fn=out.append)
    assert any(line.startswith(f"resumed from step {RESUME_FROM} ") for line in out), out
    got = deterministic_records(killed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for mine, theirs in zip(got, want, strict=True):
        assert mine == theirs, f"step {theirs['step']}"
    assert all(r["tokens_per_sec"] > 0 for r in metrics.read_metrics(killed))

    state, meta = final_checkpoint(killed, STEPS)
    clean_state, clean_meta = final_checkpoint(clean, STEPS)
    assert meta == clean_meta
    assert int(state["micro_step"]) == STEPS * cfg.optim.grad_accum_steps
    jax.tree.map(np.testing.assert_array_equal, state, clean_state)


def test_a_metrics_file_cut_short_loses_its_last_line_and_a_damaged_one_is_named(tmp_path):
    """Only the last line of metrics.jsonl can be cut short by a stop mid-write: it is left out
    (and rewritten away before the next append). An unreadable line before it is damage, an
    error naming the file and the line."""
    path = tmp_path / metrics.METRICS_FILE
    path.write_text('{"step": 1, "train_loss": 5.0}\n{"step": 2, "train_loss": 4.5}\n{"step": 3')
    assert metrics.read_metrics(tmp_path) == [{"step": 1, "train_loss": 5.0},
                                              {"step": 2, "train_loss": 4.5}]
    writer = metrics.MetricsWriter(tmp_path)
    writer.truncate_after(5)
    assert path.read_text() == '{"step": 1, "train_loss": 5.0}\n{"step": 2, "train_loss": 4.5}\n'
    path.write_text('{"step": 1}\n{"step": 2, "train\n{"step": 3}\n')
    for read in (lambda: metrics.read_metrics(tmp_path), lambda: writer.truncate_after(3)):
        with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2, is not a metrics record"):
            read()


def test_a_preempted_run_raises_preempted_after_its_checkpoint_and_the_same_call_finishes(
        root, tmp_path, monkeypatch):
    """Preemption (here the watcher saying so after step 3) saves that step and raises
    `Preempted`, exit status 0: a caller never takes the run for a finished one. The same
    call then resumes it and finishes."""
    cfg, out = _cfg(root), []
    workdir = tmp_path / "preempted"
    with monkeypatch.context() as patch:
        patch.setattr(train.PreemptionWatcher, "reached", lambda self, step: step == 3)
        with pytest.raises(train.Preempted) as stopped:
            train.train(cfg, workdir, progress=False, print_fn=out.append)
    assert (stopped.value.code, stopped.value.step) == (0, 3)
    assert any(line.startswith("preempted (SIGTERM): saved a checkpoint at step 3") for line in out)
    assert _saved_steps(workdir) == [RESUME_FROM, 3]
    assert [r["step"] for r in metrics.read_metrics(workdir)] == [1, 2, 3]
    train.train(cfg, workdir, progress=False, print_fn=lambda *a, **k: None)
    assert [r["step"] for r in metrics.read_metrics(workdir)] == list(range(1, STEPS + 1))
