"""The example on 8 devices, in this process: the model, the loss, the train step and a resumed
run sharded over the mesh give what one device gives; the paper's 190m config fits a 16 GiB chip;
`tools.train_compile` says when a step does not fit.

Marked `sharded`: `python -m pytest -m sharded` runs them in a process with 8 CPU devices (until
tests/conftest.py does it, `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
-m sharded tests/examples/test_lm_sharded.py`).
"""

import contextlib
import functools
import io
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lm_fixtures import config_on, deterministic_records
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.lm import configs, sharding, train
from examples.lm import loss as loss_lib
from examples.lm import model as model_lib
from examples.lm.tools import train_compile

pytestmark = pytest.mark.sharded


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, (
        f"{jax.device_count()} devices: run these with 8, `python -m pytest -m sharded` "
        "(or XLA_FLAGS=--xla_force_host_platform_device_count=8)")


def _mesh_222():
    return jax.make_mesh((2, 2, 2), sharding.AXES, axis_types=(AxisType.Auto,) * 3)


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ----------------------------------------------------------------------------- the model


def test_sharded_on_8_simulated_devices_matches_one_device():
    """Parameters placed by their logical annotations on a (2, 2, 2) mesh give the single-device
    logits, with activations constrained by the same table."""
    cfg = model_lib.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, mlp_dim=64,
                                max_seq_len=16)
    tokens = np.arange(64, dtype=np.int32).reshape(4, 16) * 7 % 64
    # The model built in one program (built eagerly, each of its ops would compile on its own).
    build = lambda: nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    gd = jax.eval_shape(build)[0]
    state = jax.jit(lambda: build()[1])()
    forward = jax.jit(lambda s, t: nnx.merge(gd, s)(t))
    expected = forward(state, tokens)
    mesh = _mesh_222()
    # flax's own logical partitioning reads the example's table (sharding.RULES).
    with nnx.logical_axis_rules(tuple(sharding.RULES.items())):
        # From the host: a device array's shards would be cut by programs of their own.
        state = jax.device_put(jax.device_get(state), nnx.get_named_sharding(state, mesh))
    kernel = state["layers"][0]["attn"]["q_proj"]["kernel"][...]
    assert kernel.sharding.spec == P("fsdp", "tensor"), kernel.sharding
    assert len(kernel.addressable_shards) == 8
    assert kernel.addressable_shards[0].data.shape == (16, 16)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        logits = forward(state, tokens)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the loss

BATCH, GROUPS = ("data", "fsdp"), 4  # the batch over 2 x 2 devices: 4 groups of rows


def _head_spec(va):
    return P("fsdp", "tensor") if va else P("tensor", "fsdp")  # the model's


def _loss_value_and_grad(mesh, va, num_valid, chunk, groups, constrain):
    pin = (lambda z: jax.lax.with_sharding_constraint(
        z, NamedSharding(mesh, P(BATCH, None, "tensor")))) if constrain else None
    f = lambda h, w, t: loss_lib.cross_entropy(h, w, t, vocab_axis=va, num_valid=num_valid,
                                               chunk_size=chunk, batch_groups=groups,
                                               constrain_logits=pin)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def test_sharded_loss_equals_one_device():
    """Batch over ("data", "fsdp"), head as the model shards it, logits chunks pinned to batch
    and vocabulary shards: the one-device value and gradients, the hidden gradient batch-sharded."""
    mesh = _mesh_222()
    B, T, D, V, NV, C = 8, 20, 16, 64, 60, 8  # T not a multiple of C
    rng = np.random.default_rng(0)
    for va in (1, 0):
        h = rng.standard_normal((B, T, D)).astype(np.float32)
        w = (rng.standard_normal((D, V) if va else (V, D)) / 2).astype(np.float32)
        t = rng.integers(0, NV, (B, T)).astype(np.int32)
        want_value, (want_dh, want_dw) = _loss_value_and_grad(mesh, va, NV, None, 1, False)(
            h, w, t)
        placed = (jax.device_put(h, NamedSharding(mesh, P(BATCH))),
                  jax.device_put(w, NamedSharding(mesh, _head_spec(va))),
                  jax.device_put(t, NamedSharding(mesh, P(BATCH))))
        for chunk in (None, C):
            value, (dh, dw) = _loss_value_and_grad(mesh, va, NV, chunk, GROUPS, True)(*placed)
            key = (va, chunk)
            assert _relative(value, want_value) <= 1e-6, key
            assert _relative(dh, want_dh) <= 1e-6, key
            assert _relative(dw, want_dw) <= 1e-6, key
            assert dh.sharding.spec == P(BATCH), (key, dh.sharding)


