"""Compiling the example's step for TPU and GPU targets on a host with neither
(`examples/lm/tools/topology.py`).

The target names need nothing installed. Compiling needs the target's compiler: libtpu (the
`tpu` extra) for TPUs, jax's CUDA plugin and ptxas (the `gpu-aot` extra, installed as
docs/guides/targets.md says) for GPUs; without them those tests skip, with the reason. Each
compile runs in a fresh process (the compilers want `jax_platforms="cpu"` set before a backend
starts) on the `test` config: seconds each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from examples.lm.tools import topology

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 2**30


def test_tpu_names_map_to_cloud_tpu_slices():
    v5e = topology.get_target("v5e-8")
    assert (v5e.platform, v5e.num_devices, v5e.memory_bytes) == ("tpu", 8, 16 * GIB)
    assert v5e.topology["topology_name"] == "v5e:2x4"
    assert topology.get_target("v5e-256").topology["topology_name"] == "v5e:16x16"
    assert topology.get_target("v6e-8").topology["topology_name"] == "v6e:2x4"
    v5p = topology.get_target("v5p-8")  # TensorCores: four megacore chips
    assert (v5p.num_devices, v5p.topology["topology_name"]) == (4, "v5:2x2x1")
    assert v5p.topology["chip_config_name"] == "megacore"
    assert topology.get_target("v4-32").topology["topology_name"] == "v4:2x2x4"
    two = topology.get_target("2xv5e-256")
    assert (two.num_devices, two.topology["num_slices"]) == (512, 2)


def test_gpu_names_and_the_preallocated_budget():
    h200 = topology.get_target("h200-8")
    assert (h200.platform, h200.num_devices, h200.topology["topology"]) == ("cuda", 8, "1x1x8")
    assert h200.budget_bytes == int(h200.memory_bytes * 0.75)
    assert topology.get_target("h100-16").topology["topology"] == "1x2x8"
    for name, file in (("h100-8", "h100_sxm.txtpb"), ("h200-8", "h200.txtpb")):
        text = (topology.TARGETS_DIR / file).read_text()
        memory = topology.get_target(name).memory_bytes
        assert f"device_memory_size: {memory}" in text
        assert "collective_memory_granularity" not in text.replace("# collective_memory", "")


def test_split_candidates_keep_the_paper_update():
    """The search `--topology` and `--paper` share: every candidate keeps 256 sequences per
    update, cheapest recomputation and largest micro-batch first; the config's own split is
    skipped when it was already compiled. (The paper's `190m` fitting v5e-8 is not asserted
    here: its TPU compile takes about four minutes on a 2-core host; see bench_targets.py.)"""
    from examples.lm import configs
    from examples.lm.tools import train_compile

    cfg = configs.paper_config("640m")  # 8 per GPU x 4 accumulation, dots
    splits = [(c.model.remat, c.data.batch_size // 8, c.optim.grad_accum_steps)
              for c in train_compile.split_configs(cfg, 8)]
    assert splits == [("dots", 8, 4), ("dots", 4, 8), ("block", 8, 4), ("block", 4, 8),
                      ("block", 2, 16), ("block", 1, 32)]
    assert [s[:2] for s in (
        (c.model.remat, c.data.batch_size // 8) for c in train_compile.split_configs(
            cfg, 8, skip_own=True))][0] == ("dots", 4)
    tried = []
    chosen, result = train_compile.fit_split(
        cfg, 8, lambda c: tried.append(c) or {"peak_bytes": 20 if c.model.remat == "dots"
                                              else 10}, budget=16)
    assert (chosen.model.remat, chosen.data.batch_size, len(tried)) == ("block", 64, 3)
    assert result == {"peak_bytes": 10}


@pytest.mark.parametrize("name", ["v5e-3", "v5p-6", "tpu-8", "h200-12", "2xh200-8"])
def test_unknown_targets_raise(name):
    with pytest.raises(ValueError):
        topology.get_target(name)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


HAS_TPU = _has("libtpu")
HAS_GPU = _has("jax_plugins.xla_cuda12") and topology._ptxas() is not None
needs_tpu = pytest.mark.skipif(not HAS_TPU, reason="libtpu is not installed (the `tpu` extra)")
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="jax's CUDA plugin or ptxas is not installed (the `gpu-aot` extra)")


@pytest.mark.skipif(HAS_TPU, reason="libtpu is installed")
def test_without_the_compiler_the_cli_says_what_to_install(tmp_path):
    proc = _run(["-m", "examples.lm.tools.topology", "--config", "test", "--topology", "v5e-8"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert 'pip install -e ".[tpu]"' in proc.stderr


def test_train_compile_hands_a_topology_to_the_target_compiler(capsys):
    from examples.lm.tools import train_compile

    with pytest.raises(SystemExit) as e:
        train_compile.main(["--config", "test", "--topology", "v9z-3"])
    assert e.value.code == 2 and "unknown target 'v9z-3'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        train_compile.main(["--config", "test", "--topology", "v5e-8", "--devices", "8"])
    assert e.value.code == 2 and "drop --paper, --devices" in capsys.readouterr().err


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1",
               PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _step(target: str, tmp_path, module: str = "examples.lm.tools.topology") -> dict:
    out = tmp_path / "report.json"
    proc = _run(["-m", module, "--config", "test", "--topology", target,
                 "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "fits" in proc.stdout and target in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def _check_step(result: dict, platform: str) -> None:
    assert result["platform"] == platform and result["devices"] == 8
    assert result["fits"] and 0 < result["peak_bytes"] <= result["budget"]
    assert result["mesh"]["fsdp"] == 8
    # FSDP: the weights are gathered, the gradients reduced.
    assert result["collectives"]["all-gather"] > 0
    assert result["collectives"]["all-reduce"] + result["collectives"]["reduce-scatter"] > 0
    # Every matmul counted (TPU programs write them as convolutions): about the model's count.
    assert 0.8 <= result["matmul_flops"] / result["model_flops"] <= 2.0, result


@needs_tpu
def test_test_config_step_compiles_and_fits_on_v5e_8(tmp_path):
    _check_step(_step("v5e-8", tmp_path), "tpu")


@needs_tpu
def test_two_slices_split_data_parallelism_across_them(tmp_path):
    """Multi-slice: `2xv5e-4` is a hybrid mesh, data over the two slices, FSDP within each."""
    result = _step("2xv5e-4", tmp_path)
    assert result["fits"] and result["devices"] == 8
    assert result["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}


@needs_gpu
def test_test_config_step_compiles_and_fits_on_h200_8(tmp_path):
    # through train_compile's --topology, which hands the same flags to topology.py
    _check_step(_step("h200-8", tmp_path, module="examples.lm.tools.train_compile"), "gpu")


_UPDATE = """
import json, re, sys
from examples.lm import configs
from examples.lm.tools import topology
target = topology.get_target(sys.argv[1])
topology.prepare(target.platform)
r = topology.compile_optimizer_update(configs.get_config("test"), target)
ops = re.findall(r"= (\\S+|\\(.*?\\)) (all-reduce|all-gather|reduce-scatter|all-to-all)"
                 r"(?:-start)?\\(", r.pop("hlo"))
