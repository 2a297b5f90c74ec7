"""The paper's configs (arXiv 2608.22253, Tables 1-2) checked from the example's own objects.

Every expected number is written here from the paper, independently of configs.PAPER_MODELS, and
compared with what the example builds: the abstract model (nothing allocated), the resolved
optimizer groups (`rowgeom.describe`), the learning-rate schedule and the evaluation settings.
Nothing is trained.
"""

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rowgeom
from examples.lm import configs, data, model, optimizer
from examples.lm.tools import train_compile

# The paper's Table 1 and Table 2, typed from the paper.
PAPER = {
    #        d,    heads, parameters,  per-GPU batch, accum, updates, AdamW head, RowNorm head
    "190m": (512, 8, 185_680_896, 32, 1, 7_083, 4.0e-3, 3.2e-3),
    "380m": (768, 12, 379_184_640, 16, 2, 14_464, 2.667e-3, 2.133e-3),
    "640m": (1024, 16, 639_797_248, 8, 4, 24_406, 2.0e-3, 1.6e-3),
}
SIZES = sorted(PAPER)
HEADS = ("adamw", "rownorm")


def _params(cfg):
    abstract = nnx.eval_shape(lambda: model.Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


@pytest.mark.parametrize("size", SIZES)
def test_models_are_table_1(size):
    d, heads, params, *_ = PAPER[size]
    m = configs.get_config(size).model
    assert (m.d_model, m.num_heads, m.head_dim, m.num_layers, m.mlp_dim) == (d, heads, 64, 32,
                                                                             4 * d)
    assert (m.max_seq_len, m.rope_theta, m.norm_eps) == (2048, 10_000.0, 1e-6)
    assert m.qk_norm and not m.norm_gain and m.init_std == 0.02 and not m.tied_embeddings
    # GPT-2's vocabulary, padded for the hardware, the padding known from the config itself.
    assert (m.vocab_size, m.valid_vocab_size, m.num_tokens) == (50_304, 50_257, 50_257)
    # The paper's count: 32*16*d^2 + 2*50257*d, padding rows excluded.
    assert train_compile.param_count(m) == params == 32 * 16 * d * d + 2 * 50_257 * d
    leaves = _params(configs.get_config(size))
    shapes = {"/".join(map(str, k)): v.shape for k, v in _flat(leaves)}
    # No vector parameters at all (no norm gains, no biases): every leaf is a matrix.
    assert all(len(s) >= 2 for s in shapes.values()), shapes
    assert shapes["embed/embedding"] == (50_304, d) and shapes["lm_head/kernel"] == (d, 50_304)
    assert shapes["layers/mlp/gate_proj/kernel"] == (32, d, 4 * d)


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def test_init_is_normal_002_everywhere_and_padding_rows_are_zero():
    """A small model with the paper's switches: every weight's std is 0.02 (no depth scaling),
    and the padding rows of the embedding and the head start at zero."""
    cfg = model.ModelConfig(vocab_size=384, valid_vocab_size=300, d_model=64, num_layers=4,
                            num_heads=1, mlp_dim=256, max_seq_len=16, qk_norm=True,
                            norm_gain=False, init_std=0.02)
    @jax.jit  # one program, as the trainer initialises (not one per operation)
    def init_and_forward():
        net = model.Transformer(cfg, rngs=nnx.Rngs(0))
        return nnx.to_pure_dict(nnx.state(net, nnx.Param)), net(jnp.zeros((1, 8), jnp.int32))

    params, logits = init_and_forward()
    for path, leaf in _flat(params):
        value = np.asarray(leaf)
        if path[0] == "embed":
            assert not value[300:].any()
            value = value[:300]
        if path[0] == "lm_head":
            assert not value[:, 300:].any()
            value = value[:, :300]
        assert abs(value.std() - 0.02) < 0.002, (path, value.std())
    assert np.all(np.asarray(logits)[..., 300:] < -1e9)  # padding is never predicted


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("head", HEADS)
def test_recipe_is_table_2(size, head):
    d, _, params, per_gpu, accum, updates, adamw_lr, rownorm_lr = PAPER[size]
    cfg = configs.parse_config(["--config", size, "--head", head])
    assert cfg == configs.paper_config(size, head)
    # 256 x 2048 tokens per update, as the paper's micro-batch x accumulation on 8 GPUs.
    assert cfg.data.batch_size * cfg.optim.grad_accum_steps == 256 and cfg.seq_len == 2048
    assert (cfg.data.batch_size, cfg.optim.grad_accum_steps) == (8 * per_gpu, accum)
    assert cfg.steps == updates == math.floor(20 * params / (256 * 2048))
    assert cfg.optim.grad_clip == 1.0
    # Warmup floor(0.1 T) from zero, then cosine to 10 % of the peak on the last update.
    warm = math.floor(0.1 * updates)
    assert cfg.effective_warmup() == warm
    lr = optimizer.lr_schedule(1.0, cfg)
    # Update 0 (0-based) uses peak / warm (float32 schedule arithmetic: rel 1e-4).
    assert float(lr(0)) == pytest.approx(1 / warm, rel=1e-4)
    assert float(lr(warm - 1)) == pytest.approx(1.0, rel=1e-6)
    mid = warm + (updates - warm) // 2
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid + 1 - warm) / (updates - warm)))
    assert float(lr(mid)) == pytest.approx(cosine, rel=1e-5)
    assert float(lr(updates - 1)) == pytest.approx(0.1, rel=1e-6)

    opts = optimizer.optimizer_options(cfg)
    plan = rowgeom.describe(_params(cfg), cfg.optim.learning_rate, **opts)
    rows, groups = {r.path: r for r in plan}, plan.groups
    assert groups == dict(optimizer.group_hparams(cfg))  # what the trainer schedules
    hidden = [p for p in rows if p.startswith("layers/")]
    assert sorted(rows) == sorted(["embed/embedding", "lm_head/kernel", *hidden])
    assert {rows[p].label for p in hidden} == {"hidden"} and len(hidden) == 7
    assert rows["embed/embedding"].label == "embedding" and rows["lm_head/kernel"].label == "head"
    # Backbone: Nesterov Muon 8e-3, momentum 0.95, wd 0.1, 5 Newton-Schulz steps with
    # (3.4445, -4.7750, 2.0315), eps 1e-5, sqrt(max(1, fan_out / fan_in)).
    for p in hidden:
        row, group = rows[p], groups[rows[p].label]
        assert (row.optimizer, group.learning_rate, group.weight_decay, group.momentum) == (
            "muon", 8e-3, 0.1, 0.95)
        assert row.muon_dims == rowgeom.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    muon = opts["muon"]
    assert (muon.nesterov, muon.ns_steps, muon.eps, muon.scale) == (True, 5, 1e-5, "keller")
    np.testing.assert_allclose(rowgeom.ns_coefficients(muon.ns_coeffs, 5),
                               [[3.4445, -4.7750, 2.0315]] * 5)
    # Embedding: AdamW 4e-3, (0.9, 0.999), eps 1e-10, wd 0.1.
    emb = rows["embed/embedding"]
    emb_group = groups[emb.label]
    assert (emb.optimizer, emb_group.learning_rate, emb_group.weight_decay) == (
        "adamw", 4e-3, 0.1)
    assert (opts["adam"].b1, opts["adam"].b2, opts["adam"].eps) == (0.9, 0.999, 1e-10)
    head_row = rows["lm_head/kernel"]
    hg, head_opts = groups[head_row.label], opts["head"]
    if head == "adamw":
        assert (head_row.optimizer, hg.learning_rate, hg.weight_decay, hg.momentum) == (
            "adamw", adamw_lr, 0.1, 0.9)
    else:  # EMA 0.95 bias-corrected, eps 1e-8, no head weight decay
        assert (head_row.optimizer, hg.learning_rate, hg.weight_decay, hg.momentum) == (
            "rownorm", rownorm_lr, 0.0, 0.95)
        assert head_opts.bias_correction and head_opts.eps == 1e-8 and head_row.centred
    # Padding rows are left out of RowNorm (and give no AdamW step), from the config alone.
    assert head_opts.num_valid == 50_257


