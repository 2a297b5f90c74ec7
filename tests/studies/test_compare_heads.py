"""The LM-head study driver (`python -m studies.compare_heads --quick`), its recipe options and
the certified oracle table (studies/oracle_table.py), checked against independent references."""

import json

import jax
import numpy as np
import optax
import pytest

import rowgeom
from examples.lm import configs, optimizer
from studies import compare_heads, oracle_table

HEADS = ("adamw", "rownorm-rescaled")


@pytest.fixture(scope="module")
def quick(tmp_path_factory, small_corpus):
    """`compare_heads.py --quick` on a small text corpus: (workdir, out, returned result).

    Two of the four heads (the AdamW baseline and the rescaled RowNorm, which has the most new
    wiring) keep the test short: every run compiles its own step.
    """
    root = small_corpus(tmp_path_factory.mktemp("heads"))
    workdir, out = root / "runs", root / "results"
    result = compare_heads.main(["--quick", "--workdir", str(workdir), "--out", str(out),
                                 "--data_source", str(root / "corpus"), "--heads", *HEADS])
    return workdir, out, result


@pytest.mark.slow
@pytest.mark.timeout(600)  # may build the `quick` fixture (trains the example)
def test_quick_study_records_and_rate_choice(quick):
    _, out, result = quick
    saved = json.loads((out / "head_study.json").read_text())
    assert saved["runs_done"] == saved["runs_planned"] == len(saved["runs"])
    heads, grid = HEADS, compare_heads.QUICK_SWEEP
    assert tuple(saved["heads"]) == HEADS
    assert saved["runs_planned"] == sum(len(grid[h]) for h in heads) + len(heads)
    sweeps = [r for r in saved["runs"] if r["role"] == "sweep"]
    for h in heads:  # the chosen rate is the sweep's argmin of the final validation loss
        mine = [r for r in sweeps if r["head"] == h]
        assert sorted(r["head_learning_rate"] for r in mine) == sorted(grid[h])
        best = min(mine, key=lambda r: r["final_val_loss"])["head_learning_rate"]
        assert saved["chosen_head_learning_rates"][h] == best
        final = [r for r in saved["runs"] if r["role"] == "final" and r["head"] == h]
        assert [(r["seed"], r["head_learning_rate"]) for r in final] == [(1, best)]
    assert result["summary"] == saved["summary"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # may build the `quick` fixture (trains the example)
def test_quick_study_last_k_geometry(quick):
    """Per-step probes on the last K steps; RowNorm's D(step) <= 2 lr, rescaled: = 2 lr."""
    _, out, _ = quick
    saved = json.loads((out / "head_study.json").read_text())
    cfg = saved["config"]
    k, steps = cfg["eval"]["probe_last_steps"], cfg["steps"]
    for r in saved["runs"]:
        lr = dict((s, v) for s, v in r["curves"]["head_learning_rate"])
        diam = dict((s, v) for s, v in r["curves"]["head_step_diameter"])
        last = list(range(steps - k + 1, steps + 1))
        assert set(last) <= set(diam)
        np.testing.assert_allclose(r["last_k_mean"]["head_step_diameter"],
                                   np.mean([diam[s] for s in last]), rtol=1e-12)
        for s in last:
            if r["head"] == "rownorm":
                assert 0 < diam[s] <= 2 * lr[s] * (1 + 1e-5)
            elif r["head"] == "rownorm-rescaled":  # the whole budget, exactly
                np.testing.assert_allclose(diam[s], 2 * lr[s], rtol=1e-4)
        m = r["last_k_mean"]
        assert 0 < m["head_step_hilbert_rms"] <= m["head_step_hilbert_max"]
        assert np.isfinite(r["final_val_loss"]) and r["final_step"] == steps


@pytest.mark.slow
@pytest.mark.timeout(600)  # may build the `quick` fixture (trains the example)
def test_quick_study_report(quick):
    """Summary ratios recomputed from the raw records; markdown table and plot written."""
    _, out, _ = quick
    saved = json.loads((out / "head_study.json").read_text())
    finals = {r["head"]: r for r in saved["runs"] if r["role"] == "final"}
    for h, entry in saved["summary"].items():
        assert set(entry["vs"]) == {"adamw"}  # no Muon head in this study
        for base in ("adamw",):
            cmp = entry["vs"][base]
            for key in ("head_step_diameter", "head_step_hilbert_rms"):
                want = finals[base]["last_k_mean"][key] / finals[h]["last_k_mean"][key]
                np.testing.assert_allclose(cmp[key]["ratio_of_means"], want, rtol=1e-12)
            np.testing.assert_allclose(
                cmp["loss_delta"][0], finals[h]["final_val_loss"] - finals[base]["final_val_loss"],
                rtol=1e-12)
    rescaled = saved["summary"]["rownorm-rescaled"]["stats"]["diameter_per_lr"]
    np.testing.assert_allclose(rescaled[0], 2.0, rtol=1e-4)  # D(step) = 2 lr on every step
    md = (out / "head_study.md").read_text()
    for h in HEADS:
        assert f"| {compare_heads.LABEL[h]} |" in md
    assert "45–60×" in md and "12–15×" in md and "wall time" in md.lower()
    assert (out / "head_study_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(600)  # may build the `quick` fixture (trains the example)
def test_quick_study_resumes_without_training(quick, monkeypatch):
    workdir, out, result = quick

    def refuse(*args, **kwargs):
        raise AssertionError("finished runs must not be trained again")

    monkeypatch.setattr(compare_heads.train, "train", refuse)
    argv = ["--quick", "--workdir", str(workdir), "--out", str(out), "--heads", *HEADS]
    assert compare_heads.main(argv)["summary"] == result["summary"]
    assert compare_heads.main([*argv, "--report-only"])["summary"] == result["summary"]


def test_a_preempted_run_stops_the_study_and_is_not_recorded(tmp_path, monkeypatch):
    """A run the trainer stops for preemption (`train.Preempted`) ends the study there, with
    exit status 0, and leaves no result: the relaunched study trains it again."""
    from examples.lm import train

    def preempted(cfg, rundir, **kwargs):
        rundir.mkdir(parents=True)
        raise train.Preempted(3, rundir / "checkpoints")

    monkeypatch.setattr(compare_heads.train, "train", preempted)
    cfg = configs.get_config("test")
    logged = []
    with pytest.raises(SystemExit) as stopped:
        compare_heads.run_one(cfg, tmp_path, role="sweep", head="rownorm", lr=0.1, seed=1,
                              log=logged.append)
    assert stopped.value.code == 0
    assert logged[-1] == ("    preempted at step 3: the study stops here; rerun the same "
                          "command")
    (rundir,) = tmp_path.iterdir()
    assert not (rundir / compare_heads.RESULT_FILE).exists()


def test_configs_accept_rescaled_head_and_probe_window():
    cfg = configs.parse_config(["--config", "test", "--head", "rownorm-rescaled"])
    assert optimizer.head_group(cfg).learning_rate == 5 * cfg.optim.learning_rate
    with pytest.raises(ValueError, match="eval.probe_last_steps"):
        configs.override(configs.get_config("test"), {"eval.probe_last_steps": 9})


def test_lm_optimizer_head_rescale(rng):
    """head_rescale="exact": the head step has D = 2·lr exactly (brute force, float64)."""
    d, v, lr = 6, 9, 0.03
    params = {"lm_head": {"kernel": rng.normal(size=(d, v)).astype(np.float32)}}
    grads = {"lm_head": {"kernel": rng.normal(size=(d, v)).astype(np.float32)}}
    labels = {"lm_head": {"kernel": "head"}}
    rescales = (None, "exact")
    txs = [rowgeom.lm_optimizer(0.01, groups={"head": rowgeom.GroupOptions(lr, 0.0)},
                                labels=labels, head=rowgeom.HeadOptions(rescale=rescale))
           for rescale in rescales]
    # Both optimizers' first update in one jitted program (not an init and an update each).
    updates = jax.jit(lambda g, p: [tx.update(g, tx.init(p), p)[0] for tx in txs])(grads, params)
    for rescale, upd in zip(rescales, updates, strict=True):
        step = np.asarray(upd["lm_head"]["kernel"], np.float64).T  # (V, d)
        diameter = oracle_table.diameter(step)
        if rescale is None:
            assert diameter <= 2 * lr * (1 + 1e-5)
        else:
            np.testing.assert_allclose(diameter, 2 * lr, rtol=1e-5)
    with pytest.raises(ValueError, match="rescale"):
        rowgeom.lm_optimizer(0.01, head=rowgeom.HeadOptions(optimizer="adamw", rescale="exact"))
    assert all(isinstance(tx, optax.GradientTransformation) for tx in txs)


def test_oracle_table_small(tmp_path):
    """Ratios are certified: never above the exact optimum, RowNorm never below Jung's bound,
    the regular simplex attains it; the step diameters are those claimed."""
    pytest.importorskip("clarabel")
    table = oracle_table.build_table(per_structure=1, shapes=((6, 3), (8, 4)), simplex_ks=(3,))
    assert not table["uncertified"]
    for r in table["instances"]:
        for m in oracle_table.METHODS:
            assert r["ratio"][m] <= 1 + 1e-6
        assert r["ratio"]["rownorm"] >= r["bound"] * (1 - 1e-6)
        assert r["diameter"]["rownorm"] <= oracle_table.RHO * (1 + 1e-9)
        for m in ("rownorm_rescaled", "muon", "sign"):
            np.testing.assert_allclose(r["diameter"][m], oracle_table.RHO, rtol=1e-9)
    simplex = [r for r in table["instances"] if r["structure"] == "regular simplex"]
    np.testing.assert_allclose(simplex[0]["ratio"]["rownorm"], np.sqrt(4 / 6), rtol=1e-4)
    md = oracle_table.markdown(table)
    assert "| 4 | 4 | 3 | 0.8165 |" in md


def test_oracle_diameter_matches_brute_force(rng):
    s = rng.normal(size=(7, 3))
    brute = max(np.linalg.norm(s[i] - s[j]) for i in range(7) for j in range(7))
    np.testing.assert_allclose(oracle_table.diameter(s), brute, rtol=1e-12)
