"""Numbers the pages quote from result and benchmark files agree with those files.

- docs/results/oracle_table.json: the geometry page's instance counts, ranges and ratios;
- docs/results/head_study.json: the learning-rate guide's sweep, the chosen head rates and
  `rowgeom.HEAD_LR_MULTIPLIERS`;
- the example's README: its configs' parameter counts and validation-set sizes, from the code.

Each check formats the value from the file as the page writes it and looks for the sentence, so
a rerun that changes a number fails here until the page says the new one.

Timings, ratios and counts are never typed: each benchmark writes its own generated block of
docs/benchmarks.md (`benchmarks/provenance.py`), and the tests here check that every block of the
current benchmark set is there and parses (command, date, commit, machine, load, a table), and
that no page types a measurement outside such a block.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import sys

import numpy as np
import pytest
from _doc_extract import FENCE, ROOT

import rowgeom

DOCS = ROOT / "docs"


def _page(name: str) -> str:
    """The page's text with line breaks folded into spaces (quotes may wrap)."""
    return " ".join((DOCS / name).read_text().split())


def _assert_quotes(page: str, *phrases: str) -> None:
    text = _page(page)
    missing = [p for p in phrases if " ".join(p.split()) not in text]
    assert not missing, f"{page} does not say (from the result file): {missing}"


# ----------------------------------------------------------------------------- oracle table


@pytest.fixture(scope="module")
def oracle():
    return json.loads((DOCS / "results" / "oracle_table.json").read_text())


def test_oracle_table_numbers_on_the_geometry_page(oracle):
    instances = oracle["instances"]
    random = [i for i in instances if i["structure"] != "regular simplex"]
    ratio = lambda rows, method: [r["ratio"][method] for r in rows]  # noqa: E731
    span = lambda values: f"{min(values):.4f}–{max(values):.4f}"  # noqa: E731
    rownorm = ratio(instances, "rownorm")
    assert all(r >= i["bound"] * (1 - 1e-6) for r, i in zip(rownorm, instances, strict=True))
    largest = max(i["diameter"]["rownorm"] for i in instances) / oracle["rho"]
    assert f"{largest:.6f}" == "1.000000"  # "the largest D(S*) was rho to six digits"
    v = [i["V"] for i in instances]
    d = [i["d"] for i in instances]
    structures = {i["structure"] for i in random}
    rank1 = [i for i in random if i["structure"] == "rank 1"]
    _assert_quotes(
        "geometry.md",
        f"On the {len(instances)} exactly solved instances of the [oracle table]",
        f"(\\(V\\) {min(v)}..{max(v)}, \\(d\\) {min(d)}..{max(d)}, {len(structures)} random "
        "gradient structures and the regular simplex)",
        f"the ratio ranged over \\([{min(rownorm):.4f}, {max(rownorm):.4f}]\\), never below the "
        "bound, and the largest \\(D(S^\\star)\\) was \\(\\rho\\) to six digits",
        f"reached {span(ratio(random, 'muon'))} of the exact optimum",
        f"({span(ratio(rank1, 'muon'))} on rank-1 gradients)",
        f"projected RowNorm {span(ratio(random, 'rownorm'))}",
        f"its worst ratio to \\(\\mathrm{{OPT}}\\) was {min(ratio(random, 'rownorm_rescaled')):.4f}"
        f", against {min(ratio(random, 'rownorm')):.4f} for the plain step",
    )


# ----------------------------------------------------------------------------- head study


@pytest.fixture(scope="module")
def study():
    return json.loads((DOCS / "results" / "head_study.json").read_text())


def _sweep(study, head) -> dict[float, float]:
    return {r["head_learning_rate"]: r["final_val_loss"] for r in study["runs"]
            if r["role"] == "sweep" and r["head"] == head}


