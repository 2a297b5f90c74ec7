"""studies/paper_table.py: Table 3 from run directories.

The end-to-end test trains the `test` config with both heads on two seeds and checks every cell
against the runs' own metrics.jsonl, recomputed here with numpy; the others check the table's
arithmetic and its bookkeeping (the paper's values, missing and unfinished runs) on records whose
values are known, against the paper's numbers typed in independently.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies import paper_table

PAPER_190M = {  # arXiv 2608.22253 v2, Table 3, typed from the paper (not read from the code)
    "adamw": {"val_loss": 3.1588, "D": 2.870e-2, "hilbert_rms": 9.076e-2},
    "rownorm": {"val_loss": 3.1741, "D": 6.369e-4, "hilbert_rms": 7.506e-3}}


def _run(model, head, seed, loss, d, h, *, finished=True):
    return {"model": model, "head": head, "seed": seed, "dir": f"/runs/{model}-{head}-{seed}",
            "steps": 10, "step": 10 if finished else 4, "finished": finished,
            "val_loss": loss, "D": d, "hilbert_rms": h}


def test_cells_differences_and_ratios_are_the_sample_statistics():
    rng = np.random.default_rng(0)
    vals = {(h, s): rng.uniform(0.5, 2.0, 3) for h in ("adamw", "rownorm") for s in range(3)}
    runs = [_run("190M", h, s, *v) for (h, s), v in vals.items()]
    table = paper_table.build_table(runs)
    entry = table["models"]["190M"]
    for head in ("adamw", "rownorm"):
        for i, key in enumerate(("val_loss", "D", "hilbert_rms")):
            xs = np.array([vals[head, s][i] for s in range(3)])
            mean, sd, n = entry["heads"][head][key]
            assert n == 3
            np.testing.assert_allclose([mean, sd], [xs.mean(), xs.std(ddof=1)], rtol=1e-12)
    diffs = np.array([vals["rownorm", s][0] - vals["adamw", s][0] for s in range(3)])
    np.testing.assert_allclose(entry["loss_diff"][:2], [diffs.mean(), diffs.std(ddof=1)],
                               rtol=1e-12)
    for i, key in ((1, "D"), (2, "hilbert_rms")):
        ratio = (np.mean([vals["adamw", s][i] for s in range(3)])
                 / np.mean([vals["rownorm", s][i] for s in range(3)]))
        np.testing.assert_allclose(entry["ratio"][key], ratio, rtol=1e-12)
    assert table["missing"] == [] and table["unfinished"] == []


def test_paper_values_stand_beside_a_paper_model_and_missing_runs_are_named():
    runs = [_run("190M", "adamw", 0, 3.2, 3e-2, 9e-2), _run("190M", "rownorm", 0, 3.21, 6e-4, 7e-3),
            _run("190M", "rownorm", 1, 3.22, 6.1e-4, 7.1e-3, finished=False)]
    table = paper_table.build_table(runs)
    assert table["missing"] == ["190M adamw seed 1", "190M adamw seed 2",
                                "190M rownorm seed 1", "190M rownorm seed 2"]
    assert len(table["unfinished"]) == 1 and "step 4 of 10" in table["unfinished"][0]
    text = paper_table.format_table(table)
    paper = paper_table.paper_values("190M")
    for head, cells in PAPER_190M.items():
        for key, value in cells.items():
            assert paper["heads"][head][key][0] == value
    assert f"{2.870e-2 / 6.369e-4:.3g}" in text  # Table 3's D ratio, 45.1
    assert f"{9.076e-2 / 7.506e-3:.3g}" in text  # and its Hilbert RMS ratio, 12.1
    assert "+0.0153" in text  # the paper's paired difference
    assert "Missing (the paper has them)" in text and "Unfinished, left out" in text


def test_a_model_the_paper_lacks_gets_no_paper_column_and_no_missing_list():
    runs = [_run("d32-L2-V512", h, 0, 5.0, 1e-2, 1e-3) for h in ("adamw", "rownorm")]
    table = paper_table.build_table(runs)
    assert table["missing"] == []
    row = next(line for line in paper_table.format_table(table).splitlines()
               if line.startswith("| d32-L2-V512 | adamw"))
    assert row.count("|  |") == 3  # three empty paper cells


def test_the_same_run_twice_is_an_error():
    run = _run("190M", "adamw", 0, 3.2, 3e-2, 9e-2)
    with pytest.raises(paper_table.RunError, match="same run"):
        paper_table.build_table([run, {**run, "dir": "/elsewhere"}])


def test_model_name_recognises_only_the_paper_shapes():
    model = {"d_model": 768, "num_layers": 32, "vocab_size": 50304, "valid_vocab_size": 50257}
    assert paper_table.model_name(model) == "380M"
    assert paper_table.model_name({**model, "num_layers": 14}) == "d768-L14-V50257"
    assert paper_table.model_name({**model, "valid_vocab_size": None}) == "d768-L32-V50304"


def test_a_directory_that_is_not_a_run_is_one_line_and_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        paper_table.main([str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoints/ folder" in err


@pytest.mark.slow
def test_table_from_runs_of_the_test_config(tmp_path, small_corpus, capsys):
    from examples.lm import train
    from tests._lm_fixtures import config_on

    small_corpus(tmp_path, tokenize=True)
    dirs = []
    for head in ("adamw", "rownorm"):
        for seed in (0, 1):
            workdir = tmp_path / f"{head}-{seed}"
            train.train(config_on(tmp_path, head=head, seed=seed), workdir, progress=False,
                        print_fn=lambda *a, **k: None)
            dirs.append(workdir)
    out_json = tmp_path / "table.json"
    assert paper_table.main([*map(str, dirs), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    table = json.loads(out_json.read_text())
    (model, entry), = table["models"].items()
    assert model == "d32-L2-V512"
    finals = {}
    for d in dirs:
        head, seed = d.name.split("-")
        records = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in records if r["step"] == 8 and "val_loss" in r][-1]
        finals[head, int(seed)] = (last["val_loss"], last["head_step_diameter"],
                                   last["head_step_hilbert_rms"])
    for head in ("adamw", "rownorm"):
        for i, key in enumerate(("val_loss", "D", "hilbert_rms")):
            xs = np.array([finals[head, s][i] for s in (0, 1)])
            np.testing.assert_allclose(entry["heads"][head][key][:2],
                                       [xs.mean(), xs.std(ddof=1)], rtol=1e-9)
    d_ratio = np.mean([finals["adamw", s][1] for s in (0, 1)]) / np.mean(
        [finals["rownorm", s][1] for s in (0, 1)])
    np.testing.assert_allclose(entry["ratio"]["D"], d_ratio, rtol=1e-9)
    assert f"{d_ratio:.3g}" in text and table["missing"] == []