def _loop_collective_sizes(text: str) -> list[int]:
    """Element counts of the collectives inside the program's while bodies."""
    bodies = set(re.findall(r"while\(.*body=(%?[\w.\-]+)", text))
    sizes, current = [], None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = line.split("(")[0].split()[-1]
        m = re.search(r"= \(?([a-z0-9]+)\[([0-9,]*)\].*? (all-reduce|all-gather|"
                      r"reduce-scatter|all-to-all|collective-permute)(-start)?\(", line)
        if m and current in bodies:
            sizes.append(int(np.prod([int(s) for s in m.group(2).split(",") if s])))
    return sizes


def test_sharded_chunked_program_is_lean():
    """Per device: the plain program's temporaries exceed the device's share of the full logits,
    the chunked one's stay within three logits chunks plus a few float32 head- and hidden-sized
    buffers (under a third of that share), and with batch_groups = the batch shards no
    collective inside the scans moves a head-sized buffer (batch_groups = 1 all-reduces the
    head's gradient in every chunk: the check can fail)."""
    mesh = _mesh_222()
    B, T, D, V, C = 16, 1024, 64, 8192, 32
    full = B * T * V * 4 // 8
    head = D * V // 2
    # Per device: 3 logits chunks (B/4, C, V/2), 4 float32 heads, 4 float32 (B/4, T, D).
    lean_bound = 3 * (B // 4) * C * (V // 2) * 4 + 4 * D * V * 4 + 4 * (B // 4) * T * D * 4
    assert lean_bound < full / 3
    for va in (1, 0):
        args = (jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16,
                                     sharding=NamedSharding(mesh, P(BATCH))),
                jax.ShapeDtypeStruct((D, V) if va else (V, D), jnp.bfloat16,
                                     sharding=NamedSharding(mesh, _head_spec(va))),
                jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P(BATCH))))
        memory, loops = {}, {}
        for chunk, groups in ((None, 1), (C, GROUPS), (C, 1)):
            compiled = _loss_value_and_grad(mesh, va, None, chunk, groups, True).lower(
                *args).compile()
            memory[chunk, groups] = compiled.memory_analysis().temp_size_in_bytes
            loops[chunk, groups] = _loop_collective_sizes(compiled.as_text())
        assert memory[None, 1] >= full, memory
        assert memory[C, GROUPS] <= lean_bound, (memory, lean_bound)
        assert loops[C, GROUPS], loops  # lse, d hidden
        assert max(loops[C, GROUPS]) < head / 4, loops
        assert max(loops[C, 1]) >= head, loops


# ----------------------------------------------------------------------------- the train step

MESHES = {"fsdp 8": (1, 8, 1), "data 2 x fsdp 4": (2, 4, 1), "fsdp 4 x tensor 2": (1, 4, 2)}
VARIANTS = {
    "unrolled, remat none": {"model.scan_layers": False, "model.remat": "none"},
    "scanned, remat block, chunked loss": {"model.scan_layers": True, "model.remat": "block",
                                           "model.loss_chunk": 8},
    "unrolled, remat dots, chunked loss": {"model.scan_layers": False, "model.remat": "dots",
                                           "model.loss_chunk": 12},
}
# Every mesh and every variant at least once, one compile each (scan over the tensor axis too).
CASES = [("unrolled, remat none", "data 2 x fsdp 4"),
         ("scanned, remat block, chunked loss", "fsdp 8"),
         ("scanned, remat block, chunked loss", "fsdp 4 x tensor 2"),
         ("unrolled, remat dots, chunked loss", "fsdp 4 x tensor 2")]