def test_head_study_numbers_on_the_learning_rate_guide(study):
    cfg, chosen = study["config"], study["chosen_head_learning_rates"]

    def listed(values, sep, last):
        return sep.join(values[:-1]) + last + values[-1]

    def quoted(head, grid, sep, last):
        bold = lambda lr, text: f"**{text}**" if lr == chosen[head] else text  # noqa: E731
        return (listed([bold(lr, f"{lr:g}") for lr in grid], sep, last),
                listed([bold(lr, f"{_sweep(study, head)[lr]:.4f}") for lr in grid], sep, last))

    rownorm_lrs, rownorm_losses = quoted("rownorm", study["sweep_grid"]["rownorm"], ", ",
                                         " and ")
    grid = [0.006, 0.018, 0.054]  # the AdamW / Muon rates the guide quotes
    adamw_lrs, adamw_losses = quoted("adamw", grid, " / ", " / ")
    _, muon_losses = quoted("muon", grid, " / ", " / ")
    sweep = _sweep(study, "rownorm")
    best = sweep[chosen["rownorm"]]
    costs = [round(sweep[lr] - best, 2) for lr in sweep if lr != chosen["rownorm"]]
    _assert_quotes(
        "guides/learning-rates.md",
        f"(\\(d = {cfg['d_model']}\\), \\(V = {cfg['vocab_size']}\\), base rate "
        f"{cfg['learning_rate']:g})",
        f"RowNorm head rates {rownorm_lrs} gave final validation losses {rownorm_losses}",
        f"the rescaled variant chose {chosen['rownorm-rescaled']:g} too",
        f"{adamw_lrs} gave {adamw_losses} for an AdamW head and {muon_losses} for a Muon head",
        f"the tuned RowNorm head rate was {chosen['rownorm'] / chosen['adamw']:.2f}× "
        f"({chosen['rownorm']:g} / {chosen['adamw']:g})",
        f"\\(d = {cfg['d_model']}\\), \\(V = {cfg['vocab_size']}\\), {cfg['steps']} steps",
        f"either way cost {min(costs):.2f}–{max(costs):.2f} nats",
    )


def test_head_lr_multipliers_are_the_head_studys_choice(study):
    base, chosen = study["config"]["learning_rate"], study["chosen_head_learning_rates"]
    for head, multiplier in rowgeom.HEAD_LR_MULTIPLIERS.items():
        assert multiplier == pytest.approx(chosen[head] / base), head
    m = rowgeom.HEAD_LR_MULTIPLIERS
    assert m["adamw"] == m["muon"]
    _assert_quotes("getting-started.md",
                   f"RowNorm {m['rownorm']:g}×, AdamW and Muon {m['adamw']:g}× the base rate")
    _assert_quotes("guides/learning-rates.md",
                   f"| `{m['rownorm']:g} · lr` | `{m['rownorm']:g} · lr` |",
                   f"| `{m['adamw']:g} · lr` | `{m['adamw']:g} · lr` |")


# ----------------------------------------------------------------------------- benchmarks

BENCHMARKS = ROOT / "benchmarks"
GENERATED = re.compile(r"<!-- ([\w-]+):start -->\n(.*?)\n<!-- \1:end -->", re.S)


def _constant(script: str, name: str):
    """A module-level constant of a benchmark script, read without importing it (they set
    XLA_FLAGS and import JAX at import time)."""
    tree = ast.parse((BENCHMARKS / script).read_text())
    for node in tree.body:
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
            rows = [line] + [r for r in itertools.takewhile(lambda r: r.startswith("|"),
                                                              lines[i + 2:])]
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