r["ops"] = [[kind, re.sub(r"\\{[^{}]*\\}", "", shape)] for shape, kind in ops]
print(json.dumps(r))
"""


@needs_tpu
def test_lm_optimizer_update_collectives_on_v5e_8():
    """The `test` config's `lm_optimizer` update on FSDP 8 (each matrix split along its model
    axis): Muon's Newton-Schulz runs on whole matrices (moved by all-to-all), with no Gram
    all-reduce; the RowNorm head's statistics are all-reduced as vocabulary-length vectors, and
    the head itself is never gathered."""
    proc = _run(["-c", _UPDATE, "v5e-8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fits"]
    ops = result["ops"]
    reduced = [shape for kind, shape in ops if kind == "all-reduce"]
    assert not [s for s in reduced if s.count(",") >= 1 and "(" not in s], reduced  # no matrix
    assert any(re.fullmatch(r"f32\[512\]", s) or "f32[512]," in s for s in reduced), reduced
    assert not [s for kind, s in ops if kind == "all-gather" and "512" in s], ops
    assert any(kind == "all-to-all" for kind, _ in ops), ops


# ----------------------------------------------------------------------------- reading TPU HLO

_WINDOWED = """HloModule m

%body (p: (f32[8,64], u32[])) -> (f32[8,64], u32[]) {
  %p = (f32[8,64], u32[]) parameter(0)
  %x = f32[8,64]{1,0:T(8,128)} get-tuple-element(%p), index=0
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  %one = u32[]{:T(128)} constant(1)
  %two = u32[]{:T(128)} constant(2)
  %other = u32[]{:T(128)} add(%i, %one)
  %k = f32[64,32]{1,0:T(8,128)} constant({...})
  %y = f32[8,32]{1,0:T(8,128)} convolution(%x, %k), dim_labels=bf_io->bf
  %g = f32[16,64]{1,0:T(8,128)} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %next = u32[]{:T(128)} add(%i, %two)
  ROOT %t = (f32[8,64], u32[]) tuple(%x, %next)
}

