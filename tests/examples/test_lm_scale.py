"""The example at pod scale, on one device: the compile report reads compiled programs right, and a
checkpoint restores only into the layer layout it was written in. The 8-device checks (the
sharded step, the 190m report, the train_compile command) are test_lm_sharded.py's."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from examples.lm import configs
from examples.lm.tools import compiled, train_compile


def test_parse_size_reads_binary_and_decimal_units():
    assert train_compile.parse_size("16GiB") == 16 * 2**30 == train_compile.parse_size("16g")
    assert train_compile.parse_size("80GB") == 80 * 10**9
    assert train_compile.parse_size("512 MiB") == 512 * 2**20
    assert train_compile.parse_size("1024") == 1024
    with pytest.raises(ValueError, match="--device-memory expects a size"):
        train_compile.parse_size("sixteen gigs")


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
