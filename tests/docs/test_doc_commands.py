"""Every example command the pages show runs as shown (README.md, CONTRIBUTING.md,
examples/lm/README.md, docs/**/*.md).

`_doc_extract.example_commands` reads each `python -m examples.lm.train` / `python -m
examples.lm.prepare` command out of the pages' shell blocks; a mention it cannot read as a
command fails `test_every_shown_command_is_read_and_parses`, so a new command is never silently
unchecked. Each command is then run with the real command line (`train.main(argv)`,
`prepare.main(argv)`), rewritten only where the test's machine differs from the user's:

- the `test` config (`--config X` becomes `--config test`; a fresh run without `--config` gets
  it), and 2 steps: the distinct `--steps` values of a block become 2, 3, ... in their order, so a
  resume with a longer horizon stays one;
- every path lives in a fresh directory per block: commands of one block that name the same
  workdir share it, a `gs://` checkpoint directory becomes a local one, `~/` and `/` paths are
  taken relative to the block's directory;
- paths a command reads and no earlier command of its block wrote are generated in the layout the
  command expects: llm.c / modded-nanogpt shards for a `*.bin` glob, the `prepare` command's
  output for a shard directory, a `tokenizer.json`, a text directory or a `.jsonl` file;
- without `--data.source` the corpus is a small copy of standard-library modules (the default,
  the whole standard library, would take minutes to tokenize), with a shared token cache;
- `--no-progress`.

A command that names a `--mesh.*` flag runs on 8 simulated CPU devices: all of them in one
subprocess (`XLA_FLAGS` must be set before jax is imported). CONTRIBUTING's crash reproduction
runs as documented (killed while checkpoint 4 is written, then resumed from 2).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _doc_extract import ROOT, Command, command_pages, example_commands
from _lm_fixtures import make_tokenizer, write_llmc_shard

from examples.lm import configs, flags

pytestmark = pytest.mark.usefixtures("fast_compile")

MESH_DEVICES = 8
TOKENIZER_VOCAB = 300  # generated tokenizer.json files: padded to 384 rows by the trainer
SHARD_TOKENS = 4096  # per generated llm.c shard: several batches of the test config


def _all_commands() -> tuple[list[Command], list[str]]:
    commands, problems = [], []
    for page in command_pages():
        found, trouble = example_commands(page)
        commands += found
        problems += trouble
    return commands, problems


COMMANDS, PROBLEMS = _all_commands()


# ----------------------------------------------------------------------------- the rewrite


def _local(path: str) -> str:
    """A path the page shows, as a path relative to the block's directory."""
    for prefix, into in (("gs://", "gs/"), ("~/", "home/"), ("/", "root/")):
        if path.startswith(prefix):
            return into + path[len(prefix):]
    return path


@dataclasses.dataclass
class Fixture:
    kind: str  # "corpus", "jsonl", "tokenizer", "llmc", "shards"
    path: str  # relative to the block's directory (a glob for "llmc")
    tokenizer: str | None = None  # "shards": encode with this tokenizer.json


@dataclasses.dataclass
class Run:
    command: Command
    argv: list[str]  # rewritten; paths relative to the block's directory
    mesh: bool
    steps: int | None = None  # train: the horizon the run must end at
    workdir: str | None = None
    checkpoint_dir: str | None = None
    fixtures: list[Fixture] = dataclasses.field(default_factory=list)


