"""End-to-end tests of the example LM trainer (examples/lm/train.py) on the tiny `test` config.

The corpus is a copy of a few small standard-library files, so the BPE trains in well under a
second.
"""

import contextlib
import io
import json
import math
import os
import shutil
import types
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _lm_fixtures import (
    config_on,
    deterministic_records,
    make_tokenizer,
    restore_on_one_device,
    write_llmc_shard,
)

from examples.lm import checkpointing, configs, metrics, optimizer, train
from examples.lm import sharding as mesh_lib

STEPS = 8  # the `test` config: eval at 4 and 8, checkpoints at 3 and 6 below, and the final one


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, small_corpus, shared_trainers):
    """~30 small stdlib modules as a text-directory corpus, and a shared tokenizer cache dir."""
    return small_corpus(tmp_path_factory.mktemp("lm"))


def _cfg(corpus, **changes):
    """The test config on the corpus, saving every 3 steps."""
    return config_on(corpus, checkpoint__every=3, **changes)


def _lines(workdir):
    return (Path(workdir) / metrics.METRICS_FILE).read_text().splitlines()


@pytest.fixture(scope="module")
def baseline(corpus):
    """An uninterrupted run through the command line: (workdir, stdout)."""
    workdir = corpus / "baseline"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main([
            "--config", "test", "--workdir", str(workdir), "--no-progress",
            "--data.source", str(corpus / "corpus"), f"--data.dir={corpus / 'tokens'}",
            "--checkpoint.every", "3"])
    return workdir, out.getvalue()


@pytest.fixture(scope="module")
def interrupted(corpus):
    """A run on an empty workdir starts fresh; it is 'killed' after step 5."""
    workdir = corpus / "interrupted"
    out = []
    train.train(_cfg(corpus), workdir, stop_after=5, progress=False, print_fn=out.append)
    return workdir, out


def test_cli_overrides_parse():
    cfg = configs.parse_config(["--config", "test", "--model.d_model", "48",
                                "--model.num_layers=3", "--optim.grad_clip", "none",
                                "--model.tied_embeddings", "true", "--head", "adamw",
                                "--checkpoint.every", "7"])
    m = cfg.model
    assert (m.d_model, m.num_layers, cfg.optim.grad_clip, m.tied_embeddings) == (48, 3, None, True)
    assert (cfg.head, cfg.checkpoint.every) == ("adamw", 7)
    assert m.vocab_size == configs.get_config("test").model.vocab_size  # untouched fields kept
    assert configs.parse_config([]) == configs.get_config(configs.DEFAULT_CONFIG)
    for argv, match in ((["--model.d_model", "abc"], "^--model.d_model expects int"),
                        (["--model.nope", "1"], "^unrecognized arguments: --model.nope 1$"),
                        (["--d_model", "48"], "^unrecognized arguments: --d_model 48$"),
                        (["--head", "sgd"], "^--head must be one of"),
                        (["--model.d_model", "30", "--model.num_heads", "4"],
                         "divisible by --model.num_heads")):
        with pytest.raises(ValueError, match=match):
            configs.parse_config(argv)


def test_mesh_helpers():
    assert mesh_lib.mesh_shape(-1, 2, 2, 8) == (2, 2, 2)
    assert mesh_lib.mesh_shape(1, -1, 1, 8) == (1, 8, 1)
    for sizes, match in (((3, 2, 1), r"--mesh.tensor = \(3, 2, 1\) need 6 devices"),
                         ((-1, -1, 1), "at most one of --mesh.data/--mesh.fsdp/--mesh.tensor"),
                         ((-1, 3, 1), "not divisible by 3"), ((0, 8, 1), "positive or -1")):
        with pytest.raises(ValueError, match=match):
            mesh_lib.mesh_shape(*sizes, 8)
    fake = types.SimpleNamespace(shape={"data": 2, "fsdp": 4, "tensor": 2})
    P = jax.sharding.PartitionSpec
    # An axis that does not divide its dimension is dropped (that dimension is replicated).
    assert mesh_lib.fit_spec((6, 8), P("fsdp", "tensor"), fake) == P(None, "tensor")
    fitted = mesh_lib.fit_spec((16, 3), P(("data", "fsdp"), "tensor"), fake)
    assert fitted == P(("data", "fsdp"), None)
    assert mesh_lib.fit_spec((4, 4), P(("fsdp", "data")), fake) == P("fsdp", None)
    assert mesh_lib.fit_spec((5,), P(None), fake) == P(None)