STEPS = 2
# The test config: every mesh axis divides its vocabulary and widths, so every axis is used.
BASE = configs.get_config("test")
MESH_FIELDS = ("mesh.data", "mesh.fsdp", "mesh.tensor")




def case_config(root, variant, mesh):
    """The config of the run below (the test config on `root`'s corpus, saving every 3 steps:
    fields a train step does not read) with `variant`'s fields on `mesh` (names of VARIANTS and
    MESHES). The cases train it on conftest's `lm_corpus`, so that the run's steps are theirs."""
    return configs.override(config_on(root, checkpoint__every=3), {
        **VARIANTS[variant], **dict(zip(MESH_FIELDS, MESHES[mesh], strict=True))})


def _train_steps(cfg, mesh):
    """Two train steps of `cfg` on `mesh`: (losses, final params on the host, kernels split)."""
    trainer = train.Trainer(cfg, mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (STEPS, cfg.data.batch_size, cfg.seq_len + 1))
    losses = []
    with jax.set_mesh(mesh):
        state = trainer.init()
        for batch in tokens.astype(np.int32):
            inputs, targets = (sharding.global_batch(x, mesh, batch_size=len(x))
                               for x in (batch[:, :-1], batch[:, 1:]))
            state, loss = trainer.train_step(state, inputs, targets, trainer.rates)
            losses.append(float(loss))
    kernel = jax.tree.leaves(state["params"]["layers"])[0]
    split = kernel.addressable_shards[0].data.size < kernel.size
    return np.array(losses), jax.device_get(state["params"]), split


@functools.cache
def _one_device(scan_layers: bool):
    """The reference of each parameter layout: one device, no recomputation, the plain loss
    (recomputation and the chunked loss change only rounding, which the bounds allow)."""
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return _train_steps(configs.override(BASE, {"model.scan_layers": scan_layers,
                                                "mesh.data": 1}), one)


@pytest.mark.parametrize("variant,mesh", CASES)
def test_sharded_steps_match_one_device(variant, mesh, lm_corpus, shared_trainers):
    """Two steps on the mesh, from the sharded init, against one device. The module's run below
    trains two of these cases' configs on their meshes: `shared_trainers` gives it their
    trainers, whose init and train steps are then compiled already."""
    cfg = case_config(lm_corpus, variant, mesh)
    losses, params, split = _train_steps(cfg, sharding.make_mesh(*MESHES[mesh]))
    ref_losses, ref_params, _ = _one_device(VARIANTS[variant]["model.scan_layers"])
    assert split, "the blocks' kernels were not split over the mesh"
    assert _relative(losses, ref_losses) < 1e-5  # two steps' losses
    param_diff = max(jax.tree.leaves(jax.tree.map(_relative, params, ref_params)))
    assert param_diff < 1e-4  # every final parameter, relative to its largest entry


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4), (1, 1, 8), (2, 1, 4)])
def test_each_process_reads_the_rows_its_devices_hold(shape):
    """Two "processes" of 4 devices each (the first and last 4 of the mesh's device order, as
    make_mesh lays out two hosts): each reads the batch rows its devices hold, all of them when
    the data-parallel axes stay within a process (a tensor axis across processes; reading half
    would silently halve the global batch), against a reference from the mesh coordinates."""
    batch = 16
    mesh = sharding.make_mesh(*shape)
    order = list(mesh.devices.flat)
    data, fsdp, _ = shape
    for process in (order[:4], order[4:]):
        want = set()
        for (d, f, _), device in np.ndenumerate(mesh.devices):
            if device in process:  # block d·F + f of the D·F blocks of rows
                size = batch // (data * fsdp)
                want |= set(range((d * fsdp + f) * size, (d * fsdp + f + 1) * size))
        lo, hi = sharding.process_rows(batch, mesh, devices=process)
        assert set(range(lo, hi)) == want
    with pytest.raises(ValueError, match=r"not one block of consecutive rows"):
        sharding.process_rows(batch, sharding.make_mesh(8, 1, 1), devices=order[::2])