def test_every_generated_block_has_its_provenance_and_a_table():
    """Each block opens with the header of the run that wrote it (command, date, commit,
    machine, load) and holds a well-formed table; the command is a script that writes it."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import provenance
    finally:
        sys.path.remove(str(BENCHMARKS))
    owners = _owners()
    for name, body in _blocks((DOCS / "benchmarks.md").read_text()).items():
        if name == _constant("run_all.py", "OUTER_BLOCK"):
            continue  # made of the section blocks, each checked here
        header = provenance.parse_header(body.splitlines()[0])
        assert header, f"block {name} does not start with a provenance header: {body[:200]}"
        script = re.match(r"python benchmarks/(\w+\.py)\b", header["command"])
        assert script and script.group(1) in owners[name] | {f"bench_{name}.py"}, (name, header)
        assert (BENCHMARKS / script.group(1)).exists(), header["command"]
        assert int(header["cores"]) >= 1 and int(header["devices"]) >= 1, header
        rows = _table(body)
        assert len(rows) >= 2, f"block {name} holds no table"
        assert all(len(r) == len(rows[0]) for r in rows), f"block {name}: ragged table"


def test_provenance_header_reads_back():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import provenance
    finally:
        sys.path.remove(str(BENCHMARKS))
    env = dict(date="2026-01-02 03:04 UTC", commit="0123abcd+changes", cores=2,
               processor="Some CPU (rev 2), 3 GHz", platform="Linux x86_64", jax="0.10.2",
               optax="0.2.8", backend="cpu", devices=8, load_before="1.0 2.5 10.3")
    got = provenance.parse_header(provenance.header("python benchmarks/x.py --docs",
                                                    provenance.finish(env)))
    assert got and got["commit"] == env["commit"] and got["processor"] == env["processor"]
    assert got["devices"] == "8" and got["load_before"] == env["load_before"]
    assert provenance.parse_header("Run 2026-11-30 15:27 UTC on x86_64 Linux") is None


# ----------------------------------------------------------------------------- typed measurements

MEASURED_PAGES = sorted([*(DOCS.glob("*.md")), *(DOCS / "guides").glob("*.md"),
                         *(DOCS / "api").glob("*.md"), ROOT / "README.md",
                         ROOT / "examples" / "lm" / "README.md", ROOT / "CONTRIBUTING.md"])
_NUMBER = (r"(?<![\w.^])(?:\d+(?:[.,]\d+)*|\.\d+|(?:one|two|three|four|five|six|seven|eight|"
           r"nine|ten|twelve|fifteen|twenty|thirty|a few|several|tens of|a couple of)\b)")
_RANGE = rf"{_NUMBER}(?:\s*(?:–|-|to)\s*{_NUMBER})?"
# A number, then a unit of time, a ratio sign (not "V × d", a shape), a per cent sign or a count
# of tests or steps per second.
MEASUREMENT = re.compile(
        rf"(?:about |~|≈)?{_RANGE}\s*(?:(?:s|ms|µs|us|sec|seconds?|min|minutes?|h|hours?)\b(?!-)"
        r"|(?:×|x\b)(?!\s*(?:\d|\\\(|[A-Za-z]\b))|%|(?:times )?(?:faster|slower)\b"
        r"|tests\b|steps/s\b)",
        re.I)
# Not prose: generated blocks, HTML comments, maths and inline code; in fenced code only the
# comments are read, and program output (```text, which test_docs_output.py checks against the
# code) not at all.
_CUT = [GENERATED, re.compile(r"<!--.*?-->", re.S), re.compile(r"\$\$.*?\$\$|\\\[.*?\\\]", re.S),
        re.compile(r"\\\(.*?\\\)", re.S)]


def _comments(block: re.Match) -> str:
    """A fenced block reduced to its comments, line for line."""
    lines = block.group(0).split("\n")
    if block.group("lang") == "text":
        return "\n" * (len(lines) - 1)
    return "\n".join(line.split("#", 1)[1] if "#" in line else "" for line in lines)

# Values that read like measurements but are not (each one with why); the target is none typed.
NOT_MEASUREMENTS = {
    # Configuration: rowgeom.HEAD_LR_MULTIPLIERS, checked by test_head_lr_multipliers_...
    ("docs/getting-started.md", "5×"): "the RowNorm head's default rate multiplier",
    ("docs/getting-started.md", "3×"): "the AdamW / Muon heads' default rate multiplier",
    ("docs/guides/learning-rates.md", "5×"): "the RowNorm head's default rate multiplier",
    ("docs/guides/learning-rates.md", "3×"): "the AdamW / Muon heads' default rate multiplier",
    ("examples/lm/README.md", "5 ×"): "the RowNorm head's default rate multiplier",
    ("examples/lm/README.md", "3 ×"): "the AdamW / Muon heads' default rate multiplier",
    # Maths: the bracket's upper end 2 max_i ||s_i - s̄|| is at most twice D.
    ("docs/getting-started.md", "2×"): "the bracket's worst-case overshoot (a theorem)",
    ("docs/geometry.md", "2×"): "the bracket's worst-case overshoot (a theorem)",
    ("docs/guides/diagnostics.md", "2×"): "the bracket's worst-case overshoot (a theorem)",
    ("docs/guides/learning-rates.md", "2×"): "the bracket's worst-case overshoot (a theorem)",
    # A study's result, checked against docs/results/head_study.json by
    # test_head_study_numbers_on_the_learning_rate_guide, and the paper it is compared with.
    ("docs/guides/learning-rates.md", "1.67×"): "the head study's tuned-rate ratio (its JSON)",
}


def typed_measurements(text: str) -> list[tuple[int, str]]:
    """(line, text) of every measurement typed in a page's prose or code comments."""
    for pattern in _CUT:
        text = pattern.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = FENCE.sub(_comments, text)
    text = re.sub(r"`[^`\n]*`", "``", text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(0).strip())
            for m in MEASUREMENT.finditer(text)]


