"""The example's train step compiled for TPU and GPU targets by their own compilers, on a CPU host.

Every number is `python -m examples.lm.tools.topology`'s reading of the compiled step
(`examples/lm/tools/topology.py`): the paper's configs `190m`, `380m` and `640m` (256 x 2,048 per
update; `configs.paper_config`), FSDP over the target's devices, compiled by libtpu for a v5e-8
slice and by XLA:GPU for a node of eight H200s (compile-only devices: nothing is allocated,
nothing runs). Where the paper's micro-batch does not fit, the first micro-batch /
accumulation / recomputation of `train_compile.SPLIT_CANDIDATES` that does is compiled instead
(`topology.fit_train_step`, as `train_compile --topology` does), keeping 256 sequences per
update. Per
device: the peak memory (arguments + outputs + temporaries - donated) against the budget (a
v5e chip's HBM; the three quarters of an H200's memory that JAX preallocates), matmul FLOPs
against the model's count (6N + attention: the recomputation's cost), collective bytes against
the parameter bytes, and the compile time (of the step shown; the search's, all compiles).

    python benchmarks/bench_targets.py            # 190m, 380m and 640m on v5e-8 and h200-8
    python benchmarks/bench_targets.py --quick    # the test config
    python benchmarks/bench_targets.py --docs     # also rewrite its block of docs/benchmarks.md

Needs both compilers (docs/guides/targets.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import provenance  # noqa: E402  (beside this script)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.lm import configs  # noqa: E402
from examples.lm.tools import topology  # noqa: E402

BLOCK = "targets"
COMMAND = "python benchmarks/bench_targets.py"
TARGETS = ("v5e-8", "h200-8")
GIB = 2**30


def run(names: list[str]) -> dict:
    env = provenance.environment(provenance.load_average())
    start = time.perf_counter()
    rows = []
    for name in names:
        for target_name in TARGETS:
            target = topology.get_target(target_name)
            print(f"== {name} on {target_name}", flush=True)
            begin = time.perf_counter()
            result = topology.fit_train_step(configs.get_config(name), target,
                                             print_fn=lambda line: print(line, flush=True))
            result["search_s"] = time.perf_counter() - begin
            print(topology.format_report(result, name=name), flush=True)
            result.pop("hlo", None)
            rows.append(dict(config=name, **result))
    return {"rows": rows, "environment": provenance.finish(env) | {
        "total_s": time.perf_counter() - start}}


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / 2**20:.1f} MiB"


def markdown(results: dict, command: str) -> str:
    env = results["environment"]
    lines = [provenance.header(command, env), "",
             f"{env['total_s']:.0f} s in all. Each step compiled by the target's own compiler "
             "on this CPU host; per device.", "",
             "| config | target | micro-batch per device x accumulation, remat | peak memory | "
             "budget | fits | matmul FLOPs ÷ model's | collectives ÷ parameter bytes | "
             "compile time (all compiles) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        kinds = ", ".join(f"{k} {v / r['param_bytes']:.2f}x"
                          for k, v in r["collectives"].items() if v)
        total = sum(r["collectives"].values()) / r["param_bytes"]
        budget = _size(r["budget"]) + ("" if r["platform"] == "tpu" else
                                       f" (of {_size(r['device_memory'])})")
        split = r["split"]
        chosen = ""
        if split["chosen"]:
            chosen = (f" (chosen: the paper's {r['as_configured']['batch'] // split['ranks']}"
                      f" x {r['as_configured']['grad_accum_steps']} needs "
                      f"{_size(r['as_configured']['peak_bytes'])})")
        lines.append(
            f"| `{r['config']}` | {r['target']} ({r['devices']} x {r['device_kind']}) | "
            f"{split['sequences_per_rank']} x {split['grad_accum_steps']}, "
            f"{split['remat']}{chosen} | "
            f"**{_size(r['peak_bytes'])}** (temporaries {_size(r['memory']['temporaries'])}) | "
            f"{budget} | "
            f"{'yes' if r['fits'] else 'no'} | {r['matmul_flops'] / r['model_flops']:.2f}x | "
            f"{total:.2f}x ({kinds}) | {r['compile_s']:.0f} s ({r['search_s']:.0f} s) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test config only")
    parser.add_argument("--configs", nargs="+", default=list(configs.PAPER_MODELS),
                        help="configs to compile (default: the paper's)")
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    try:
        for platform in ("tpu", "cuda"):
            topology.check_compiler(platform)
    except topology.CompilerMissing as e:
        raise SystemExit(f"bench_targets.py: {e}") from None
    topology.prepare("tpu")
    names = ["test"] if args.quick else args.configs
    results = run(names)
    command = COMMAND + (" --quick" if args.quick else
                         "" if names == list(configs.PAPER_MODELS) else
                         " --configs " + " ".join(names)) + " --docs"
    provenance.publish(args, BLOCK, markdown(results, command), results)


if __name__ == "__main__":
    main()
