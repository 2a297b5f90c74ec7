"""The example trainer's bad-input contract (examples/lm/README.md): a wrong option, a missing or
damaged file, or a step that does not fit prints one line, `train.py: error: ...`, and exits
with status 2; never a traceback, never a silent wrong run, and nothing the user wrote is
deleted without --overwrite.

One short run of the `test` config (`SHORT_RUN`: 4 steps, checkpoints at 2 and 4) is shared by
the module; each test damages a copy of it. The compile report's tests share one compile of
the step
(`over_budget_report`).
"""

import contextlib
import fcntl
import io
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import jax
import pytest
from _lm_fixtures import SHORT_RUN, config_on, short_run

from examples.lm import configs, metrics, train

STEPS = SHORT_RUN["steps"]


@pytest.fixture(scope="module")
def root(lm_corpus, shared_trainers):
    # A copy of `finished` resumed with its config reuses its compiled functions (and so do
    # the other modules' runs of `SHORT_RUN` in this process).
    return lm_corpus


def _flags(root):
    return ["--no-progress", "--data.source", str(root / "corpus"),
            f"--data.dir={root / 'tokens'}"]


@pytest.fixture(scope="module")
def finished(root, tmp_path_factory):
    """A finished run: checkpoints 2 and 4, metrics, TensorBoard events and the plot."""
    workdir = tmp_path_factory.mktemp("bad_input") / "finished"
    train.train(short_run(root), workdir, progress=False, print_fn=lambda *a, **k: None)
    return workdir


@pytest.fixture
def no_final_plot(monkeypatch):
    """No metrics.png at the end of a test's runs (matplotlib's half second a plot), in the
    tests that rerun a copy of `finished` and never look at its plot."""
    monkeypatch.setattr(metrics.MetricsWriter, "plot", lambda self: None)