def _found() -> list[tuple[str, int, str]]:
    return [(str(page.relative_to(ROOT)), line, hit) for page in MEASURED_PAGES
            for line, hit in typed_measurements(page.read_text())]


def test_no_measurement_is_typed_outside_a_generated_block():
    """Timings, ratios, percentages and counts come from the command that measured them, in a
    generated block; prose points at the table instead."""
    typed = [f"{page}:{line}: {hit!r}" for page, line, hit in _found()
             if (page, hit) not in NOT_MEASUREMENTS]
    assert not typed, "typed measurements (generate them, or point at the table):\n" + "\n".join(
        typed)


def test_not_measurements_list_is_not_stale():
    used = {(page, hit) for page, _, hit in _found()}
    assert not set(NOT_MEASUREMENTS) - used, set(NOT_MEASUREMENTS) - used


def test_typed_measurement_finder():
    page = """Took 12.7 s, or about 5 minutes (~5 min); 2× faster, 0.84–0.96x, 26 %, 1170 tests.
A 50304 × 768 head, \\(2\\times 3\\), `timeout=300 s`, x = 3, one second-order cone, the
ones and tens are no measurements.

```bash
python run.py --steps 300   # several minutes on 2 cores
```

```text
step 0: 3.5 ms
```

<!-- lm-step:start -->
| 432 ms (1.00x) |
<!-- lm-step:end -->
"""
    hits = [hit for _, hit in typed_measurements(page)]
    assert hits == ["12.7 s", "about 5 minutes", "~5 min", "2×", "0.84–0.96x", "26 %",
                    "1170 tests", "several minutes"], hits


# ----------------------------------------------------------------------------- the example


def _count(n: int) -> str:
    """A parameter count as the example's README writes it: 53k, 1.5M, ≈193M."""
    if n < 1e6:
        return f"{n / 1e3:.0f}k"
    return f"{n / 1e6:.1f}M" if n < 1e8 else f"≈{n / 1e6:.0f}M"


def test_config_table_parameter_counts_match_the_models():
    import jax
    from flax import nnx

    from examples.lm import configs, model

    text = (ROOT / "examples" / "lm" / "README.md").read_text()
    for name in configs.CONFIGS:
        cfg = configs.get_config(name).model
        abstract = nnx.eval_shape(lambda cfg=cfg: model.Transformer(cfg, rngs=nnx.Rngs(0)))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
        assert f"| `{name}` | {_count(n)} |" in text, (name, _count(n))


def test_validation_set_sizes_in_the_example_readme():
    from examples.lm import configs

    tiny = configs.get_config("cpu-tiny").resolved_eval_tokens()
    gpu = {configs.get_config(n).resolved_eval_tokens() for n in ("190m", "380m", "640m")}
    assert len(gpu) == 1
    (gpu_tokens,) = gpu
    text = " ".join((ROOT / "examples" / "lm" / "README.md").read_text().split())
    assert (f"{tiny} tokens in cpu-tiny, {gpu_tokens / 1e6:.1f}M in the GPU configs") in text


# ----------------------------------------------------------------------------- contributing


def test_contributing_lists_every_file_with_a_longer_timeout():
    """CONTRIBUTING.md's Timeouts list names exactly the test files that raise the timeout."""
    mark = re.compile(r"^[^\"'#\n]*pytest\.mark\.timeout\(", re.M)  # in code, not in a string
    raising = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
               if mark.search(path.read_text())}
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("### Timeouts")[1].split("- The timeout uses")[0]
    listed = set(re.findall(r"`(tests/[\w/]+\.py)`", section))
    assert listed == raising, (sorted(raising - listed), sorted(listed - raising))