def test_muon_scale_is_sqrt_max_1_fan_out_over_fan_in():
    """The "keller" scale multiplies the polar factor of an (in, out) kernel by
    sqrt(max(1, out / in)): 2 for (8, 32), 1 for (32, 8)."""
    key = np.random.default_rng(0)
    cases = (((8, 32), 2.0), ((32, 8), 1.0))
    grads = [{"w": key.standard_normal(shape).astype(np.float32)} for shape, _ in cases]
    keller = rowgeom.muon_orthogonalize(scale="keller", eps=1e-5)
    bare = rowgeom.muon_orthogonalize(scale=None, eps=1e-5)

    @jax.jit  # both shapes, both scales: one program (not one per operation)
    def updates(grads):
        return [(keller.update(g, None)[0]["w"], bare.update(g, None)[0]["w"]) for g in grads]

    for ((shape, factor), (scaled, unscaled)) in zip(cases, jax.device_get(updates(grads)),
                                                     strict=True):
        np.testing.assert_allclose(scaled, factor * unscaled, rtol=1e-6, err_msg=str(shape))


@pytest.mark.parametrize("size", SIZES)
def test_diagnostics_are_the_papers(size):
    cfg = configs.get_config(size)
    # Exact D of the head step every 10 updates; validation loss and Hilbert RMS every 500.
    assert cfg.eval.diameter_every == 10 and cfg.eval.every == 500 and cfg.eval.centring
    v, d = cfg.model.num_tokens, cfg.model.d_model
    assert v * d <= cfg.eval.exact_diameter_max_elements  # exact, never the bracket
    # Hilbert RMS over 8,192 fixed validation positions; loss on the first 5,242,880 tokens.
    assert cfg.eval.hilbert_sequences * cfg.seq_len == 8_192
    assert cfg.resolved_eval_tokens() == 5_242_880
    assert cfg.resolved_eval_tokens() % (cfg.data.batch_size * cfg.seq_len) == 0


