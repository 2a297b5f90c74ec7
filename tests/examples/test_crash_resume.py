"""Crash-safe resume: kill the example trainer at known points, resume, match a clean run.

The trainer's command line (tiny `test` config) runs in a subprocess through the wrapper
`_crash_trainer.py` next to this file, which stops it at a planned point of its run (`KILLS`):
SIGKILL while
restoring a checkpoint at start-up, after a training step, while an asynchronous orbax checkpoint
is being written (its directory exists, its finalization is held back) and when all its arrays are
written but orbax has not yet finalized it; and SIGTERM (what a preempted Cloud TPU VM or a
cluster scheduler sends) after a step, which must save a checkpoint at that step and exit with
status 0. The kills are placed by hooks inside the process, not at wall-clock moments, so every
launch does the same work on a fast or a loaded machine, and what is on disk after each kill is
known in advance. Each relaunch is the same command: a workdir with checkpoints is resumed by
default. The test checks that

- every relaunch resumes from the newest *finalized* checkpoint (told apart from a half-written
  one with orbax's public `orbax.checkpoint.path.step` helpers), never a half-written newer one,
  of which the writing / finalizing kills leave one each;
- a SIGTERM leaves a complete checkpoint of the step the run had reached, and the run exits 0;
- after the last relaunch finishes, `metrics.jsonl` is identical to an uninterrupted run's (bit for
  bit, apart from the wall-clock throughput keys) and the whole final train state (parameters,
  optimizer state, step, RNG key) is bit-identical.

All runs share one prebuilt token cache (no run retrains the tokenizer) and one persistent XLA
compilation cache, which the uninterrupted run fills first.
"""

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import _crash_trainer
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lm_fixtures import deterministic_records

from examples.lm import checkpointing, configs, data, metrics

REPO = Path(__file__).resolve().parents[2]
WRAPPER = Path(__file__).with_name("_crash_trainer.py")
STEPS, SAVE_EVERY, KEEP = 8, 2, 2
LAUNCH_TIMEOUT_S = 150  # one launch: start-up, restore, compiles (cached) and a few steps

# (kill point, its step, the checkpoint the launch restores, finalized checkpoints after it).
# Saves at every even step, the last two kept; see _crash_trainer.py for the points. One launch
# per situation (each launch is a Python + jax start-up): a kill while finalizing, after a step,
# while writing, while restoring, a SIGTERM after a step and one on a save step, and a kill while
# the final checkpoint is written.
KILLS = [
    ("finalizing", 2, None, []),     # the first checkpoint: all written, never finalized
    ("step", 3, None, [2]),          # fresh start again; checkpoint 2 completes
    ("writing", 4, 2, [2]),          # half-written 4
    ("restore", 2, 2, [2]),          # start-up, while restoring
    ("sigterm", 3, 2, [2, 3]),       # preempted after step 3 (no save step): saves 3
    ("sigterm", 6, 3, [4, 6]),       # on a save step: that save is the preemption checkpoint
    ("writing", 8, 6, [4, 6]),       # the final checkpoint, after the last metrics line
]


def trainer_args(root, workdir) -> list[str]:
    """The trainer's command line (without the program), the same for every launch."""
    return ["--config", "test", "--workdir", str(workdir), "--no-progress",
            "--data.source", str(root / "corpus"), f"--data.dir={root / 'tokens'}",
            "--steps", str(STEPS), "--checkpoint.every", str(SAVE_EVERY), "--eval.every", "4",
            "--checkpoint.keep", str(KEEP)]


@pytest.fixture(scope="module")
def root(lm_corpus):
    """The session's tokenized corpus (conftest's `lm_corpus`, read-only: runs write elsewhere)."""
    return lm_corpus