def test_optimizer_state_is_sharded_like_its_parameters():
    """Read from the state's structure: every moment and accumulator of a parameter takes the
    parameter's sharding, the tracker's scalars and the counts are replicated."""
    cfg = configs.override(BASE, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                                  "optim.grad_accum_steps": 2})
    trainer = train.Trainer(cfg, sharding.make_mesh(2, 2, 2))
    params, shardings = trainer.abstract_state["params"], trainer.shardings
    assert shardings["params"]["lm_head"]["kernel"].spec == P("fsdp", "tensor")
    assert shardings["params"]["embed"]["embedding"].spec == P("tensor", "fsdp")
    by_shape = {}
    for leaf, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings["params"]),
                       strict=True):
        by_shape.setdefault(leaf.shape, set()).add(s.spec)
    state = trainer.abstract_state["opt_state"]
    placed = 0
    for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings["opt_state"]),
                       strict=True):
        if leaf.ndim == 0:
            assert s.spec == P(), (leaf, s)
        else:
            assert s.spec in by_shape[leaf.shape], (leaf.shape, s.spec)
            placed += s.spec != P()
    # MultiSteps' accumulator, Muon's momenta, AdamW's moments, the head's EMA.
    assert placed >= 2 * len(jax.tree.leaves(params)) - 10, placed


# ----------------------------------------------------------------------------- a run


def test_a_run_resumes_onto_another_mesh(lm_corpus, shared_trainers, no_plot, tmp_path):
    """A run on (data 2, fsdp 4), and the same run resumed at step 3 from its checkpoint on
    (fsdp 4, tensor 2), where the matrices, the embedding and the head are also split over the
    tensor axis, with the recomputation and the loss chunking changed (runtime fields): the same
    records (the train step itself is checked against one device above). The two runs are the
    first and the last case of `test_sharded_steps_match_one_device` (`shared_trainers`: their
    init and train steps are not compiled again)."""
    quiet = lambda *a: None
    (first_variant, first_mesh), (moved_variant, moved_mesh) = CASES[0], CASES[-1]
    first_cfg = case_config(lm_corpus, first_variant, first_mesh)
    moved_cfg = case_config(lm_corpus, moved_variant, moved_mesh)
    # Only runtime fields change: scan_layers (the checkpoint's layout) is the same.
    assert first_cfg.model.scan_layers == moved_cfg.model.scan_layers
    assert (first_cfg.model.remat, first_cfg.model.loss_chunk) != (
        moved_cfg.model.remat, moved_cfg.model.loss_chunk)
    first = tmp_path / "first"
    train.train(first_cfg, first, progress=False, print_fn=quiet)
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    for step in (6, 8):
        shutil.rmtree(moved / "checkpoints" / str(step))
    out = []
    train.train(moved_cfg, moved, progress=False, print_fn=out.append)
    sizes = lambda mesh: dict(zip(sharding.AXES, MESHES[mesh], strict=True))
    assert any("resumed from step 3" in line for line in out), out
    assert any("mesh({})".format(", ".join(f"{a}={n}" for a, n in sizes(moved_mesh).items()))
               in line for line in out), out
    assert (f"resuming on mesh {sizes(moved_mesh)}, checkpoint 3 was saved from "
            f"mesh {sizes(first_mesh)}") in "\n".join(out), out
    expected, got = deterministic_records(first), deterministic_records(moved)
    assert [r.keys() for r in got] == [r.keys() for r in expected]
    for g, e in zip(got, expected, strict=True):
        for key in e:
            np.testing.assert_allclose(g[key], e[key], rtol=2e-4, atol=1e-6,
                                       err_msg=f"step {e['step']} {key}")