%cond (p: (f32[8,64], u32[])) -> pred[] {
  %p = (f32[8,64], u32[]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  %n = u32[]{:T(128)} constant(4)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,64], q: bf16[4,16,64], kk: bf16[4,16,64]) -> f32[8,64] {
  %a = f32[8,64]{1,0:T(8,128)} parameter(0)
  %q = bf16[4,16,64]{2,1,0} parameter(1)
  %kk = bf16[4,16,64]{2,1,0} parameter(2)
  %att = f32[4,16,16]{2,1,0} convolution(%q, %kk), BATCHED
  %w = (f32[8,64], u32[]) while(%init), condition=%cond, body=%body
  ROOT %o = f32[8,64]{1,0} get-tuple-element(%w), index=0
}
""".replace("BATCHED", "window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0oi->0bf")


def test_tpu_hlo_convolutions_and_windowed_loops_are_counted():
    """The TPU compiler writes matmuls as convolutions (a batched one with its batch axis as a
    window over a dilated input: one real tap per output), and its bidirectional windowed-einsum
    loops step their counter by 2: `counter < 4` runs twice."""
    from examples.lm.tools import compiled

    figures = compiled.analyse_hlo(_WINDOWED)
    assert figures["loops_known"]
    matmul = 2 * 8 * 32 * 64  # the loop's (8, 64) @ (64, 32)
    attention = 2 * (4 * 16 * 16) * 64  # 4 batched (16, 64) @ (64, 16)
    assert figures["matmul_flops"] == 2 * matmul + attention
    assert figures["collectives"]["collective-permute"] == 2 * 16 * 64 * 4


_CHAINED = """HloModule m

%start (a: bf16[2,64]) -> (bf16[2,64], bf16[16,64], s32[2]) {
  %a = bf16[2,64]{1,0} parameter(0)
  %g = bf16[16,64]{1,0} all-gather(%a) PIECE_START
  %s = s32[2]{0} constant({0, 0})
  ROOT %t = (bf16[2,64], bf16[16,64], s32[2]) tuple(%a, %g, %s)
}

%done (a: bf16[2,64]) -> bf16[16,64] {
  %a = bf16[2,64]{1,0} parameter(0)
  ROOT %g = bf16[16,64]{1,0} all-gather(%a) PIECE_NEXT
}

%step (a: bf16[2,64], x: f32[8,64]) -> (f32[8,64], bf16[16,64]) {
  %a = bf16[2,64]{1,0} parameter(0)
  %x = f32[8,64]{1,0} parameter(1)
  %y = f32[8,64]{1,0} negate(%x)
  %g = bf16[16,64]{1,0} all-gather(%a) PIECE_NEXT
  ROOT %t = (f32[8,64], bf16[16,64]) tuple(%y, %g)
}

%body (p: (f32[8,64], s32[], bf16[2,64])) -> (f32[8,64], s32[], bf16[2,64]) {
  %p = (f32[8,64], s32[], bf16[2,64]) parameter(0)
  %x = f32[8,64]{1,0} get-tuple-element(%p), index=0
  %i = s32[] get-tuple-element(%p), index=1
  %a = bf16[2,64]{1,0} get-tuple-element(%p), index=2
  %f = (f32[8,64], bf16[16,64]) fusion(%a, %x), kind=kOutput, calls=%step
  %y = f32[8,64]{1,0} get-tuple-element(%f), index=0
  %r = f32[8,64]{1,0} all-reduce(%y), channel_id=8, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (f32[8,64], s32[], bf16[2,64]) tuple(%r, %next, %a)
}

%cond (p: (f32[8,64], s32[], bf16[2,64])) -> pred[] {
  %p = (f32[8,64], s32[], bf16[2,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=1
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: bf16[2,64], x: f32[8,64]) -> bf16[16,64] {
  %a = bf16[2,64]{1,0} parameter(0)
  %x = f32[8,64]{1,0} parameter(1)
  %s = (bf16[2,64], bf16[16,64], s32[2]) fusion(%a), kind=kLoop, calls=%start
  %zero = s32[] constant(0)
  %init = (f32[8,64], s32[], bf16[2,64]) tuple(%x, %zero, %a)
  %w = (f32[8,64], s32[], bf16[2,64]) while(%init), condition=%cond, body=%body
  ROOT %d = bf16[16,64]{1,0} fusion(%a), kind=kLoop, calls=%done
}
"""
_PIECE = (', channel_id=7, dimensions={0}, frontend_attributes={chain_id="0"}, '
          'backend_config={"async_collective_fusion_config":{"flag_start":"%s","flag_end":"%s"}}')
_CHAINED = (_CHAINED.replace(" PIECE_START", _PIECE % (-1, -1))
            .replace(" PIECE_NEXT", _PIECE % (2, 8)))


def test_tpu_async_collective_fusion_chain_counts_once():
    """A collective the TPU compiler splits into a start, continuations inside a later loop's
    body and a done (one `channel_id` and `chain_id`) is one collective, not one per piece and
    loop trip; a plain collective in the same body still counts once per trip."""
    from examples.lm.tools import compiled

    figures = compiled.analyse_hlo(_CHAINED)
    assert figures["loops_known"]
    assert figures["collectives"]["all-gather"] == 16 * 64 * 2
    assert figures["collectives"]["all-reduce"] == 4 * 8 * 64 * 4