def _env(cache, kill=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", _crash_trainer.KILL_ENV)}
    env |= {"JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",  # the resume message must reach the log before a kill
            "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    if kill is not None:
        env[_crash_trainer.KILL_ENV] = kill
    return env


def _launch(root, workdir, cache, kill=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WRAPPER), *trainer_args(root, workdir)],
                          env=_env(cache, kill), cwd=REPO, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


def _finalized_steps(ckdir: Path) -> list[int]:
    """Checkpoints orbax has finalized (public API: orbax.checkpoint.path.step)."""
    from orbax.checkpoint.path import step as step_lib

    if not ckdir.is_dir():
        return []
    return sorted(step_lib.step_from_checkpoint_name(p.name)
                  for p in step_lib.checkpoint_steps_paths(ckdir))


def _tail(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n" \
           f"{proc.stderr[-3000:]}"


def _resume_line(restores, workdir) -> str:
    if restores is None:
        return "no checkpoint in"
    return f"resumed from step {restores} ({workdir / 'checkpoints'})"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 9 launches, each bounded by LAUNCH_TIMEOUT_S
def test_killed_and_resumed_run_is_bit_identical(root, tmp_path, final_checkpoint):
    cache, baseline = tmp_path / "xla_cache", tmp_path / "baseline"
    clean = _launch(root, baseline, cache)
    assert clean.returncode == 0, _tail(clean)

    workdir = tmp_path / "killed"
    ckdir = workdir / "checkpoints"
    half_written = []
    for i, (point, at, restores, finalized_after) in enumerate(KILLS):
        what = f"launch {i} ({point}:{at})"
        assert max(_finalized_steps(ckdir), default=None) == restores, what
        proc = _launch(root, workdir, cache, kill=f"{point}:{at}")
        if point == "sigterm":
            assert proc.returncode == 0, f"{what}: {_tail(proc)}"
            assert f"saved a checkpoint at step {at} in" in proc.stdout, f"{what}: {_tail(proc)}"
        else:
            assert proc.returncode == -signal.SIGKILL, f"{what} was not killed: {_tail(proc)}"
        if point != "restore":  # killed before the resume message
            assert _resume_line(restores, workdir) in proc.stdout, f"{what}: {_tail(proc)}"
        assert _finalized_steps(ckdir) == finalized_after, what
        unfinished = _crash_trainer.unfinalized_steps(ckdir)
        if point in ("writing", "finalizing"):
            # Half-written and newer than every finalized one: the next launch must skip it.
            assert at in unfinished and at > max(finalized_after, default=0), (what, unfinished)
            half_written.append(at)
    assert half_written == [2, 4, 8]

    final = _launch(root, workdir, cache)
    assert final.returncode == 0, _tail(final)
    assert _resume_line(KILLS[-1][2], workdir) in final.stdout, _tail(final)
    assert final.stdout.strip().splitlines()[-1] == clean.stdout.strip().splitlines()[-1]

    # Bit-identical metrics (full-precision floats; wall-clock throughput aside) and train state.
    assert deterministic_records(workdir) == deterministic_records(baseline)
    got = metrics.read_metrics(workdir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert all("tokens_per_sec" in r for r in got)
    (got, _), (expected, _) = (final_checkpoint(workdir, STEPS),
                                final_checkpoint(baseline, STEPS))
    paths_got = jax.tree_util.tree_flatten_with_path(got)[0]
    paths_exp = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert [p for p, _ in paths_got] == [p for p, _ in paths_exp]
    for (path, a), (_, b) in zip(paths_got, paths_exp, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert a.tobytes() == b.tobytes(), f"{jax.tree_util.keystr(path)} differs"


# --------------------------------------------------------------------------- safe loading


def _tiny_checkpoint(directory):
    ckpt = checkpointing.Checkpointer(directory)
    # Placed from the host (built with jnp, each op would compile a program of its own).
    state = jax.device_put({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                            "b": np.zeros(4, np.int32)})
    ckpt.save(1, state, {"step": 1, "config": {}})
    ckpt.close()
    return state


def _abstract(shapes):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {k: jax.ShapeDtypeStruct(s, d, sharding=device) for k, (s, d) in shapes.items()}


def test_checkpoints_are_validated_before_use(tmp_path):
    state = _tiny_checkpoint(tmp_path / "ck")
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    try:
        good = {"a": ((2, 3), jnp.float32), "b": ((4,), jnp.int32)}
        restored, meta = ckpt.restore(1, _abstract(good))
        np.testing.assert_array_equal(restored["a"], state["a"])
        assert meta == {"step": 1, "config": {}}
        # orbax alone would cast float32 -> int32 silently; the layout check refuses.
        for wrong, match in (({**good, "a": ((2, 3), jnp.int32)}, r"a: stored \(\(2, 3\), "
                                                                  r"'float32'\), expected"),
                             ({**good, "a": ((3, 3), jnp.float32)}, r"a: stored"),
                             ({"a": good["a"], "c": good["b"]}, r"c: missing.*b: not in")):
            with pytest.raises(ValueError, match="does not match the train state.*" + match):
                ckpt.restore(1, _abstract(wrong))
    finally:
        ckpt.close()


# A failed orbax restore leaves read coroutines behind that are finalised after its event loop
# closed ("Event loop is closed", printed and otherwise harmless); collect them here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncated arrays", "garbage metadata", "foreign metadata",
                                    "missing manifest"])
def test_damaged_checkpoints_give_a_clear_error(tmp_path, damage):
    _tiny_checkpoint(tmp_path / "ck")
    step_dir = tmp_path / "ck" / "1"
    if damage == "truncated arrays":
        for f in (step_dir / "state" / "d").iterdir():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "garbage metadata":
        (step_dir / "meta" / "metadata").write_text("{not json")
    elif damage == "foreign metadata":
        (step_dir / "meta" / "metadata").write_text('{"hello": 1}')
    else:
        (step_dir / "state" / "manifest.ocdbt").unlink()
    ckpt = checkpointing.Checkpointer(tmp_path / "ck")
    try:
        abstract = _abstract({"a": ((2, 3), jnp.float32), "b": ((4,), jnp.int32)})
        if damage == "foreign metadata":  # valid JSON, but not the trainer's
            cfg = configs.get_config("test")
            with pytest.raises(ValueError, match="not written by this trainer"):
                configs.resolve_config(cfg, ckpt.restore_meta(1))
        elif damage == "garbage metadata":
            with pytest.raises(ValueError, match=r"checkpoint 1 in .*ck cannot be read"):
                ckpt.restore_meta(1)
        else:
            with pytest.raises(ValueError, match=r"checkpoint 1 in .*ck cannot be read"):
                ckpt.restore(1, abstract)
    finally:
        ckpt.close()
    gc.collect()


def test_token_cache_with_a_foreign_tokenizer_is_rebuilt(root, tmp_path, caplog):
    work = tmp_path / "w"
    vocab = configs.get_config("test").model.vocab_size
    first = np.array(data.prepare_tokens(source=root / "corpus", workdir=work, vocab_size=vocab)
                     .train)
    (cache,) = (work / "tokens").iterdir()
    for garbage in ('{"version": "1.0", "model": {"type": "Unigram"}}', "\x00\x01 not json"):
        (cache / "tokenizer.json").write_text(garbage)
        rebuilt = data.prepare_tokens(source=root / "corpus", workdir=work, vocab_size=vocab)
        assert "unusable" in caplog.text
        np.testing.assert_array_equal(rebuilt.train, first)
        caplog.clear()


def test_a_token_cache_that_fails_to_build_leaves_nothing(root, tmp_path, monkeypatch):
    """Tokenizing fails part-way (a full disk): the error reaches the caller, and no partial
    copy of the corpus stays in the work directory."""
    from examples.lm.tools import prepare

    real = prepare.write_shards

    def full_disk(files, out, **kwargs):
        real(files, out, **kwargs)  # every shard written, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare, "write_shards", full_disk)
    work = tmp_path / "w"
    with pytest.raises(OSError, match="No space left"):
        data.prepare_tokens(source=root / "corpus", workdir=work,
                            vocab_size=configs.get_config("test").model.vocab_size)
    assert list((work / "tokens").iterdir()) == []


def test_a_relaunch_removes_the_token_cache_builds_a_killed_run_left(root, tmp_path):
    """A run killed while tokenizing leaves its build directory (a partial copy of the corpus);
    the relaunch removes it, and keeps a live process's, one whose lock is held (its process
    lives in another PID namespace) and another host's."""
    import fcntl
    import socket

    work = tmp_path / "w"
    vocab = configs.get_config("test").model.vocab_size
    first = np.array(data.prepare_tokens(source=root / "corpus", workdir=work,
                                         vocab_size=vocab).train)
    (cache,) = (work / "tokens").iterdir()
    shutil.rmtree(cache)
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait()  # its pid names no live process now
    host = socket.gethostname()
    builds = {"dead": f".{cache.name}.{host}.{finished.pid}.x1",
              "live": f".{cache.name}.{host}.{os.getppid()}.x2",
              "locked": f".{cache.name}.{host}.{finished.pid}.x3",
              "elsewhere": f".{cache.name}.other-host.{finished.pid}.x4"}
    for name in builds.values():
        (work / "tokens" / name).mkdir()
        (work / "tokens" / name / "train_000000.bin").write_bytes(b"partial")
    held = os.open(work / "tokens" / builds["locked"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        again = data.prepare_tokens(source=root / "corpus", workdir=work, vocab_size=vocab)
    finally:
        os.close(held)
    np.testing.assert_array_equal(np.asarray(again.train), first)
    assert sorted(p.name for p in (work / "tokens").iterdir()) == sorted(
        [cache.name, builds["live"], builds["locked"], builds["elsewhere"]])


def test_loading_code_never_unpickles_or_evaluates():
    """Token shards, tokenizer files and checkpoints are raw arrays and JSON only."""
    banned = re.compile(r"\bpickle\b|\bcloudpickle\b|\bdill\b|\beval\(|\bexec\(|"
                        r"allow_pickle\s*=\s*True|yaml\.load\(|torch\.load\(|\bmarshal\b")
    sources = sorted((REPO / "rowgeom").glob("*.py")) + sorted((REPO / "examples").rglob("*.py"))
    assert len(sources) > 15
    for path in sources:
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        hits = banned.findall(code)
        assert not hits, f"{path.relative_to(REPO)}: {hits}"