def _set(argv: list[str], name: str, value: str) -> list[str]:
    """`argv` with `--name value` (replacing `--name V` and `--name=V`)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == f"--{name}":
            i += 2
            continue
        if argv[i].startswith(f"--{name}="):
            i += 1
            continue
        out.append(argv[i])
        i += 1
    return [*out, f"--{name}", value]


def _source_fixture(source: str, tokenizer: str | None) -> Fixture:
    """What a `--data.source` path the block did not write must hold."""
    if "*" in source or source.endswith(".bin"):
        return Fixture("llmc", source)
    if source.endswith(".jsonl"):
        return Fixture("jsonl", source)
    if source.endswith((".txt", ".py")):
        raise ValueError(f"--data.source {source}: a single text file; add a fixture kind")
    return Fixture("shards", source, tokenizer)


def plan_block(commands: list[Command]) -> list[Run]:
    """The rewritten runs of one block's commands (see the module docstring)."""
    horizons = list(dict.fromkeys(c.flag("steps") for c in commands if c.flag("steps")))
    new_steps = {value: 2 + i for i, value in enumerate(horizons)}
    written: set[str] = set()  # paths an earlier command of the block writes
    horizon_of: dict[str, int] = {}  # workdir -> the horizon of its run
    runs = []
    for c in commands:
        argv = list(c.argv)
        mesh = any(f.startswith("mesh.") for f in c.flags())
        if c.program == "prepare":
            runs.append(_plan_prepare(c, argv, written))
            continue
        run = Run(c, argv, mesh)
        if c.program == "crash-trainer":
            run.argv = _set(argv, "workdir", _local(c.flag("workdir") or "runs/test"))
            runs.append(run)
            continue
        config = c.flag("config")
        workdir = _local(c.flag("workdir") or f"runs/{config or configs.DEFAULT_CONFIG}")
        fresh = workdir not in horizon_of
        argv = _set(argv, "workdir", workdir)
        if config is not None or fresh:
            argv = _set(argv, "config", "test")
        if c.flag("steps") is not None:
            argv = _set(argv, "steps", str(new_steps[c.flag("steps")]))
        elif fresh:
            argv = _set(argv, "steps", "2")
        run.steps = (new_steps[c.flag("steps")] if c.flag("steps") is not None
                     else horizon_of.get(workdir, 2))
        horizon_of[workdir] = run.steps
        run.workdir = workdir
        tokenizer = c.flag("data.tokenizer")
        if tokenizer is not None:
            argv = _set(argv, "data.tokenizer", _local(tokenizer))
            if _local(tokenizer) not in written:
                run.fixtures.append(Fixture("tokenizer", _local(tokenizer)))
        source = c.flag("data.source")
        if source is not None:
            argv = _set(argv, "data.source", _local(source))
            if _local(source).rstrip("/") not in written:
                run.fixtures.append(_source_fixture(
                    _local(source), None if tokenizer is None else _local(tokenizer)))
        if c.flag("checkpoint.dir") is not None:
            run.checkpoint_dir = _local(c.flag("checkpoint.dir"))
            argv = _set(argv, "checkpoint.dir", run.checkpoint_dir)
        if "--no-progress" not in argv:
            argv.append("--no-progress")
        run.argv = argv
        written.add(workdir)
        runs.append(run)
    return runs


