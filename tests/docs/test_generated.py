"""Generated documentation: what a benchmark or a study wrote stays what it wrote.

- Each block of docs/benchmarks.md that a benchmark writes (`benchmarks/provenance.py`,
  ``--docs``) is on the page once, and starts with the provenance header of a script that writes
  it (command, date, commit, machine, load), followed by a table.
- docs/results/oracle_table.md is what `studies/oracle_table.py` renders from the
  docs/results/oracle_table.json next to it.
"""

from __future__ import annotations

import ast
import itertools
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks"
GENERATED = re.compile(r"<!-- ([\w-]+):start -->\n(.*?)\n<!-- \1:end -->", re.S)


@pytest.fixture(scope="module")
def provenance():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import provenance
    finally:
        sys.path.remove(str(BENCHMARKS))
    return provenance


def _constant(script: str, name: str):
    """A module-level constant of a benchmark script, read without importing it (they set
    XLA_FLAGS and import JAX at import time)."""
    for node in ast.parse((BENCHMARKS / script).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{script} has no {name}")


def _owners() -> dict[str, set[str]]:
    """Generated block name -> the scripts whose ``--docs`` write it: run_all.py writes its
    outer block and one block per section; a script with a ``BLOCK`` writes that block."""
    owners: dict[str, set[str]] = {_constant("run_all.py", "OUTER_BLOCK"): {"run_all.py"}}
    for section in _constant("run_all.py", "SECTIONS"):
        owners[section] = {"run_all.py"}
    for path in sorted(BENCHMARKS.glob("bench_*.py")):
        if "BLOCK = " in path.read_text():
            owners.setdefault(_constant(path.name, "BLOCK"), set()).add(path.name)
    return owners


def _blocks(text: str) -> dict[str, str]:
    """Every generated block of a page, nested ones included: name -> its text."""
    found, todo = {}, [text]
    while todo:
        for name, body in GENERATED.findall(todo.pop()):
            assert name not in found, f"two {name} blocks"
            found[name] = body
            todo.append(body)
    return found


def _table(body: str) -> list[list[str]]:
    """The rows of the first markdown table of a block (header first), each a list of cells."""
    lines = body.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(?:-+\|)+", lines[i + 1].replace(" ", "")):
            rows = [line, *itertools.takewhile(lambda r: r.startswith("|"), lines[i + 2:])]
            return [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    return []


def test_every_benchmark_block_is_on_the_page_once():
    text = (DOCS / "benchmarks.md").read_text()
    owners = _owners()
    for name in owners:
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        assert text.count(start) == text.count(end) == 1, name
    stale = set(re.findall(r"<!-- ([\w-]+):(?:start|begin) -->", text)) - set(owners)
    assert not stale, f"generated blocks no benchmark writes: {stale}"
    outer = _blocks(text)[_constant("run_all.py", "OUTER_BLOCK")]
    assert list(dict(GENERATED.findall(outer))) == list(_constant("run_all.py", "SECTIONS"))


def test_every_generated_block_has_its_provenance_and_a_table(provenance):
    owners = _owners()
    for name, body in _blocks((DOCS / "benchmarks.md").read_text()).items():
        if name == _constant("run_all.py", "OUTER_BLOCK"):
            continue  # made of the section blocks, each checked here
        header = provenance.parse_header(body.splitlines()[0])
        assert header, f"block {name} does not start with a provenance header: {body[:200]}"
        script = re.match(r"python benchmarks/(\w+\.py)\b", header["command"])
        assert script and script.group(1) in owners[name] | {f"bench_{name}.py"}, (name, header)
        assert (BENCHMARKS / script.group(1)).exists(), header["command"]
        rows = _table(body)
        assert len(rows) >= 2, f"block {name} holds no table"
        assert all(len(r) == len(rows[0]) for r in rows), f"block {name}: ragged table"


def test_provenance_header_reads_back(provenance):
    env = dict(date="2026-01-02 03:04 UTC", commit="0123abcd+changes", cores=2,
               processor="Some CPU (rev 2), 3 GHz", platform="Linux x86_64", jax="0.10.2",
               optax="0.2.8", backend="cpu", devices=8, load_before="1.0 2.5 10.3")
    got = provenance.parse_header(provenance.header("python benchmarks/x.py --docs",
                                                    provenance.finish(env)))
    assert got and got["commit"] == env["commit"] and got["processor"] == env["processor"]
    assert got["devices"] == "8" and got["load_before"] == env["load_before"]
    assert provenance.parse_header("Run 2026-11-30 15:27 UTC on x86_64 Linux") is None


def test_oracle_table_page_is_what_its_study_renders_from_its_json():
    from studies import oracle_table

    results = DOCS / "results"
    table = json.loads((results / "oracle_table.json").read_text())
    assert (results / "oracle_table.md").read_text() == oracle_table.markdown(table), (
        "docs/results/oracle_table.md is not what its JSON renders: "
        "rerun `python -m studies.oracle_table`")
