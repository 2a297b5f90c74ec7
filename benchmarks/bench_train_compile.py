"""The example's train step at the paper's sizes, read from the compiled program on 8 devices.

Every number comes from `python -m examples.lm.tools.train_compile`'s reading of the compiled step
(`examples/lm/tools/train_compile.py`, `examples/lm/tools/compiled.py`), compiled from abstract
inputs on 8 simulated CPU devices (nothing is allocated):

1. `190m`, `380m`, `640m` (the paper's models) at their own micro-batch (the paper's 8 GPUs'
   micro-batch of 2,048-token sequences; `python -m examples.lm.tools.train_compile --paper`
   finds the one that fits 16 GiB) on `fsdp 8`, `data 2 x fsdp 4` and `fsdp 4 x tensor 2`:
   per-device peak memory (arguments + outputs + temporaries - donated) against a 16 GiB chip,
   collective bytes per device (as partitioned: the element types an accelerator moves) against
   the parameter bytes, matmul FLOPs against the model's count (6N + attention), and the compile
   time.
2. The recomputation policies side by side (`190m`, `fsdp 8`), and the optimizer's share of
   the step's collectives (less those of the same step without the optimizer update).
3. Compile time of the `640m` step with scanned and with unrolled blocks, in one run.

Run: `python benchmarks/bench_train_compile.py` (`--quick`: the `test`
config only; `--docs`: rewrite its section of docs/benchmarks.md; `--json PATH`: the raw numbers).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

DUMP_DIR = tempfile.mkdtemp(prefix="rowgeom-bench-train-compile-")
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 "
    f"--xla_dump_to={DUMP_DIR} --xla_dump_hlo_pass_re=spmd-partitioning "
    "--xla_dump_hlo_module_re=.*_step.*")

import argparse  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import provenance  # noqa: E402  (beside this script)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.lm import configs  # noqa: E402
from examples.lm.tools import train_compile  # noqa: E402

BLOCK = "train-compile"
MESHES = {"fsdp 8": (1, 8, 1), "data 2 x fsdp 4": (2, 4, 1), "fsdp 4 x tensor 2": (1, 4, 2)}
GIB = 2**30
BUDGET = 16 * GIB  # a TPU v5e chip


def _config(name: str, mesh: str, **fields):
    sizes = dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), MESHES[mesh], strict=True))
    return configs.override(configs.get_config(name), sizes | fields)


def _compile(name: str, mesh: str, step: str = "train_step", **fields) -> dict:
    result = train_compile.compile_step(_config(name, mesh, **fields), jax.devices(),
                                        dump_dir=DUMP_DIR, step=step)
    result.update(config=name, mesh_name=mesh, step=step)
    print(train_compile.report(result, name=f"{name} {step}", device_memory=BUDGET), flush=True)
    return result


def run(quick: bool) -> dict:
    env = provenance.environment(provenance.load_average())
    start = time.perf_counter()
    names = ["test"] if quick else ["190m", "380m", "640m"]
    first = names[0]
    out = {
        "sizes": [_compile(n, m) for n in names for m in MESHES],
        "remat": [_compile(first, "fsdp 8", **{"model.remat": r, "model.scan_layers": True})
                  for r in ("none", "block", "dots")],
        "grads_only": _compile(first, "fsdp 8", step="grad_step"),
        "compile": [_compile(names[-1], "fsdp 8", **{"model.scan_layers": s})
                    for s in (True, False)],
    }
    out["environment"] = provenance.finish(env) | {"total_s": time.perf_counter() - start,
                                                    "quick": quick}
    return out


def _collectives(r: dict) -> tuple[float, str]:
    by_kind = r["partitioned"]["collectives"] if r["partitioned"] else r["collectives"]
    total = sum(by_kind.values()) / r["param_bytes"]
    kinds = ", ".join(f"{k} {v / r['param_bytes']:.2f}" for k, v in by_kind.items() if v)
    return total, kinds


def _row(r: dict, first: str) -> str:
    total, kinds = _collectives(r)
    per_device = r["batch"] // (r["mesh"]["data"] * r["mesh"]["fsdp"])
    fits = "yes" if r["peak_bytes"] <= BUDGET else "**no**"
    return (f"| {first} | {r['batch']} x {r['seq_len']} ({per_device}) | "
            f"{r['memory']['temporaries'] / GIB:.2f} GiB | **{r['peak_bytes'] / GIB:.2f} GiB** "
            f"({fits}) | **{total:.2f}x** ({kinds}) | "
            f"{r['matmul_flops'] / r['model_flops']:.2f}x | {r['compile_s']:.0f} s |")


HEADER = ["| {} | micro-batch (per data-parallel rank) | temporaries | peak per device (fits "
          "16 GiB) | collectives ÷ parameter bytes (by kind) | matmul FLOPs ÷ model | compile |",
          "|---|---|---|---|---|---|---|"]


def markdown(results: dict) -> str:
    env = results["environment"]
    command = "python benchmarks/bench_train_compile.py" + (" --quick" if env["quick"] else "")
    lines = [provenance.header(command + " --docs", env), "",
             f"{env['total_s']:.0f} s in all. Every number is read from the compiled step "
             "(abstract inputs, nothing allocated); collectives as partitioned (bf16 where the "
             "step moves bf16; XLA:CPU itself widens them to float32).", "",
             "### Each size on each mesh, the configs' own settings", "",
             HEADER[0].format("config, mesh"), HEADER[1]]
    lines += [_row(r, f"{r['config']}, {r['mesh_name']}") for r in results["sizes"]]
    lines += ["", f"### Recomputation policies (`{results['remat'][0]['config']}`, fsdp 8, "
              "scanned blocks)", "", HEADER[0].format("--model.remat"), HEADER[1]]
    lines += [_row(r, r["remat"]) for r in results["remat"]]
    step, grads = results["sizes"][0], results["grads_only"]
    total, _ = _collectives(step)
    without, _ = _collectives(grads)
    lines += ["", f"The optimizer's share of `{step['config']}`'s collectives on fsdp 8: "
              f"{total:.2f}x the parameter bytes with the update, {without:.2f}x without "
              f"(**{(total - without) / total:.1%}**).", "",
              f"### Compile time, `{results['compile'][0]['config']}` on fsdp 8", "",
              "| blocks | compile | peak per device |", "|---|---|---|"]
    lines += [f"| {'scanned' if r['scan_layers'] else 'unrolled'} | **{r['compile_s']:.0f} s** | "
              f"{r['peak_bytes'] / GIB:.2f} GiB |" for r in results["compile"]]
    scanned, unrolled = results["compile"]
    lines.append(f"\nScanned ÷ unrolled compile time: "
                 f"**{scanned['compile_s'] / unrolled['compile_s']:.2f}**. (XLA:CPU schedules "
                 "the recomputation of unrolled blocks together with the forward pass, so there "
                 "recomputing saves no memory; a scan's backward loop recomputes one block at a "
                 "time.)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test config only")
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    assert jax.device_count() == 8, jax.devices()
    try:
        results = run(args.quick)
    finally:
        shutil.rmtree(DUMP_DIR, ignore_errors=True)
    provenance.publish(args, BLOCK, markdown(results), results)


if __name__ == "__main__":
    main()
