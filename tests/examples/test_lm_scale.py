"""The example at pod scale: the sharded step equals the one-device step in every layout, the
paper config fits a 16 GiB chip, the plan reads compiled programs right, and a checkpoint
restores only into the layer layout it was written in.

The 8-device checks run in one subprocess (`_scale_checks.py`, which prints one JSON object);
run it alone with `python tests/examples/_scale_checks.py`.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _subprocess import ModuleSubprocess

from examples.lm import configs
from examples.lm.tools import compiled, plan

SCRIPT = pathlib.Path(__file__).with_name("_scale_checks.py")
ROOT = SCRIPT.parents[2]
VARIANTS = ["unrolled, remat none", "scanned, remat block, chunked loss",
            "unrolled, remat dots, chunked loss"]
MESHES = ["fsdp 8", "data 2 x fsdp 4", "fsdp 4 x tensor 2"]


@pytest.fixture(scope="module")
def checks():
    proc = ModuleSubprocess.script(SCRIPT, timeout_s=420)
    yield proc
    proc.close()


CASES = [(v, m) for v in VARIANTS[:2] for m in MESHES] + [(VARIANTS[2], MESHES[2])]


@pytest.mark.slow
@pytest.mark.timeout(480)  # the first test waits for the whole script (its own limit: 420 s)
@pytest.mark.parametrize("variant,mesh", CASES)
def test_sharded_steps_match_one_device(checks, variant, mesh):
    case = checks.json()["steps"][f"{variant} / {mesh}"]
    assert case["split"], "the blocks' kernels were not split over the mesh"
    assert case["loss"] < 1e-5, case  # two steps' losses, relative
    assert case["params"] < 1e-4, case  # every final parameter, relative to its largest entry


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_190m_fits_a_16_gib_chip_at_4_sequences_per_chip_on_fsdp_8(checks):
    result = checks.json()["plan"]
    assert result["loops_known"]
    assert result["peak_over_16gib"] <= 1.0, result
    assert result["collectives_over_params"] <= 4.0, result
    assert result["flops_over_model"] <= 1.5, result
    assert "bf16" in result["gather_dtypes"], result  # the blocks' weights gather in bf16


@pytest.mark.slow
def test_plan_command_says_when_the_step_does_not_fit(tmp_path):
    command = [sys.executable, "-m", "examples.lm.tools.plan", "--config", "test",
               "--mesh.data", "1", "--mesh.fsdp", "8", "--device-memory", "64KiB", "--json",
               str(tmp_path / "plan.json")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "does NOT fit" in done.stdout, done.stdout
    assert "on 8 cpu devices" in done.stdout and "as partitioned" in done.stdout, done.stdout
    assert (tmp_path / "plan.json").exists()


def test_parse_size_reads_binary_and_decimal_units():
    assert plan.parse_size("16GiB") == 16 * 2**30 == plan.parse_size("16g")
    assert plan.parse_size("80GB") == 80 * 10**9
    assert plan.parse_size("512 MiB") == 512 * 2**20
    assert plan.parse_size("1024") == 1024
    with pytest.raises(ValueError, match="--device-memory expects a size"):
        plan.parse_size("sixteen gigs")


def test_hlo_matmul_flops_count_every_iteration_of_a_scan():
    """XLA's cost analysis counts a while loop's body once; `analyse_hlo` by its trip count."""
    layers, n = 5, 64

    def f(w_Lnn, x_n):
        return jax.lax.scan(lambda x, w: (jnp.tanh(w @ x), None), x_n, w_Lnn)[0]

    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((layers, n, n), jnp.float32),
                               jax.ShapeDtypeStruct((n,), jnp.float32))
    program = lowered.compile()
    figures = compiled.analyse_hlo(program.as_text())
    assert figures["loops_known"]
    assert figures["matmul_flops"] == layers * 2 * n * n
    assert sum(figures["collectives"].values()) == 0  # one device
    xla = program.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert xla["flops"] < layers * 2 * n * n  # why analyse_hlo exists


def test_hlo_collectives_count_the_larger_side_and_loop_trips():
    text = """HloModule m

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %g = f32[64,16]{1,0} all-gather(%x), dimensions={0}
  %r = f32[8,16]{1,0} reduce-scatter(%g), dimensions={0}
  ROOT %t = (s32[], f32[8,16]) tuple(%i, %r)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %s = bf16[8,16]{1,0} convert(%a)
  %ar = bf16[8,16]{1,0} all-reduce(%s), to_apply=%add
  %w = (s32[], f32[8,16]) while(%init), condition=%cond, body=%body
  ROOT %o = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""
    figures = compiled.analyse_hlo(text)
    assert figures["loops_known"]
    block = 64 * 16 * 4
    assert figures["collectives"]["all-gather"] == 3 * block  # the gathered result, 3 trips
    assert figures["collectives"]["reduce-scatter"] == 3 * block  # its whole input
    assert figures["collectives"]["all-reduce"] == 8 * 16 * 2  # bf16


def test_a_checkpoint_restores_only_into_its_layer_layout():
    scanned = configs.get_config("190m")
    assert scanned.model.scan_layers
    unrolled = configs.override(scanned, {"model.scan_layers": False})
    meta = {"step": 10, "config": dataclasses.asdict(unrolled)}
    with pytest.raises(ValueError, match=r"--model.scan_layers saved False, now True.*"
                                         r"restores only into the layout it was written in"):
        configs.resolve_config(scanned, meta)
    # Not given on the command line: the checkpoint's layout is followed.
    cfg, _ = configs.resolve_config(scanned, meta, explicit=set())
    assert not cfg.model.scan_layers
    # A checkpoint from before the field existed stored its blocks unrolled.
    del meta["config"]["model"]["scan_layers"]
    cfg, _ = configs.resolve_config(scanned, meta, explicit=set())
    assert not cfg.model.scan_layers
    # The recomputation policy and the loss's chunking follow the command line.
    changed = configs.override(scanned, {"model.remat": "none", "model.loss_chunk": 256})
    cfg, changes = configs.resolve_config(
        changed, {"step": 10, "config": dataclasses.asdict(scanned)})
    assert (cfg.model.remat, cfg.model.loss_chunk) == ("none", 256)
    assert set(changes) == {"model.remat", "model.loss_chunk"}
