"""Launch the paper's 18 runs (arXiv 2608.22253, Table 3), or any subset, one after another on
one node.

    python -m examples.lm.tools.paper_runs --data.source /data/fineweb100B --root runs/paper
    python -m examples.lm.tools.paper_runs --sizes 190m --heads adamw rownorm --seeds 0 \
        --data.source /data/fineweb100B --root runs/paper
    python -m examples.lm.tools.paper_runs --dry-run --data.source /data/fineweb100B \
        --root runs/paper                                   # print the commands only

Each run is `python -m examples.lm.train --config SIZE --head HEAD --seed SEED --workdir
ROOT/SIZE-HEAD-seedSEED --data.source DATA --no-progress` in a process of its own, using every
accelerator of the node (the config's mesh: data parallel over all devices). Rerunning the same
command resumes an interrupted run from its latest checkpoint and reports a finished one
without training it again (the trainer's own resumption). Arguments after `--` go to every run
unchanged (e.g. `-- --mesh.fsdp 8`). A SIGTERM to this command (a preemption notice; in a
container it is often process 1, the only one the notice reaches) is passed on to the run in
progress, which saves a checkpoint of its step and exits; no further run starts, and rerunning
the same command resumes it. The runs' metrics.jsonl are what a table of Table 3's
layout is built from: the record of the last update holds val_loss, head_step_diameter and
head_step_hilbert_rms.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import signal
import subprocess
import sys

from examples.lm import configs

SEEDS = (0, 1, 2)


def run_name(size: str, head: str, seed: int) -> str:
    """The workdir name of one run under `--root`: `190m-rownorm-seed0`."""
    return f"{size}-{head}-seed{seed}"


def commands(*, sizes, heads, seeds, root: str, data_source: str,
             extra=()) -> list[list[str]]:
    """The trainer's command line of every (size, head, seed), sizes outermost."""
    out = []
    for size, head, seed in itertools.product(sizes, heads, seeds):
        command = [sys.executable, "-m", "examples.lm.train", "--config", size, "--head", head,
                   "--seed", str(seed), "--workdir", os.path.join(root, run_name(size, head,
                                                                                 seed)),
                   "--no-progress", "--data.source", data_source]
        out.append(command + list(extra))
    return out


def parser() -> argparse.ArgumentParser:
    out = configs.Parser(prog="paper_runs.py", description=__doc__.split("\n\n")[0])
    out.add_argument("--sizes", nargs="+", default=list(configs.PAPER_MODELS),
                     choices=list(configs.PAPER_MODELS), help="default: all three")
    out.add_argument("--heads", nargs="+", default=list(configs.PAPER_HEADS),
                     choices=list(configs.PAPER_HEADS), help="default: both")
    out.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                     help="default: 0 1 2 (the paper's)")
    out.add_argument("--root", required=True, metavar="DIR",
                     help="one workdir per run under it (local or gs://)")
    # Required: without it each run would train on the standard library's text.
    out.add_argument("--data.source", dest="data_source", required=True, metavar="PATH",
                     help="the paper's corpus, GPT-2-tokenised FineWeb100B shards in llm.c's "
                          ".bin format, passed to every run")
    out.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    args = parser().parse_args(own)
    todo = commands(sizes=args.sizes, heads=args.heads, seeds=args.seeds, root=args.root,
                    data_source=args.data_source, extra=extra)
    for i, command in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {shlex.join(command)}", flush=True)
        if args.dry_run:
            continue
        returncode, preempted = _run(command)
        if returncode:
            print(f"paper_runs.py: run {i} exited with status {returncode}; rerun the "
                  "same command to resume it", file=sys.stderr)
            return returncode
        if preempted:  # the run saved its step and exited 0, as the trainer does on SIGTERM
            print(f"paper_runs.py: preempted (SIGTERM) during run {i}, which saved a checkpoint; "
                  "rerun the same command to resume it", flush=True)
            return 0
    return 0


def _run(command: list[str]) -> tuple[int, bool]:
    """(exit status, whether a SIGTERM came) of `command`. A SIGTERM this process gets is
    passed on to it; a run that also gets one from its process group sees two, which the
    trainer takes as one."""
    signalled: list[int] = []
    children: list[subprocess.Popen] = []

    def forward(signum, frame):
        signalled.append(signum)
        for child in children:
            child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        children.append(subprocess.Popen(command))
        if signalled:  # it came while the run was starting
            children[0].send_signal(signal.SIGTERM)
        return children[0].wait(), bool(signalled)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
