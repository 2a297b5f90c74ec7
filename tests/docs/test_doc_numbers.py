"""Numbers the pages quote from result and benchmark files agree with those files.

- docs/results/oracle_table.json: the geometry page's instance counts, ranges and ratios;
- docs/results/head_study.json: the learning-rate guide's sweep, the chosen head rates and
  `rowgeom.HEAD_LR_MULTIPLIERS`;
- the generated table of docs/benchmarks.md (between its `benchmark-table` markers, written by
  `benchmarks/run_all.py --docs`): the exact diameter's time, the bracket's tightness and the
  tracker's cost, wherever another page quotes them.

Each check formats the value from the file as the page writes it and looks for the sentence, so
a rerun that changes a number fails here until the page says the new one.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from _doc_extract import ROOT

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


def _benchmark_section(title_start: str) -> list[list[str]]:
    """The rows (cells) of the generated benchmark table under the heading `title_start`."""
    text = (DOCS / "benchmarks.md").read_text()
    generated = text.split("<!-- benchmark-table:start -->")[1].split(
        "<!-- benchmark-table:end -->")[0]
    sections = re.split(r"^### ", generated, flags=re.M)
    (section,) = [s for s in sections if s.startswith(title_start)]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def _exact_diameter_rows() -> dict[str, list[str]]:
    return {row[0]: row for row in _benchmark_section("Row diameter: exact")}


def test_exact_diameter_time_on_the_pages_matches_the_benchmark():
    seconds = _exact_diameter_rows()["(50304, 768)"][2]  # e.g. "12.7 s"
    assert re.fullmatch(r"[\d.]+ s", seconds), seconds
    for page in ("geometry.md", "guides/diagnostics.md"):
        quoted = re.findall(r"([\d.]+ s) for a \\\(50304 ?\\times ?768\\\) head", _page(page))
        assert quoted, f"{page} no longer quotes the exact diameter's time: update this test"
        assert set(quoted) == {seconds}, f"{page} quotes {quoted}, the benchmark {seconds}"


def test_bracket_tightness_on_the_pages_matches_the_benchmark():
    rows = _exact_diameter_rows()
    lower = [float(r[4]) for r in rows.values()]
    upper = [float(r[5]) for r in rows.values()]
    assert {"(32768, 512)", "(50304, 768)"} <= set(rows)
    for page in ("geometry.md", "guides/diagnostics.md"):
        text = _page(page)
        (within,) = set(re.findall(r"within (\d+) % of (?:exact|\\\(D\\\))", text))
        (about,) = set(re.findall(r"about (\d+) % on the same rows", text))
        assert all(1 - x <= int(within) / 100 for x in lower), (page, lower)
        assert all(abs(100 * (x - 1) - int(about)) <= 2.5 for x in upper), (page, upper)


def test_tracker_cost_on_the_pages_matches_the_benchmark():
    """diagnostics.md: on CPU the tracker costs about as much as the RowNorm step, a little
    more or less by layout: within a factor 1.5 either way in both layouts."""
    rows = {r[0].strip("`"): r for r in _benchmark_section("Every O(Vd) head operation")}

    def on_cpu(name):  # the formulation a one-CPU-device process runs, where the table has two
        return rows.get(f"{name}[cpu]") or rows[name]

    time = lambda cell: float(re.search(r"\(([\d.]+) ms", cell).group(1))  # noqa: E731
    for column in (1, 2):  # (V, d) and (d, V)
        ratio = (time(on_cpu("track_row_diameter")[column])
                 / time(on_cpu("projected_rownorm")[column]))
        assert 1 / 1.5 <= ratio <= 1.5, (column, ratio)
    _assert_quotes("guides/diagnostics.md",
                   "on CPU about as long as the projected RowNorm step itself, a little more or "
                   "less depending on the layout")


def test_benchmark_table_parses():
    rows = _exact_diameter_rows()
    assert all(np.isfinite(float(r[4])) and float(r[4]) <= 1.0 for r in rows.values())


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