# ------------------------------------------------------------------ the compile report


@pytest.fixture(scope="module")
def paper_190m(tmp_path_factory):
    """`train_compile --paper --config 190m`, run once: (exit status, its JSON, its output, and
    every (config, `train_compile.compile_step` result) it compiled on the way, the v5e
    candidates among them)."""
    out = tmp_path_factory.mktemp("report") / "report.json"
    compiled, real_compile = [], train_compile.compile_step

    def recording(cfg, *args, **kwargs):
        compiled.append((cfg, real_compile(cfg, *args, **kwargs)))
        return compiled[-1][1]

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(train_compile, "compile_step", recording)
        status = train_compile.main(["--paper", "--config", "190m", "--json", str(out)])
    return status, json.loads(out.read_text()), printed.getvalue(), compiled


def test_190m_fits_a_16_gib_chip_at_4_sequences_per_chip_on_fsdp_8(paper_190m):
    # The paper's 256 sequences per update as 8 micro-batches of 4 sequences per chip: what
    # `python -m examples.lm.tools.train_compile --paper` finds fits a 16 GiB TPU v5e (its report
    # of this very config is read back, not compiled again; compiled here if the search skipped
    # it).
    cfg = configs.override(configs.get_config("190m"),
                           {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1,
                            "data.batch_size": 32, "optim.grad_accum_steps": 8})
    *_, compiled = paper_190m
    found = [result for candidate, result in compiled if candidate == cfg]
    result = found[0] if found else train_compile.compile_step(cfg, jax.devices())
    assert result["devices"] == 8 and result["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    partitioned = result["partitioned"]
    assert partitioned["loops_known"]
    assert result["peak_bytes"] <= 2**34, result["peak_bytes"]
    assert sum(partitioned["collectives"].values()) <= 4.0 * result["param_bytes"]
    assert result["matmul_flops"] <= 1.5 * result["model_flops"]
    gathers = {c["shape"].split("[")[0] for c in partitioned["largest_collectives"]
               if c["kind"] == "all-gather" and c["shape"].count(",") >= 1}
    assert "bf16" in gathers, gathers  # the blocks' weights gather in bf16
    # ... and their gradients are summed across devices in float32, as the paper's DDP sums the
    # float32 gradients of its float32 parameters (model.py, `_matmul`).
    reductions = {c["shape"].split("[")[0] for c in partitioned["largest_collectives"]
                  if c["kind"] in ("all-reduce", "reduce-scatter") and c["shape"].count(",")}
    assert reductions == {"f32"}, partitioned["largest_collectives"]


def test_train_compile_command_says_when_the_step_does_not_fit(tmp_path, capsys):
    status = train_compile.main(["--config", "test", "--mesh.data", "1", "--mesh.fsdp", "8",
                                 "--device-memory", "64KiB", "--json",
                                 str(tmp_path / "report.json")])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "does NOT fit" in out, out
    assert "on 8 cpu devices" in out and "as partitioned" in out, out
    assert (tmp_path / "report.json").exists()


def test_train_compile_paper_190m_fits_the_papers_gpus_and_states_the_diameter_share(paper_190m):
    """`train_compile --paper` for 190m (380m and 640m take longer and are not tested): its count
    is the paper's, it fits an 80 GiB GPU at the paper's micro-batch, a 16 GiB chip gets a
    micro-batch, and the exact diameter every 10 updates is a small share."""
    status, (result,), printed, _ = paper_190m
    assert status == 0
    assert result["param_count"] == result["paper_param_count"] == 185_680_896
    assert result["fits"] == {"H100": True, "H200": True}
    assert result["v5e"] is not None and result["v5e"]["peak_bytes"] <= 16 * 2**30
    assert 0 < result["diameter_share"] < 0.005
    assert "fits in 80.00 GiB (H100)" in printed
