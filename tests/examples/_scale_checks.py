"""Runs in its own process with 8 simulated CPU devices (see test_lm_scale.py).

Prints one JSON object:

- ``"steps"``: for each variant of the example's step (unrolled or scanned blocks, each remat
  policy, the plain or the chunked loss) and each mesh (fsdp 8, data 2 x fsdp 4, fsdp 4 x
  tensor 2), the largest relative difference of two training steps' losses and of the final
  parameters from the same variant on one device, and whether the blocks' kernels were split.
- ``"plan"``: `examples.lm.tools.plan` of the `190m` config on fsdp 8 at 4 sequences per chip
  (per-device peak memory, collective bytes as partitioned, matmul FLOPs, each against what it
  is compared with), and the element types of its weight all-gathers.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `examples`

# 8 devices, and the train step's HLO after SPMD partitioning (what `plan` reads), before jax
# starts its backend.
DUMP_DIR = tempfile.mkdtemp(prefix="rowgeom-scale-checks-")
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 "
    f"--xla_dump_to={DUMP_DIR} --xla_dump_hlo_pass_re=spmd-partitioning "
    "--xla_dump_hlo_module_re=.*_step.*")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from examples.lm import configs  # noqa: E402
from examples.lm import sharding as mesh_lib  # noqa: E402
from examples.lm.tools import plan  # noqa: E402
from examples.lm.train import Trainer  # noqa: E402

MESHES = {"fsdp 8": (1, 8, 1), "data 2 x fsdp 4": (2, 4, 1), "fsdp 4 x tensor 2": (1, 4, 2)}
# (fields, meshes): scan and remat off and on, on every mesh; the third policy on one.
VARIANTS = {
    "unrolled, remat none": ({"model.scan_layers": False, "model.remat": "none"}, MESHES),
    "scanned, remat block, chunked loss": ({"model.scan_layers": True, "model.remat": "block",
                                            "model.loss_chunk": 8}, MESHES),
    "unrolled, remat dots, chunked loss": ({"model.scan_layers": False, "model.remat": "dots",
                                            "model.loss_chunk": 12}, ["fsdp 4 x tensor 2"]),
}
STEPS = 2
# The test config with a vocabulary and widths that every mesh axis divides, so every axis is used.
BASE = configs.override(configs.get_config("test"), {
    "model.vocab_size": 256, "model.d_model": 32, "model.num_heads": 4, "model.mlp_dim": 64,
    "model.max_seq_len": 32, "data.batch_size": 8})


def _batches(cfg):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (STEPS, cfg.data.batch_size, cfg.seq_len + 1))
    return tokens.astype(np.int32)


def _train(cfg, mesh):
    trainer = Trainer(cfg, mesh)
    losses = []
    with jax.set_mesh(mesh):
        state = trainer.init()
        for batch in _batches(cfg):
            inputs, targets = (mesh_lib.global_batch(x, mesh) for x in (batch[:, :-1],
                                                                       batch[:, 1:]))
            state, loss = trainer.train_step(state, inputs, targets)
            losses.append(float(loss))
    kernel = jax.tree.leaves(state["params"]["layers"])[0]
    split = kernel.addressable_shards[0].data.size < kernel.size
    return np.array(losses), jax.device_get(state["params"]), split


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def steps() -> dict:
    out = {}
    one = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    for variant, (fields, meshes) in VARIANTS.items():
        cfg = configs.override(BASE, fields)
        ref_losses, ref_params, _ = _train(configs.override(cfg, {"mesh.data": 1}), one)
        for name in meshes:
            sizes = MESHES[name]
            sharded = configs.override(cfg, dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"),
                                                     sizes, strict=True)))
            losses, params, split = _train(sharded, mesh_lib.make_mesh(*sizes))
            param_diff = max(jax.tree.leaves(jax.tree.map(_relative, params, ref_params)))
            out[f"{variant} / {name}"] = {"loss": _relative(losses, ref_losses),
                                          "params": param_diff, "split": split}
    return out


def plan_190m() -> dict:
    # The paper's 256 sequences per update as 8 micro-batches of 4 sequences per chip: what
    # `python -m examples.lm.tools.plan --paper` finds fits a 16 GiB TPU v5e.
    cfg = configs.override(configs.get_config("190m"),
                           {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1,
                            "data.batch_size": 32, "optim.grad_accum_steps": 8})
    result = plan.plan(cfg, jax.devices(), dump_dir=DUMP_DIR)
    gathers = sorted({c["shape"].split("[")[0] for c in result["partitioned"]["largest_collectives"]
                      if c["kind"] == "all-gather" and c["shape"].count(",") >= 1})
    return {"peak_over_16gib": result["peak_bytes"] / 2**34,
            "collectives_over_params": (sum(result["partitioned"]["collectives"].values())
                                        / result["param_bytes"]),
            "flops_over_model": result["matmul_flops"] / result["model_flops"],
            "loops_known": result["partitioned"]["loops_known"], "gather_dtypes": gathers}


if __name__ == "__main__":
    print(json.dumps({"steps": steps(), "plan": plan_190m()}))