def _copy(finished, tmp_path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    return workdir


def _fails(argv, capsys, message):
    """`train.main(argv)` exits 2 with one line containing `message`; return the line."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, (argv, err)
    assert err.startswith("train.py: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag, value, message", [
    ("--optim.learning_rate", "nan", "--optim.learning_rate must be a finite number"),
    ("--optim.learning_rate", "-0.01", "--optim.learning_rate must be >= 0"),
    ("--optim.head_learning_rate", "inf", "--optim.head_learning_rate must be a finite"),
    ("--optim.embedding_learning_rate", "-1", "--optim.embedding_learning_rate must be >= 0"),
    ("--optim.weight_decay", "-0.1", "--optim.weight_decay must be >= 0"),
    ("--optim.head_weight_decay", "nan", "--optim.head_weight_decay must be a finite"),
    ("--optim.grad_clip", "nan", "--optim.grad_clip must be a finite"),
    ("--optim.min_lr_ratio", "nan", "--optim.min_lr_ratio must be a finite"),
    ("--model.rope_theta", "0", "--model.rope_theta must be > 0"),
    ("--model.norm_eps", "-0.001", "--model.norm_eps must be >= 0"),
])
def test_config_values_are_checked(tmp_path, capsys, flag, value, message):
    _fails(["--config", "test", flag, value, "--workdir", str(tmp_path / "w")], capsys, message)
    assert not (tmp_path / "w").exists()


def test_every_named_config_is_valid():
    for name in configs.CONFIGS:
        configs.get_config(name).validate()


def test_workdir_that_is_a_file(root, tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    _fails(["--config", "test", "--workdir", str(path), *_flags(root)], capsys,
           "--workdir " + str(path) + " is a file, not a directory")
    assert path.read_text() == "not a directory"


def test_a_failed_run_leaves_no_empty_checkpoint_directory(tmp_path, capsys):
    _fails(["--config", "test", "--workdir", str(tmp_path / "w"), "--no-progress",
            "--data.source", str(tmp_path / "missing")], capsys, "does not exist")
    assert not (tmp_path / "w" / "checkpoints").exists()


def _array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


@pytest.mark.usefixtures("no_final_plot")
def test_damaged_checkpoints_fall_back_and_are_kept(root, finished, tmp_path, capsys):
    workdir = _copy(finished, tmp_path)
    ck = workdir / "checkpoints"
    with _array_file(ck / "4").open("r+b") as f:  # the newest: an array file truncated
        f.truncate(10)
    out = []
    train.train(short_run(root), workdir, progress=False, print_fn=out.append)
    warnings = [line for line in out if line.startswith("warning: checkpoint 4")]
    assert len(warnings) == 1 and "moved it aside" in warnings[0], out
    assert "resumed from step 2" in "\n".join(out)
    assert (ck / "4.damaged" / "state").is_dir()  # kept, for inspection
    assert sorted(p.name for p in ck.iterdir()) == ["2", "4", "4.damaged"]
    steps = [r["step"] for r in metrics.read_metrics(workdir)]
    assert steps == list(range(1, STEPS + 1)), steps  # no duplicate lines after the resume
    # The resumed run's event file purges the old run's points from step 3 on.
    events = sorted((workdir / "tensorboard").iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(events) == 2
    assert _session_start_step(events[-1]) == 3


def test_no_intact_checkpoint_left(root, finished, tmp_path, capsys):
    workdir = _copy(finished, tmp_path)
    ck = workdir / "checkpoints"
    with _array_file(ck / "4").open("r+b") as f:
        f.truncate(10)
    shutil.rmtree(ck / "2" / "state")  # the older one: its array folder deleted
    err = _fails(["--workdir", str(workdir), *_flags(root)], capsys,
                 f"no intact checkpoint in {ck}")
    assert "--overwrite" in err and "2.damaged" in err and "4.damaged" in err
    assert sorted(p.name for p in ck.iterdir()) == ["2.damaged", "4.damaged"]
    # A rerun does not start fresh silently either.
    _fails(["--workdir", str(workdir), *_flags(root)], capsys, "no intact checkpoint")


def test_a_resume_on_other_data_is_refused(root, finished, tmp_path, capsys):
    """Each checkpoint records the data it was trained on: a relaunch whose source now reads
    other data (a text source edited, and so tokenized anew) stops with one line and keeps
    everything, instead of training the model on ids that mean other text."""
    workdir = _copy(finished, tmp_path)
    for step in (2, 4):
        (meta_file,) = (p for p in (workdir / "checkpoints" / str(step) / "meta").rglob("*")
                        if p.is_file() and p.read_bytes().startswith(b"{"))
        meta = json.loads(meta_file.read_text())
        assert meta["data"].startswith("text, ") and "tokenizer sha256 " in meta["data"]
        meta["data"] = meta["data"].rsplit(" ", 1)[0] + " 0123456789abcdef"
        meta_file.write_text(json.dumps(meta))
    lines = metrics.read_metrics(workdir)
    _fails(["--workdir", str(workdir), *_flags(root)], capsys,
           f"checkpoint 4 in {workdir / 'checkpoints'} was trained on other data (text, ")
    assert metrics.read_metrics(workdir) == lines
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]


@pytest.mark.usefixtures("no_final_plot")
def test_a_second_run_in_a_workdir_in_use_is_refused(root, finished, tmp_path, capsys):
    """While a run holds its workdir's lock (another process, here another descriptor), a
    second launch there is one line and writes nothing: two runs would write every checkpoint
    and metric line twice. The lock goes with the descriptor (with its process, killed or not),
    and then the same command runs."""
    workdir = _copy(finished, tmp_path)
    lines = metrics.read_metrics(workdir)
    fd = os.open(workdir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _fails(["--workdir", str(workdir), *_flags(root)], capsys,
               f"another process is training in --workdir {workdir}")
        assert metrics.read_metrics(workdir) == lines
    finally:
        os.close(fd)
    out = []
    train.train(config_on(root, steps=STEPS), workdir, explicit=(),
                progress=False, print_fn=out.append)
    assert any("is finished" in line for line in out), out


@pytest.mark.usefixtures("no_final_plot")
def test_a_relaunch_finds_the_checkpoints_its_run_kept_elsewhere(root, finished, tmp_path,
                                                                 capsys):
    """A run that saves its checkpoints outside its workdir (--checkpoint.dir) records where:
    the relaunch without the flag resumes from them, and one naming a directory without
    checkpoints is one line and deletes nothing (it started fresh, and so cut metrics.jsonl
    to the new run's lines)."""
    workdir, elsewhere = _copy(finished, tmp_path), tmp_path / "elsewhere"
    shutil.move(workdir / "checkpoints", elsewhere)
    lines = metrics.read_metrics(workdir)
    for changes in ({"checkpoint__dir": str(elsewhere)}, {}):  # the flag, then without it
        out = []
        train.train(config_on(root, steps=STEPS, **changes), workdir, explicit=(),
                    progress=False, print_fn=out.append)
        assert any("is finished" in line for line in out), out
    assert out[0] == (f"checkpoints in {elsewhere} (the run's --checkpoint.dir, recorded in "
                      "checkpoint_dir.txt)")
    _fails(["--workdir", str(workdir), "--checkpoint.dir", str(tmp_path / "empty"),
            *_flags(root)], capsys,
           f"--checkpoint.dir {tmp_path / 'empty'} holds no checkpoint, but the run in "
           f"{workdir} saved its checkpoints in {elsewhere}")
    assert metrics.read_metrics(workdir) == lines
    assert sorted(p.name for p in elsewhere.iterdir()) == ["2", "4"]


@pytest.mark.usefixtures("no_final_plot")
def test_rerunning_a_finished_run_says_so(root, finished, tmp_path):
    workdir = _copy(finished, tmp_path)
    out = []
    train.train(config_on(root, steps=STEPS), workdir, explicit=(),
                progress=False, print_fn=out.append)
    text = "\n".join(out)
    assert f"is finished: {STEPS} of --steps {STEPS} done" in text, text
    assert "--steps N and --change_horizon" in text


def test_overwrite_clears_everything_the_run_wrote(root, finished, tmp_path):
    workdir = _copy(finished, tmp_path)
    old_events = set((workdir / "tensorboard").iterdir())
    out = []
    # Another seed: a setting a resume would refuse, which --overwrite takes (it starts anew).
    train.train(short_run(root, seed=1), workdir, overwrite=True,
                stop_after=1, progress=False, print_fn=out.append)
    assert not old_events & set((workdir / "tensorboard").iterdir())
    assert not (workdir / metrics.PLOT_FILE).exists()
    assert [r["step"] for r in metrics.read_metrics(workdir)] == [1]
    checkpoints = workdir / "checkpoints"  # none saved at step 1: no empty folder either
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert any("--overwrite: deleting metrics.jsonl, metrics.png, tensorboard/" in line
               for line in out), out


def test_a_step_that_does_not_fit_is_one_line(root, tmp_path, capsys, monkeypatch):
    def exhausted(self, state, step):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 74.51GiB.\nmore")

    monkeypatch.setattr(train._Loop, "step", exhausted)
    # `SHORT_RUN`'s flags: its Trainer (and its initial state's compiled program) is `finished`'s.
    short = [f"--{name.replace('__', '.')}={value}" for name, value in SHORT_RUN.items()]
    err = _fails(["--config", "test", "--workdir", str(tmp_path / "w"), *_flags(root), *short],
                 capsys, "the training step does not fit the device memory")
    for fix in ("--data.batch_size", "--model.remat", "--mesh.fsdp", "--model.max_seq_len"):
        assert fix in err
    assert not (tmp_path / "w" / "checkpoints").exists()


def _session_start_step(path: Path) -> int | None:
    """The step of the SessionLog START record (tensorboardX's purge_step) in an event file."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        if event.HasField("session_log") and event.session_log.status == 1:
            return event.step
    return None


# ------------------------------------------------------------------ the compile report


def test_train_compile_parses_its_device_memory(capsys):
    from examples.lm.tools import train_compile

    with pytest.raises(SystemExit) as exit_info:
        train_compile.main(["--config", "test", "--device-memory", "16XB"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("train_compile.py: error: --device-memory expects a size such as 16GiB")
    assert "a bare number is bytes" in err and err.count("\n") == 1, err


# The report of the `test` config on one device with 2 micro-batches per update: its step, compiled
# once for the module, serves both the command's report and `cheapest_fit`'s budget.
REPORT_ARGS = ["--config", "test", "--mesh.data", "1", "--optim.grad_accum_steps", "2"]


@pytest.fixture(scope="module")
def over_budget_report(tmp_path_factory):
    """`train_compile.py` run on REPORT_ARGS against 64 KiB, with `tempfile`'s directory an empty
    one: (exit status, what it printed, its figures (--json), what it left in that directory)."""
    from examples.lm.tools import train_compile

    base = tmp_path_factory.mktemp("report")
    temporary, figures = base / "tmp", base / "report.json"
    temporary.mkdir()
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(tempfile, "tempdir", str(temporary))
        status = train_compile.main([*REPORT_ARGS, "--device-memory", "64KiB", "--json",
                                     str(figures)])
    return status, out.getvalue(), json.loads(figures.read_text()), list(temporary.iterdir())


def test_train_compile_says_what_to_change_when_the_step_does_not_fit(over_budget_report):
    status, out, _, _ = over_budget_report
    assert status == 1
    assert "does NOT fit in 0.06 MiB per device (peak " in out, out
    assert "per micro-batch step, 2 micro-batches per update" in out, out
    assert "JAX preallocates 75% of its memory" in out, out
    assert ("changes to try, cheapest first (add --fit auto to compile them and take the first "
            "that fits): --model.remat dots --data.batch_size 8 --optim.grad_accum_steps 2;"
            ) in out, out


def test_train_compile_fitting_changes_put_fsdp_first():
    from examples.lm.tools import train_compile

    cfg = configs.override(configs.get_config("test"),
                           {"mesh.data": 2, "mesh.fsdp": 1, "data.batch_size": 8})
    changes = train_compile.fitting_changes(cfg, [None, None])
    assert changes[0][0] == "--mesh.data 1 --mesh.fsdp 2"
    assert [c.data.batch_size * c.optim.grad_accum_steps for _, c in changes] == [8] * len(
        changes)


def test_a_sequence_too_long_for_the_device_is_refused_up_front():
    cfg = configs.override(configs.get_config("cpu-tiny"), {"model.max_seq_len": 100_000})
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
    # 16 sequences x 4 heads x 100,000^2 float32 scores: 2,384 GiB for one layer.
    assert train.attention_bytes(cfg, mesh) == 16 * 4 * 100_000**2 * 4
    with pytest.raises(train.UsageError, match="attention scores alone take 2384.2 GiB"):
        train.check_fits(cfg, mesh, limit=80 * 2**30)
    train.check_fits(configs.get_config("cpu-tiny"), mesh, limit=80 * 2**30)


def test_train_compile_fit_auto_names_a_change_that_fits(over_budget_report, tmp_path, monkeypatch):
    from examples.lm.tools import train_compile

    cfg = configs.parse_config(REPORT_ARGS)
    devices = jax.devices()[:1]
    _, _, figures, left = over_budget_report
    assert figures["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    budget = figures["peak_bytes"] - 1
    # The compiler's dump (about 10 MB a step) goes with the report that made it.
    assert not left
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lines = []
    flags = train_compile.cheapest_fit(cfg, devices, budget, search=True, print_fn=lines.append)
    assert flags is not None and lines == [lines[-1]], lines
    assert lines[0].startswith(f"  the cheapest change that fits: {flags} (peak "), lines
    assert not list(tmp_path.iterdir())