@pytest.mark.parametrize("size", SIZES)
def test_the_data_order_is_the_papers_loaders(size, tmp_path):
    """Each epoch shuffles the shard order and the order of whole updates (256 × 2,048 tokens
    of consecutive sequences) within a shard: two GPT-2 shards in llm.c's layout, read by the
    sampler the trainer builds from this config, give runs of 256 consecutive aligned
    sequences, whatever the micro-batch split."""
    cfg = configs.get_config(size)
    assert cfg.data.shuffle == "batches"
    per_update = cfg.data.batch_size * cfg.optim.grad_accum_steps
    assert per_update == 256
    paths = []
    for i in range(2):  # 5 and 3 updates' worth of sequences, and part of one more
        n = (5 - 2 * i) * per_update * cfg.seq_len + 1 + 1000
        header = np.zeros(256, "<i4")
        header[:3] = 20240520, 1, n
        path = tmp_path / f"fineweb_train_00000{i}.bin"
        ids = i * 10_000 + np.arange(n) // cfg.seq_len  # each aligned sequence's own id
        path.write_bytes(header.tobytes() + ids.astype("<u2").tobytes())
        paths.append(path)
    tokens = data.ShardedTokens([data.open_shard(p)[1] for p in paths])
    sampler = data.BatchSampler(tokens, batch_size=cfg.data.batch_size, seq_len=cfg.seq_len,
                                seed=0, grad_accum_steps=cfg.optim.grad_accum_steps,
                                shuffle=cfg.data.shuffle)
    assert sampler.updates_per_epoch == 5 + 3
    for update in range(8):
        inputs = np.concatenate([sampler.get(update * cfg.optim.grad_accum_steps + m)[0]
                                 for m in range(cfg.optim.grad_accum_steps)])
        assert inputs.shape == (256, 2048)
        assert np.all(inputs == inputs[:, :1])  # aligned: one sequence id per row
        np.testing.assert_array_equal(np.diff(inputs[:, 0]), 1)  # consecutive, in one shard


def test_other_heads_are_refused_on_the_paper_configs():
    with pytest.raises(ValueError, match=r"^--head must be one of .* for the paper's config"):
        configs.parse_config(["--config", "190m", "--head", "muon"])