def _plan_prepare(c: Command, argv: list[str], written: set[str]) -> Run:
    run = Run(c, [], mesh=False)
    options = {"--out", "--tokenizer", "--vocab_size", "--val_fraction", "--shard_tokens"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--out", "--tokenizer"):
            path = _local(argv[i + 1])
            if arg == "--tokenizer" and path not in written:
                run.fixtures.append(Fixture("tokenizer", path))
            if arg == "--out":
                written.update({path.rstrip("/"), f"{path.rstrip('/')}/tokenizer.json"})
            run.argv += [arg, path]
            i += 2
        elif arg in options:
            run.argv += argv[i:i + 2]
            i += 2
        elif arg.startswith("--"):
            run.argv.append(arg)
            i += 1
        else:  # a source: text or jsonl files, a directory or a glob of them
            path = _local(arg)
            if path not in written:
                run.fixtures.append(Fixture("jsonl" if path.endswith(".jsonl") else "corpus",
                                            path))
            run.argv.append(path)
            i += 1
    if "--no-progress" not in run.argv:
        run.argv.append("--no-progress")
    return run


def _blocks() -> dict[tuple[str, int], list[Command]]:
    out: dict[tuple[str, int], list[Command]] = {}
    for c in COMMANDS:
        out.setdefault((c.page, c.index), []).append(c)
    return out


BLOCKS = _blocks()
PLANS = {key: plan_block(cmds) for key, cmds in BLOCKS.items()}


def _shown(key) -> tuple:
    return tuple((r.command.program, r.command.argv, r.command.env) for r in PLANS[key])


# A block shown on several pages (the default command, the mesh examples) runs once.
DISTINCT = list({_shown(key): key for key in reversed(PLANS)}.values())[::-1]
CRASH = [key for key in DISTINCT
         if any(r.command.program == "crash-trainer" for r in PLANS[key])]
MESH = [key for key in DISTINCT if key not in CRASH and any(r.mesh for r in PLANS[key])]
IN_PROCESS = [key for key in DISTINCT if key not in CRASH + MESH]


def _block_id(key) -> str:
    page, index = key
    return f"{page}:{PLANS[key][0].command.line}"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def shared(tmp_path_factory, small_corpus):
    """A small text corpus with the test config's token cache, and a generated tokenizer."""
    root = small_corpus(tmp_path_factory.mktemp("doc-commands"), tokenize=True)
    texts = [p.read_text() for p in sorted((root / "corpus").glob("*.py"))]
    make_tokenizer(root / "tokenizer.json", texts, vocab_size=TOKENIZER_VOCAB)
    return root


def _token_ids(n: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n)


def make_fixture(fixture: Fixture, block: Path, shared: Path) -> None:
    """Write `fixture` under `block` in the layout its command expects."""
    from examples.lm import prepare

    target = block / fixture.path
    if fixture.kind == "tokenizer":
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared / "tokenizer.json", target)
    elif fixture.kind == "corpus":
        shutil.copytree(shared / "corpus", target)
    elif fixture.kind == "jsonl":
        target.parent.mkdir(parents=True, exist_ok=True)
        docs = [p.read_text() for p in sorted((shared / "corpus").glob("*.py"))[:6]]
        target.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif fixture.kind == "llmc":  # e.g. fineweb10B/*.bin: fineweb10B/fineweb_{train,val}_*.bin
        directory, pattern = os.path.split(fixture.path)
        stem = pattern.replace("*", "{}").replace(".bin", "") if "*" in pattern else None
        (block / directory).mkdir(parents=True, exist_ok=True)
        for i, split in enumerate(("val", "train", "train")):
            name = (stem.format(f"{split}_{i:06d}") + ".bin" if stem
                    else pattern.replace(".bin", f"_{split}_{i:06d}.bin"))
            write_llmc_shard(block / directory / name,
                             _token_ids(SHARD_TOKENS, TOKENIZER_VOCAB, seed=i).tolist())
    elif fixture.kind == "shards":  # what `python -m examples.lm.prepare` writes
        prepare.prepare([shared / "corpus"], target, vocab_size=TOKENIZER_VOCAB,
                        tokenizer=None if fixture.tokenizer is None else block / fixture.tokenizer,
                        progress=False)
    else:
        raise AssertionError(f"unknown fixture kind {fixture.kind}")


def _data_flags(run: Run, shared: Path) -> list[str]:
    """The shared small corpus for a train run that reads the default (stdlib) corpus."""
    if run.command.program == "prepare" or run.command.flag("data.source") is not None:
        return []
    return ["--data.source", str(shared / "corpus"), "--data.dir", str(shared / "tokens")]


def _prepared(key, tmp_path: Path, shared: Path) -> tuple[Path, list[tuple[Run, list[str]]]]:
    block = tmp_path / re.sub(r"\W+", "_", _block_id(key))
    block.mkdir(parents=True)
    out = []
    for run in PLANS[key]:
        for fixture in run.fixtures:
            make_fixture(fixture, block, shared)
        out.append((run, run.argv + _data_flags(run, shared)))
    return block, out


def check_train_result(run: Run, block: Path, record: dict) -> None:
    where = f"{run.command.where} `{' '.join(run.command.argv)}`"
    assert record["step"] == run.steps, f"{where}: ended at step {record['step']}, not {run.steps}"
    assert np.isfinite(record["val_loss"]), where
    assert (block / run.workdir / "metrics.jsonl").exists(), where
    if run.checkpoint_dir is not None:
        steps = [int(p.name) for p in (block / run.checkpoint_dir).iterdir() if p.name.isdigit()]
        assert run.steps in steps, f"{where}: no checkpoint {run.steps} in --checkpoint.dir"


# ----------------------------------------------------------------------------- tests


def test_every_shown_command_is_read_and_parses():
    """Every mention is read as a command, every command parses with the real command line, and
    every path it reads can be generated."""
    assert not PROBLEMS, "\n".join(PROBLEMS)
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "CONTRIBUTING.md", "examples/lm/README.md"} <= pages
    train_parser = flags.parser()
    for key, runs in PLANS.items():
        assert len({r.mesh for r in runs}) == 1 or key in CRASH, (
            f"{_block_id(key)} mixes mesh and single-device commands: split the block")
        for run in runs:
            c = run.command
            if c.program == "prepare":
                continue
            for argv in (list(c.argv), run.argv):  # as shown, and as the test runs it
                try:
                    args = train_parser.parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{c.where}: `{' '.join(argv)}` does not parse")
                flags.config_from_args(args)  # a bad value raises ValueError naming the flag
    assert len(COMMANDS) >= 20