def test_schedules_end_at_min_lr():
    for name in configs.CHOICES["optim.schedule"]:
        cfg = configs.override(configs.get_config("test"), {
            "optim.schedule": name, "steps": 20, "optim.warmup_steps": 4,
            "optim.min_lr_ratio": 0.1})
        lr = [float(optimizer.lr_schedule(1.0, cfg)(t)) for t in range(cfg.steps)]
        np.testing.assert_allclose(lr[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
        np.testing.assert_allclose(lr[-1], 0.1, rtol=1e-6)
        assert all(a >= b - 1e-7 for a, b in zip(lr[3:], lr[4:], strict=False))  # no increase


@pytest.mark.slow
def test_training_smoke(baseline):
    workdir, stdout = baseline
    records = [json.loads(line) for line in _lines(workdir)]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["train_loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    for r in records:
        assert all(math.isfinite(v) for v in r.values()), r
    for r in evals:
        lr = r["head_learning_rate"]
        # Projected RowNorm moves each token row by lr about a common centre: D(step) <= 2 lr. This
        # also checks the step is told apart from the weight-decayed change (which exceeds it).
        assert 0 < r["head_step_diameter"] <= 2 * lr * (1 + 1e-5)
        assert r["head_diameter"] != r["head_step_diameter"]
        # rowgeom.track_row_diameter's O(Vd) bracket of the full change holds the exact value.
        assert r["tracked_lower"] <= r["head_diameter"] * (1 + 1e-5)
        assert r["head_diameter"] <= r["tracked_upper"] * (1 + 1e-5)
        np.testing.assert_allclose(r["tracked_upper"], r["head_diameter_upper"], rtol=1e-5)
        for prefix in ("hilbert", "head_step_hilbert"):
            assert 0 < r[f"{prefix}_rms"] <= r[f"{prefix}_max"]
            assert r[f"{prefix}_tightness"] <= 1 + 1e-5  # Lemma 1: delta_n <= ||h_n|| D
    assert (workdir / metrics.PLOT_FILE).stat().st_size > 1000
    assert list((workdir / metrics.TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert checkpointing.Checkpointer(workdir / "checkpoints").latest_step() == STEPS
    last = stdout.strip().splitlines()[-1]
    assert last == train.summary_line(evals[-1]) and last.startswith(f"final step {STEPS}:")


def test_plot_tool_plots_a_workdir(tmp_path, capsys):
    from examples.lm.tools import plot

    (tmp_path / metrics.METRICS_FILE).write_text(
        '{"step": 1, "train_loss": 3.0}\n{"step": 2, "train_loss": 2.5, "val_loss": 2.7}\n')
    assert plot.main([str(tmp_path)]).name == metrics.PLOT_FILE
    assert (tmp_path / metrics.PLOT_FILE).stat().st_size > 1000
    with pytest.raises(SystemExit) as exited:
        plot.main([str(tmp_path / "missing")])
    assert exited.value.code == 2
    assert "no records in" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_full_precision_floats(baseline):
    """Every float in metrics.jsonl round-trips exactly (repr), e.g. the fp32 losses."""
    for line in _lines(baseline[0]):
        record = json.loads(line)
        assert json.dumps(record) == line
        assert all(float(np.float32(v)) == v for k, v in record.items() if k.endswith("loss"))


@pytest.mark.slow
def test_resume_is_bit_identical(baseline, corpus, interrupted):
    workdir, out = interrupted
    assert any("starting fresh" in line for line in out)
    assert len(_lines(workdir)) == 5  # steps 4 and 5 were logged after the checkpoint at 3
    # A save killed midway leaves a temporary directory: it must be ignored.
    ckdir = workdir / "checkpoints"
    shutil.copytree(ckdir / "3", ckdir / "5.orbax-checkpoint-tmp-1234")
    assert checkpointing.Checkpointer(ckdir).latest_step() == 3
    resumed = corpus / "resumed"
    shutil.copytree(workdir, resumed)
    out = []
    train.train(_cfg(corpus), resumed, progress=False, print_fn=out.append)
    assert any("resumed from step 3" in line for line in out)
    assert deterministic_records(resumed) == deterministic_records(baseline[0])
    assert all(r["tokens_per_sec"] > 0 and r["sec_per_step"] > 0
               for r in metrics.read_metrics(resumed))


@pytest.mark.slow
def test_resume_follows_the_saved_schedule(baseline, corpus, interrupted):
    """Options the command line does not set come from the checkpoint: a resumed run with
    another default horizon and learning rate follows the saved ones exactly."""
    resumed = corpus / "resumed_saved_schedule"
    shutil.copytree(interrupted[0], resumed)
    other = _cfg(corpus, steps=40, optim__learning_rate=1.0, optim__warmup_steps=7)
    train.train(other, resumed, explicit=frozenset(), progress=False, print_fn=lambda *a: None)
    assert deterministic_records(resumed) == deterministic_records(baseline[0])


@pytest.mark.slow
def test_changing_the_horizon_is_explicit(baseline, corpus, interrupted):
    quiet = lambda *a: None
    # A finished run rerun with the same options: nothing to do, the final evaluation reported.
    out = []
    train.train(_cfg(corpus), baseline[0], progress=False, print_fn=out.append)
    assert out[-1] == train.summary_line(metrics.read_metrics(baseline[0])[-1])
    with pytest.raises(ValueError, match=r"cannot resume.*--model.d_model saved 32, now 64"):
        train.train(_cfg(corpus, model__d_model=64), baseline[0], progress=False,
                    print_fn=quiet)
    with pytest.raises(ValueError, match=r"--steps saved 8, now 12.*--change_horizon"):
        train.train(_cfg(corpus, steps=12), interrupted[0], progress=False, print_fn=quiet)
    longer = corpus / "longer"
    shutil.copytree(interrupted[0], longer)
    out = []
    train.train(_cfg(corpus, steps=12), longer, change_horizon=True, stop_after=4,
                progress=False, print_fn=out.append)
    assert any("--change_horizon: steps 8 -> 12" in line for line in out), out
    first = metrics.read_metrics(longer)[3]  # step 4, the first update under the new horizon
    new = optimizer.lr_schedule(_cfg(corpus).optim.learning_rate, _cfg(corpus, steps=12))(3)
    assert first["step"] == 4 and first["learning_rate"] == float(new)


@pytest.mark.slow
def test_overwrite_starts_fresh(corpus, interrupted):
    fresh = corpus / "overwritten"
    shutil.copytree(interrupted[0], fresh)
    out = []
    # Another seed would be refused on resume; --overwrite deletes the run and starts it anew.
    train.train(_cfg(corpus, seed=3), fresh, overwrite=True, stop_after=1, progress=False,
                print_fn=out.append)
    assert any("--overwrite: deleting checkpoints [3]" in line for line in out), out
    assert any("starting fresh" in line for line in out), out
    assert [r["step"] for r in metrics.read_metrics(fresh)] == [1]
    assert checkpointing.Checkpointer(fresh / "checkpoints").all_steps() == []


# --------------------------------------------------------------------------- runs of real data


@pytest.mark.slow
def test_every_config_trains_for_any_number_of_steps():
    """--steps N for N >= 1: the warmup is clamped, the schedule is positive and finite and
    ends at min_lr_ratio x peak on the last update."""
    longest = 24
    for name, base in configs.CONFIGS.items():
        for steps in (1, 2, 3, longest):
            cfg = configs.override(base, {"steps": steps})
            assert 0 <= cfg.effective_warmup() < steps
            # Updates 0 .. steps - 1 of the rates of updates 0 .. 23, which the schedule computes
            # element by element: one shape for every config, so its operations compile once.
            lr = np.asarray(optimizer.lr_schedule(1.0, cfg)(np.arange(longest)))[:steps]
            assert np.all(np.isfinite(lr)) and np.all(lr > 0), (name, steps, lr)
            np.testing.assert_allclose(lr[-1], cfg.optim.min_lr_ratio, rtol=1e-5,
                                       err_msg=f"{name} steps={steps}")


def _gcs_mock(root: Path):
    """epath's mock backend with gs://bucket/... stored under `root` (no network)."""
    from etils import epath

    def local(path):
        text = os.fspath(path)
        return str(root / text[len("gs://"):]) if text.startswith("gs://") else text

    def forward(original, path, *args, **kwargs):
        args = [local(a) if isinstance(a, (str, os.PathLike)) else a for a in args]
        return original(local(path), *args, **kwargs)

    names = ("copy", "exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "open", "remove",
             "rename", "replace", "rmtree", "stat", "walk")
    return epath.testing.mock_epath(**{name: forward for name in names})


@pytest.mark.slow
def test_llmc_shards_pretrained_tokenizer_and_a_gcs_workdir(corpus, tmp_path):
    """llm.c shards encoded with a tokenizer.json, trained with --tokenizer into gs://bucket/run:
    the vocabulary is the tokenizer's padded to 128, the padding rows stay exactly zero and are
    never predicted, and metrics land in the bucket (epath's mock backend)."""
    texts = [f.read_text() for f in sorted((corpus / "corpus").iterdir())]
    tok = make_tokenizer(tmp_path / "tokenizer.json", texts, vocab_size=300)
    eos = tok.token_to_id("<|endoftext|>")
    ids = [i for t in texts for i in tok.encode(t).ids + [eos]]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_llmc_shard(shards / "corpus_val_000000.bin", ids[:2000])
    write_llmc_shard(shards / "corpus_train_000001.bin", ids[2000:])
    write_llmc_shard(shards / "corpus_train_000002.bin", ids[:200])  # less than one update
    bucket = tmp_path / "gcs"
    cfg = configs.override(configs.get_config("test"), {
        "data.source": str(shards), "data.tokenizer": str(tmp_path / "tokenizer.json"),
        "steps": 2, "checkpoint.dir": str(tmp_path / "ckpt")})
    out = []
    with _gcs_mock(bucket):
        record = train.train(cfg, "gs://bucket/run", progress=False, print_fn=out.append)
    assert not Path("gs:").exists()  # no local directory named after the URL
    assert any("warming up over 1 steps" in line for line in out), out
    assert any("data: llmc" in line for line in out), out
    assert ("warning: 1 of 2 training files hold less than one update's batch_size x "
            "grad_accum_steps x seq_len + 1 = 257 tokens and are never read (200 tokens); join "
            "them into larger files") in out
    records = metrics.read_metrics(bucket / "bucket" / "run")
    assert [r["step"] for r in records] == [1, 2] and math.isfinite(record["val_loss"])
    assert record["val_tokens"] == 256  # the test config's one batch of 8 x 32
    state, meta = restore_on_one_device(tmp_path / "ckpt", 2)
    saved = meta["config"]["model"]
    assert (saved["vocab_size"], saved["valid_vocab_size"]) == (384, 300)
    head = state["params"]["lm_head"]["kernel"]
    embed = state["params"]["embed"]["embedding"]
    assert head.shape == (32, 384) and np.all(head[:, 300:] == 0) and np.any(head[:, :300])
    assert np.all(embed[300:] == 0)
    # Padding ids are never predicted: their probability is exactly 0.
    trainer = train.Trainer(configs.override(cfg, {"model.vocab_size": 384,
                                                   "model.valid_vocab_size": 300}),
                            mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    from flax import nnx

    @jax.jit  # one program, not one per operation of the forward pass
    def probabilities(params, rest, tokens):
        return jax.nn.softmax(nnx.merge(trainer.graphdef, params, rest)(tokens), axis=-1)

    probs = probabilities(state["params"], state["rest"], np.asarray(ids[:32])[None])
    assert np.all(np.asarray(probs)[..., 300:] == 0)


def test_user_errors_are_one_line_and_exit_2(lm_corpus, tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("".join(f"line {i}\n" for i in range(40)))
    for argv, message in (
            (["--head", "sgd"], "--head must be one of"),
            (["--nope", "1"], "unrecognized arguments: --nope 1"),
            (["--d_model", "48"], "unrecognized arguments: --d_model 48"),
            (["--data.source", str(tmp_path / "missing")], "missing does not exist"),
            (["--config", "test", "--data.source", str(small)],
             "no training file holds one update's batch_size x grad_accum_steps x seq_len + 1 "
             "= 257 tokens"),
            (["--config", "test", "--eval.hilbert_sequences", "100000", "--data.source",
              str(lm_corpus / "corpus"), f"--data.dir={lm_corpus / 'tokens'}"],
             "no validation file holds the head probe's --eval.hilbert_sequences x seq_len + 1 "
             "= 3200001 tokens"),
            (["--config", "test", "--data.tokenizer", str(small)], "is not a Hugging Face"),
            (["--config", "test", "--mesh.data", "3"],
             "--mesh.data/--mesh.fsdp/--mesh.tensor = (3, 1, 1) need 3 devices")):
        if not any(a.startswith("--data.dir") for a in argv):
            argv = [*argv, f"--data.dir={tmp_path / 'data'}"]
        with pytest.raises(SystemExit) as exit_info:
            train.main([*argv, "--workdir", str(tmp_path / "w"), "--no-progress"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, argv
        assert err.startswith("train.py: error: ") and err.count("\n") == 1, err
        assert message in err and "Traceback" not in err, err
        assert not (tmp_path / "w").exists(), argv  # a launch that failed leaves no workdir


def test_half_a_process_description_is_one_line(tmp_path, capsys, monkeypatch):
    """jax.distributed reads neither JAX_NUM_PROCESSES nor JAX_PROCESS_ID; the trainer passes
    them on (tests/examples/_multiprocess_worker.py launches that way), and one without the
    other is one line, not jax's traceback."""
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--workdir", str(tmp_path / "w"), "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "JAX_NUM_PROCESSES and JAX_PROCESS_ID describe the processes together" in err


@pytest.mark.slow
def test_padded_vocabulary_optimizer_matches_the_recipe_on_the_real_rows():
    """With vocab_size 384 of which 300 are tokens, every update equals rowgeom.lm_optimizer's on
    the same model cut to its 300 real rows, and the padding rows get exactly zero updates."""
    from flax import nnx

    from examples.lm import model as model_lib

    test = configs.get_config("test")
    padded = configs.override(test, {"model.vocab_size": 384, "model.valid_vocab_size": 300})
    real = configs.override(test, {"model.vocab_size": 300})
    cut = lambda tree: {**tree, "lm_head": {"kernel": tree["lm_head"]["kernel"][:, :300]},
                        "embed": {"embedding": tree["embed"]["embedding"][:300]}}
    tx_padded, tx_real = optimizer.build_optimizer(padded), optimizer.build_optimizer(real)

    # Two compiled programs (not one per operation): the model and both optimizers' states, then
    # one update of each optimizer on the same gradients, the padded model's applied.
    @jax.jit
    def init():
        params = nnx.to_pure_dict(nnx.state(
            model_lib.Transformer(padded.model, rngs=nnx.Rngs(0)), nnx.Param))
        return params, tx_padded.init(params), tx_real.init(cut(params))

    @jax.jit
    def update(i, params, state_padded, state_real):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(1), i), len(leaves))
        grads = jax.tree.unflatten(treedef, [jax.random.normal(k, p.shape)
                                             for k, p in zip(keys, leaves, strict=True)])
        # The masked loss gives the padding rows no gradient.
        grads["lm_head"]["kernel"] = grads["lm_head"]["kernel"].at[:, 300:].set(0)
        grads["embed"]["embedding"] = grads["embed"]["embedding"].at[300:].set(0)
        up_padded, state_padded = tx_padded.update(grads, state_padded, params)
        up_real, state_real = tx_real.update(cut(grads), state_real, cut(params))
        return (optax.apply_updates(params, up_padded), state_padded, state_real, up_padded,
                up_real)

    params, state_padded, state_real = init()
    for i in range(3):
        params, state_padded, state_real, up_padded, up_real = update(
            np.int32(i), params, state_padded, state_real)
        up_padded, up_real = jax.device_get((up_padded, up_real))
        assert np.all(up_padded["lm_head"]["kernel"][:, 300:] == 0)
        assert np.all(up_padded["embed"]["embedding"][300:] == 0)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
                     cut(up_padded), up_real)
    assert np.all(np.asarray(params["lm_head"]["kernel"])[:, 300:] == 0)


@pytest.mark.parametrize("given", ["none", "a bound", "a directory", "disabled"])
def test_the_command_keeps_compiled_steps_in_a_persistent_cache(given, tmp_path, monkeypatch,
                                                                capsys):
    """The command (`main`, before it parses its flags) names `COMPILATION_CACHE` as JAX's
    persistent cache, bounded by `COMPILATION_CACHE_MAX_BYTES` unless the environment gave a
    bound, unless the environment named a cache, or turned caching off."""
    monkeypatch.setenv("HOME", str(tmp_path))
    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
             "jax_compilation_cache_max_size")
    old = {name: getattr(jax.config, name) for name in names}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine") if given ==
                          "a directory" else None)
        jax.config.update("jax_enable_compilation_cache", given != "disabled")
        jax.config.update("jax_compilation_cache_max_size", 1 << 20 if given == "a bound" else -1)
        with pytest.raises(SystemExit):
            train.main(["--help"])
        default = str(tmp_path / ".cache/rowgeom/jax")
        want = {"none": (default, train.COMPILATION_CACHE_MAX_BYTES),
                "a bound": (default, 1 << 20), "a directory": (str(tmp_path / "mine"), -1),
                "disabled": (None, -1)}[given]
        assert (jax.config.jax_compilation_cache_dir,
                jax.config.jax_compilation_cache_max_size) == want
    finally:
        for name, value in old.items():
            jax.config.update(name, value)