def test_the_papers_diagnostics_land_in_metrics_jsonl(tmp_path, lm_corpus):
    """The `test` config with the paper's block, recipe options and diagnostics switched on,
    trained 8 updates of 2 micro-batches: the head step's diameter (without decay) every 3
    updates and on the last, the evaluation's loss and Hilbert RMS every 4, and the centring
    comparison of the RowNorm head at evaluations."""
    from _lm_fixtures import config_on

    from examples.lm import metrics, train

    cfg = config_on(lm_corpus, eval__diameter_every=3, eval__centring=True,
                    optim__head_bias_correction=True,
                    optim__head_weight_decay=0.0, checkpoint__every=100,
                    model__qk_norm=True, model__norm_gain=False, model__init_std=0.02,
                    model__scan_layers=True, optim__muon_scale="keller", optim__muon_eps=1e-5,
                    optim__adam_b2=0.999, optim__adam_eps=1e-10, optim__head_eps=1e-8,
                    optim__grad_accum_steps=2, data__batch_size=4)
    train.train(cfg, tmp_path / "run", progress=False, print_fn=lambda *a: None)
    records = {r["step"]: r for r in metrics.read_metrics(tmp_path / "run")}
    with_d = sorted(s for s, r in records.items() if "head_step_diameter" in r)
    assert with_d == [3, 4, 6, 8]  # every 3, the evaluations (4, 8) and the last (8)
    evals = sorted(s for s, r in records.items() if "val_loss" in r)
    assert evals == [4, 8]
    last = records[8]
    head_lr = last["head_learning_rate"]
    # Projected RowNorm without decay: D(S_t) <= 2 lr, and the uncentred step is the same up to
    # the centring, whose size the record states.
    assert 0 < last["head_step_diameter"] <= 2 * head_lr * (1 + 1e-5)
    assert last["head_step_hilbert_rms"] > 0
    for key in ("centring_ratio", "ema_mean_row_ratio", "uncentred_step_diameter"):
        assert np.isfinite(last[key]), key
    # The centring moves the step (by a data-dependent amount: no bound holds in general), and
    # every uncentred row moves by at most the rate too.
    assert last["centring_ratio"] > 0 and last["uncentred_step_diameter"] <= 2 * head_lr * 1.01


def test_the_launcher_runs_the_18_runs_or_a_subset(capsys):
    from examples.lm.tools import paper_runs

    assert paper_runs.main(["--dry-run", "--root", "runs/paper", "--data.source", "/d"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 18
    assert lines[0].endswith("-m examples.lm.train --config 190m --head rownorm --seed 0 "
                             "--workdir runs/paper/190m-rownorm-seed0 --no-progress "
                             "--data.source /d")
    assert paper_runs.main(["--dry-run", "--root", "r", "--sizes", "640m", "--heads", "adamw",
                            "--seeds", "1", "--data.source", "/d", "--", "--mesh.fsdp", "8"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith("--config 640m --head adamw --seed 1 --workdir r/640m-adamw-seed1 "
                         "--no-progress --data.source /d --mesh.fsdp 8")
    # No corpus named: refused (each run would train on the standard library's text).
    with pytest.raises(SystemExit) as exit_info:
        paper_runs.main(["--dry-run", "--root", "r"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("paper_runs.py: error: the following arguments are "
                                       "required: --data.source (see --help)\n")
    # Every command parses as the paper's config for its head.
    from examples.lm import configs
    command = paper_runs.commands(sizes=["380m"], heads=["adamw"], seeds=[2], root="r",
                                  data_source="/d")[0]
    args = configs.parser().parse_args(command[3:])
    assert configs.config_from_args(args) == configs.override(configs.paper_config("380m", "adamw"),
                                                            {"seed": 2, "data.source": "/d"})


_RUN = """
import os, signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *a: (out.with_suffix(".saved").touch(), sys.exit(0)))
out.with_suffix(".started").write_text(str(os.getpid()))
time.sleep(120)
"""


def test_the_launcher_passes_a_sigterm_to_the_run_and_starts_no_other(tmp_path):
    """A SIGTERM to the launcher alone (a container's process 1) reaches the run in progress,
    which saves and exits 0, as the trainer does; the next run never starts."""
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    launcher = (
        "import sys\n"
        "from examples.lm.tools import paper_runs\n"
        f"paper_runs.commands = lambda **kw: [[sys.executable, {str(script)!r}, "
        f"{str(tmp_path / 'first')!r}], [sys.executable, {str(script)!r}, "
        f"{str(tmp_path / 'second')!r}]]\n"
        "sys.exit(paper_runs.main(['--root', 'r', '--data.source', 'd']))\n")
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=Path(__file__).parents[2],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "first.started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        proc.kill()
        for started in tmp_path.glob("*.started"):  # a run left behind
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(started.read_text()), signal.SIGKILL)
    assert (tmp_path / "first.saved").exists()
    assert not (tmp_path / "second.started").exists()
    assert ("preempted (SIGTERM) during run 1, which saved a checkpoint; rerun the same "
            in log.read_text())