@pytest.mark.slow
@pytest.mark.parametrize("key", IN_PROCESS, ids=[_block_id(k) for k in IN_PROCESS])
def test_block_runs_as_shown(key, tmp_path, shared, monkeypatch, capsys):
    from examples.lm import prepare, train

    block, runs = _prepared(key, tmp_path, shared)
    monkeypatch.chdir(block)
    for run, argv in runs:
        main = prepare.main if run.command.program == "prepare" else train.main
        try:
            result = main(argv)
        except SystemExit as exit_:
            err = capsys.readouterr().err
            pytest.fail(f"{run.command.where}: `{' '.join(argv)}` exited {exit_.code}:\n{err}")
        if run.command.program == "prepare":
            assert result["train"]["tokens"] > 0 and result["val"]["tokens"] > 0
        else:
            check_train_result(run, block, result)


MESH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax
    jax.config.update("jax_disable_most_optimizations", True)
    assert jax.device_count() == {devices}, jax.devices()
    from examples.lm import train
    out = []
    for cwd, argv in json.loads(sys.argv[1]):
        os.chdir(cwd)
        try:
            record = train.main(argv)
        except SystemExit as e:
            out.append({{"exit": e.code}})
            continue
        out.append({{"step": record["step"], "val_loss": record["val_loss"]}})
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.timeout(600)  # its subprocess has 540 s
def test_mesh_commands_run_on_8_devices(tmp_path, shared):
    """All mesh commands in one process with 8 simulated devices."""
    jobs, checks = [], []
    for key in MESH:
        block, runs = _prepared(key, tmp_path, shared)
        for run, argv in runs:
            jobs.append((str(block), argv))
            checks.append((run, block))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={MESH_DEVICES}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT.format(devices=MESH_DEVICES),
                           json.dumps(jobs)], capture_output=True, text=True, timeout=540,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (run, block), result in zip(checks, results, strict=True):
        assert "exit" not in result, (
            f"{run.command.where}: `{' '.join(run.command.argv)}` exited {result['exit']}\n"
            f"{proc.stdout[-3000:]}")
        check_train_result(run, block, {**result})
    assert len(jobs) >= 5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_crash_reproduction_runs_as_documented(tmp_path, shared):
    """CONTRIBUTING: killed (137) with checkpoint 2 finalized and 4 half-written; the same
    command without ROWGEOM_TEST_KILL resumes from 2 and finishes."""
    (key,) = CRASH
    (run,) = PLANS[key]
    wrapper = ROOT / run.command.script  # the script the page names
    spec = importlib.util.spec_from_file_location("_crash_trainer", wrapper)
    crash_trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crash_trainer)
    block = tmp_path / "crash"
    block.mkdir()
    argv = [sys.executable, str(wrapper), *run.argv,
            *(["--data.source", str(shared / "corpus"), "--data.dir", str(shared / "tokens")])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    ckdir = block / _local(run.command.flag("workdir")) / "checkpoints"
    killed = subprocess.run(argv, env={**env, **dict(run.command.env)}, cwd=block,
                            capture_output=True, text=True, timeout=240)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])  # shell: 137
    finalized = sorted(int(p.name) for p in ckdir.iterdir() if p.name.isdigit())
    assert finalized == [2] and crash_trainer.unfinalized_steps(ckdir) == {4}, (
        finalized, list(ckdir.iterdir()))
    resumed = subprocess.run(argv, env=env, cwd=block, capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout, resumed.stdout[-3000:]
    steps = int(run.command.flag("steps"))
    assert re.search(rf"final step {steps}:", resumed.stdout), resumed.stdout[-3000:]


def test_the_runs_cover_every_command():
    """Every block is run by one of the tests above, or is identical to one that is."""
    run = {_shown(key) for key in IN_PROCESS + MESH + CRASH}
    assert all(_shown(key) in run for key in PLANS)
    assert len(IN_PROCESS + MESH + CRASH) == len(DISTINCT)
