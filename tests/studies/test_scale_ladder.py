"""The scale-ladder study (studies/scale_ladder.py): its fits and seed statistics against
independent references (numpy), the report on hand-made run records (per-seed pairing, per-seed
fits, the seed-spread rule, coverage against a baseline), and the whole pipeline end to end on a
tiny ladder (train, protocols, resume, fit, report)."""

import dataclasses
import json

import numpy as np
import pytest

from studies import ladder_fit, ladder_report, scale_ladder
from studies.scale_ladder import Point

# ----------------------------------------------------------------------------- fits


def test_loglog_fit_matches_closed_form_and_recovers_slope():
    """Slope, standard error and t-interval against the textbook simple-regression formulas."""
    rng = np.random.default_rng(0)
    d = np.repeat([128.0, 256.0, 512.0, 768.0], 3)
    y = 0.7 * d ** 0.5 * np.exp(rng.normal(0, 0.05, d.size))
    fit = ladder_fit.fit_loglog({"d": d}, y)
    x, ly = np.log(d), np.log(y)
    sxx = np.sum((x - x.mean()) ** 2)
    slope = np.sum((x - x.mean()) * (ly - ly.mean())) / sxx
    resid = ly - (ly.mean() + slope * (x - x.mean()))
    se = np.sqrt(np.sum(resid ** 2) / (d.size - 2) / sxx)
    t975 = 2.2281388519649385  # Student t, 10 degrees of freedom, 97.5 % (tables)
    s = fit["slopes"]["d"]
    np.testing.assert_allclose([s["value"], s["se"]], [slope, se], rtol=1e-10)
    np.testing.assert_allclose(s["ci"], [slope - t975 * se, slope + t975 * se], rtol=1e-9)
    assert s["ci"][0] < 0.5 < s["ci"][1] and fit["dof"] == 10


def test_loglog_interval_coverage_on_synthetic_power_laws():
    """95 % intervals of slopes (two features) and of the predicted mean cover the truth at the
    nominal rate over many synthetic data sets (binomial tolerance: 400 sets, 0.95 ± 0.035)."""
    rng = np.random.default_rng(1)
    d = np.array([128, 256, 512, 768, 256, 256, 768] * 2, float)
    V = np.array([4096, 4096, 4096, 4096, 16384, 50304, 50304] * 2, float)
    hits = np.zeros(3)
    for _ in range(400):
        y = 2.0 * d ** 0.5 * V ** -0.3 * np.exp(rng.normal(0, 0.1, d.size))
        fit = ladder_fit.fit_loglog({"d": d, "V": V}, y)
        pred = ladder_fit.predict(fit, {"d": 1280, "V": 50304})
        truth = 2.0 * 1280 ** 0.5 * 50304 ** -0.3
        hits += [fit["slopes"]["d"]["ci"][0] <= 0.5 <= fit["slopes"]["d"]["ci"][1],
                 fit["slopes"]["V"]["ci"][0] <= -0.3 <= fit["slopes"]["V"]["ci"][1],
                 pred["ci"][0] <= truth <= pred["ci"][1]]
    assert np.all(np.abs(hits / 400 - 0.95) < 0.035), hits / 400


def test_fit_rejects_unusable_data():
    with pytest.raises(ValueError, match="positive"):
        ladder_fit.fit_loglog({"d": [1, 2, 3]}, [1.0, -1.0, 2.0])
    with pytest.raises(ValueError, match="more than 2 observations"):
        ladder_fit.fit_loglog({"d": [1, 2]}, [1.0, 2.0])
    with pytest.raises(ValueError, match="vary independently"):
        ladder_fit.fit_loglog({"d": [1, 2, 4, 8], "V": [2, 4, 8, 16]}, [1.0, 2.0, 3.0, 5.0])


def test_spikes_and_divergence():
    calm = 5.0 - 0.01 * np.arange(40)
    assert ladder_fit.count_spikes(calm) == 0
    spiky = calm.copy()
    spiky[[10, 11, 25]] += 1.0  # two onsets: 10-11 is one spike
    assert ladder_fit.count_spikes(spiky) == 2
    assert ladder_fit.count_spikes([*calm[:20], np.nan]) == 1
    # mini-batch noise of +-0.4 nats is not a spike; a 3-nat jump in it is
    noisy = calm + 0.4 * np.random.default_rng(0).standard_normal(calm.size)
    assert ladder_fit.count_spikes(noisy) == 0
    noisy[30] += 3.0
    assert ladder_fit.count_spikes(noisy) == 1
    assert not ladder_fit.diverged([5.0, 4.0, 3.9])
    assert ladder_fit.diverged([5.0, 4.0, 6.0]) and ladder_fit.diverged([5.0, np.nan])
    # below its first evaluation but no better than uniform over 4096 tokens (ln 4096 = 8.32)
    assert not ladder_fit.diverged([9.0, 8.6]) and ladder_fit.diverged([9.0, 8.6], vocab=4096)
    assert not ladder_fit.diverged([9.0, 5.5], vocab=4096)


def test_spectral_factor_and_plan():
    """Muon's spectral/RMS scale ratio equals muon_orthogonalize's two scales on a (d, V) kernel;
    the full plan lists every protocol with a cost for every run."""
    import jax
    import optax

    import rowgeom

    g = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    out = jax.jit(lambda g: {s: rowgeom.muon_orthogonalize(scale=s).update(
        g, optax.EmptyState())[0] for s in ("rms", "spectral")})(g)  # one program for both
    ratio = float(np.linalg.norm(out["spectral"]) / np.linalg.norm(out["rms"]))
    np.testing.assert_allclose(ratio, scale_ladder.spectral_factor(Point(16, 64)), rtol=1e-5)
    lines = []
    total = scale_ladder.print_plan(scale_ladder.full_ladder(), out=lines.append)
    rows = scale_ladder.plan(scale_ladder.full_ladder())
    assert {r["protocol"].split()[0] for r in rows} == {"equal", "sweep", "tuned", "matched",
                                                        "robust"}
    assert all(r["est_s"] is not None and r["est_s"] > 0 for r in rows)
    np.testing.assert_allclose(total, sum(r["est_s"] for r in rows))


def test_restrict_selects_points_and_seeds_and_the_thin_point_skips_spectral():
    full = scale_ladder.full_ladder()
    cut = scale_ladder.restrict(full, points=["d128-V4096-L2", "d768-V50304-L1"], max_seeds=1)
    assert [p.name for p in cut.points] == ["d128-V4096-L2", "d768-V50304-L1"]
    assert all(len(cut.seeds(p)) == 1 for p in cut.points) and cut.robust_seeds == (1,)
    assert scale_ladder.restrict(full) == full
    with pytest.raises(SystemExit, match="unknown.*d999"):
        scale_ladder.restrict(full, points=["d999-V1-L2"])
    with pytest.raises(SystemExit, match="positive"):
        scale_ladder.restrict(full, max_seeds=0)
    thin = {r["head"] for r in scale_ladder.plan(full) if r["point"] == "d768-V50304-L1"}
    assert thin == {"adamw", "muon", "rownorm"}


# ----------------------------------------------------------------------------- end to end


def test_empty_report_says_nothing_was_measured(tmp_path):
    ladder = scale_ladder.quick_ladder()
    result = ladder_report.write_report({}, rules={}, ladder=ladder, out=tmp_path, config={},
                                        session_wall_s=0.0)
    md = (tmp_path / "scale_ladder.md").read_text()
    assert result["runs_done"] == 0 and "No ladder run has finished yet" in md
    assert not any(ch.isdigit() for ch in md.split("No ladder run")[1].split("--plan")[0])


@pytest.mark.slow
@pytest.mark.timeout(600)  # trains the example at several scales
def test_quick_ladder_end_to_end(tmp_path, small_corpus, monkeypatch):
    """Two points, two heads, every protocol: records, the matched-rate rescale, resumption and
    the report (measured numbers equal the run records), written after each stage that trained
    and once at the end."""
    written = []
    write_report = ladder_report.write_report
    monkeypatch.setattr(ladder_report, "write_report",
                        lambda *a, **k: written.append(1) or write_report(*a, **k))
    root = small_corpus(tmp_path)
    ladder = dataclasses.replace(
        scale_ladder.quick_ladder(heads=("muon-spectral", "rownorm")),
        points=(Point(32, 512), Point(64, 512)), sweep_points=(Point(32, 512), Point(64, 512)),
        sweep={"muon-spectral": (0.018,), "rownorm": (0.018,)}, sweep_seed=1,
        robust_multipliers=(1.0,), seeds_by_point={Point(32, 512): (1,),
                                                         Point(64, 512): (1,)},
        protocols_by_point={Point(64, 512): ("equal", "tuned")})  # 5 runs train in all
    kw = dict(workdir=root / "runs", out=root / "out", data_source=str(root / "corpus"))
    result = scale_ladder.ladder_study(ladder, **kw, log=lambda *a: None)
    assert len(written) == 3  # after "equal" and "matched" (the others reuse their runs), end
    runs = result["runs"]
    assert len(runs["equal"]) == 4 and len(runs["tuned"]) == 4 and len(runs["matched"]) == 2
    for r in runs["equal"]:
        assert r["steps"] == 8 and np.isfinite(r["final_val_loss"]) and r["D"] > 0
        if r["head"] == "rownorm":  # every row moves at most lr: D <= 2 lr per step
            assert r["D_per_lr"] <= 2 * (1 + 1e-5)
        else:  # trained as the RMS-matched Muon head at lr·5/sqrt(d), decay wd·sqrt(d)/5
            s = scale_ladder.spectral_factor(Point(**r["point"]))
            np.testing.assert_allclose(r["trained_as"]["lr"], r["lr"] * s, rtol=1e-5)
    # matched: the spectral head's rate is the tuned rate × D_rownorm / D_spectral (seed 1)
    assert {r["point"]["d"] for r in runs["matched"]} == {32}
    for p in (Point(32, 512),):
        tuned = {r["head"]: r for r in runs["tuned"] if Point(**r["point"]) == p}
        matched = [r for r in runs["matched"] if Point(**r["point"]) == p
                   and r["head"] == "muon-spectral"][0]
        want = tuned["muon-spectral"]["lr"] * tuned["rownorm"]["D"] / tuned["muon-spectral"]["D"]
        np.testing.assert_allclose(matched["lr"], want, rtol=1e-3)
    assert {(r["multiplier"], r["lr"]) for r in runs["robust"]} == {(1.0, 0.018)}
    # the report's measured numbers are the run records'
    table = result["protocols"]["equal"]["measured"]["points"]
    rec = [r for r in runs["equal"] if r["head"] == "rownorm" and r["point"]["d"] == 64][0]
    np.testing.assert_allclose(table["d64-V512-L2"]["rownorm"]["D_per_lr"]["mean"],
                               rec["D_per_lr"])
    red = result["protocols"]["equal"]["measured"]["reductions"]["d32-V512-L2"]["muon-spectral"]
    pair = {r["head"]: r for r in runs["equal"] if r["point"]["d"] == 32}
    np.testing.assert_allclose(red["D"]["values"],
                               [pair["muon-spectral"]["D"] / pair["rownorm"]["D"]])
    md = (root / "out" / "scale_ladder.md").read_text()
    assert "(a) equal head rate" in md and "(d) robustness grid" in md
    assert "not fitted" in md  # two widths, one seed: no interval is claimed
    assert (root / "out" / "scale_ladder_robust.png").stat().st_size > 0
    assert "| equal | d32-V512-L2 |  | 1 / 1 | 1 / 1 |" in md  # seeds: finished / planned
    # resumption: a rerun trains nothing and rebuilds the same report
    again = scale_ladder.ladder_study(ladder, **kw, log=lambda *a: pytest.fail(f"trained {a}"))
    assert len(written) == 4  # a study that trains nothing writes its page once
    assert json.dumps(again["protocols"]) == json.dumps(result["protocols"])
    # run names do not carry the horizon: another --steps on the same workdir is refused
    with pytest.raises(ValueError, match="8-step run but this ladder trains 9 steps"):
        scale_ladder.ladder_study(ladder, **kw, steps=9, log=lambda *a: None)


@pytest.mark.slow
def test_spectral_head_reparametrisation_is_the_spectral_muon_update():
    """The ladder's spectral head (RMS-matched Muon head at lr·s, head decay wd/s, through the
    example's optimizer) gives the same head updates as rowgeom's Muon with scale="spectral"."""
    import jax
    import optax
    from flax import nnx

    import rowgeom
    from examples.lm import configs, model, optimizer

    point = Point(32, 512)
    s = scale_ladder.spectral_factor(point)
    lr, wd = 0.05, 0.1
    cfg = configs.override(configs.get_config("test"), {
        "head": "muon", "optim.head_learning_rate": lr * s, "optim.head_weight_decay": wd / s,
        "optim.weight_decay": wd, "optim.grad_clip": None})
    ours = optimizer.build_optimizer(cfg)
    schedule = lambda peak: optimizer.lr_schedule(peak, cfg)
    ref = rowgeom.lm_optimizer(schedule(cfg.optim.learning_rate), head="muon",
                               muon=rowgeom.MuonOptions(scale="spectral"), weight_decay=wd,
                               groups={"head": rowgeom.GroupOptions(schedule(lr), wd)})
    # The model's parameter shapes (nothing computed); parameters and gradients drawn on the
    # host: the identity holds for any values.
    shapes = nnx.to_pure_dict(nnx.split(nnx.eval_shape(
        lambda: model.Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param, ...)[1])
    rng = np.random.default_rng(0)
    draw = lambda scale: jax.tree.map(  # noqa: E731
        lambda x: (scale * rng.standard_normal(x.shape)).astype(x.dtype), shapes)
    params = draw(0.1)
    states = jax.jit(lambda p: (ours.init(p), ref.init(p)))(params)

    @jax.jit  # both optimizers' step in one program, compiled once for the two steps
    def step(params, states, grads):
        (u_ours, s_ours), (u_ref, s_ref) = (tx.update(grads, state, params) for tx, state in
                                            zip((ours, ref), states, strict=True))
        return (u_ours["lm_head"]["kernel"], u_ref["lm_head"]["kernel"], (s_ours, s_ref),
                optax.apply_updates(params, u_ours))

    for _ in range(2):
        head_ours, head_ref, states, params = step(params, states, draw(1.0))
        np.testing.assert_allclose(head_ours, head_ref, rtol=2e-4, atol=1e-7)


def test_sweep_extends_past_an_edge_and_still_makes_a_rule(tmp_path, monkeypatch):
    """A best rate at the grid's edge gets one more rate past it; the rule then uses the
    extended best (a bug once dropped the head's rule whenever an edge run had been added)."""
    trained = []

    def fake_run(ladder, workdir, point, head, lr, seed, **kw):
        trained.append((point.d, head, round(lr, 6)))
        best = {128: 0.002, 256: 0.006}[point.d]  # the smallest grid rate or below it
        return {"point": dataclasses.asdict(point), "head": head, "lr": lr, "seed": seed,
                "final_val_loss": 5.0 + abs(np.log(lr / best)), "D": lr}

    monkeypatch.setattr(scale_ladder, "run_point", fake_run)
    ladder = dataclasses.replace(scale_ladder.full_ladder(heads=("adamw",)), sweep_extend=1)
    driver = scale_ladder.Driver(ladder, tmp_path, log=lambda *a: None)
    driver.sweep()
    assert (128, "adamw", 0.002) in trained  # 0.006 was the edge at d128: one rate below it
    assert (256, "adamw", 0.002) in trained  # 0.006 is the edge at d256 too; 0.002 is worse
    rule = driver.rules["adamw"]
    assert rule["best"] == {"d128-V4096-L2": 0.002, "d256-V4096-L2": 0.006}
    np.testing.assert_allclose(rule["alpha"], np.log(3) / np.log(2))


# ----------------------------------------------------------------------------- seed statistics


def _rec(d, V, head, seed, *, layers=2, lr=0.018, D=1.0, hilbert=1.0, loss=5.0, multiplier=None,
         spikes=0, diverged=False):
    """A hand-made run record with the fields the report reads."""
    r = {"point": {"d": d, "V": V, "layers": layers}, "head": head, "lr": lr, "seed": seed,
         "D": D, "hilbert_rms": hilbert, "D_per_lr": D / lr, "hilbert_rms_per_lr": hilbert / lr,
         "final_val_loss": loss, "tightness": 0.5, "loss_spikes": spikes, "diverged": diverged,
         "diameter_exact": True, "wall_s": 1.0, "steps": 100}
    return r if multiplier is None else r | {"multiplier": multiplier}


def test_seed_stats_against_numpy(rng):
    for n in (2, 3, 7):
        xs = rng.normal(3.0, 0.5, n)
        st = ladder_fit.seed_stats(xs)
        np.testing.assert_allclose([st["mean"], st["std"], st["se"]],
                                   [np.mean(xs), np.std(xs, ddof=1),
                                    np.std(xs, ddof=1) / np.sqrt(n)], rtol=1e-12)
        assert st["n"] == n and st["values"] == xs.tolist()
    one = ladder_fit.seed_stats([2.5])
    assert (one["mean"], one["std"], one["se"], one["n"]) == (2.5, None, None, 1)
    bad = ladder_fit.seed_stats([1.0, np.nan])
    assert bad["n"] == 2 and bad["mean"] is None and bad["std"] is None
    assert ladder_fit.seed_stats([])["mean"] is None


def test_beyond_spread_rule_on_constructed_cases():
    """Larger than the spread: >= 2 seeds, all of the mean's sign, |mean| > 2 se."""
    v = ladder_fit.beyond_spread
    assert v([-0.05, -0.06, -0.055])["verdict"] == "larger"
    # mixed signs: within, although |mean| 0.082 > 2 se 0.037
    mixed = v([0.1, 0.1, 0.1, 0.1, 0.1, -0.01])
    assert mixed["mean"] > 2 * mixed["se"] and mixed["same_sign"] is False
    assert mixed["verdict"] == "within"
    # same sign but one seed far out: mean 0.177, se 0.16 -> |mean| < 2 se
    r = v([0.01, 0.02, 0.5])
    assert r["same_sign"] and r["verdict"] == "within"
    np.testing.assert_allclose(r["se"], np.std([0.01, 0.02, 0.5], ddof=1) / np.sqrt(3))
    # two seeds a, b of one sign: |mean| = (a+b)/2, se = |a-b|/2; the boundary a+b = 2|a-b|
    assert v([1.0, 3.0])["verdict"] == "within" and v([1.01, 3.0])["verdict"] == "larger"
    assert v([-1.01, -3.0])["verdict"] == "larger"
    assert v([1.01, 3.0], k=3.0)["verdict"] == "within"
    assert v([0.0, 0.0])["verdict"] == "within" and v([0.0, 0.1])["verdict"] == "within"
    assert v([0.3])["verdict"] == "one seed" and v([0.3, np.inf])["verdict"] == "not finite"
    assert v([])["verdict"] == "no data"


def test_point_table_and_reductions_pair_by_seed():
    """Cells are mean ± std over seeds; reductions are means of per-seed ratios (not the ratio of
    means), loss deltas per seed pair; a seed without a RowNorm partner is left out."""
    runs = [_rec(128, 4096, "adamw", 1, D=0.02, hilbert=0.08, loss=5.40),
            _rec(128, 4096, "adamw", 2, D=0.06, hilbert=0.10, loss=5.46),
            _rec(128, 4096, "adamw", 3, D=0.50, hilbert=0.90, loss=9.00),  # no RowNorm seed 3
            _rec(128, 4096, "rownorm", 1, D=0.004, hilbert=0.04, loss=5.30),
            _rec(128, 4096, "rownorm", 2, D=0.003, hilbert=0.05, loss=5.35)]
    cell = ladder_report.point_table(runs)["d128-V4096-L2"]["adamw"]
    assert cell["seeds"] == [1, 2, 3] and cell["D"]["n"] == 3
    np.testing.assert_allclose([cell["D"]["mean"], cell["D"]["std"]],
                               [np.mean([0.02, 0.06, 0.5]), np.std([0.02, 0.06, 0.5], ddof=1)])
    red = ladder_report.reductions(runs)["d128-V4096-L2"]["adamw"]
    ratios = [0.02 / 0.004, 0.06 / 0.003]
    assert red["seeds"] == [1, 2] and red["D"]["values"] == pytest.approx(ratios)
    np.testing.assert_allclose([red["D"]["mean"], red["D"]["std"]],
                               [np.mean(ratios), np.std(ratios, ddof=1)])
    assert not np.isclose(red["D"]["mean"], np.mean([0.02, 0.06]) / np.mean([0.004, 0.003]))
    assert red["D"]["vs_1"] == "larger"  # 5× and 20×: above 1× beyond the spread
    np.testing.assert_allclose(red["hilbert_rms"]["values"], [0.08 / 0.04, 0.10 / 0.05])
    np.testing.assert_allclose(red["loss_delta"]["values"], [-0.10, -0.11])
    assert red["loss_delta"]["verdict"] == "larger"


def test_fits_use_per_seed_points_and_recover_the_slope():
    """Unbalanced seeds (3 at two widths, 1 at the others): the fit is OLS on every per-seed
    point (equal to numpy's polyfit on them, not on cell means) and recovers the known slope."""
    rng = np.random.default_rng(3)
    widths, seeds = (128, 256, 512, 768), {128: 3, 256: 3, 512: 1, 768: 1}
    runs, xs, ys = [], [], []
    for d in widths:
        for s in range(seeds[d]):
            y = 0.7 * d ** 0.5 * np.exp(rng.normal(0, 0.03))
            runs.append(_rec(d, 4096, "adamw", s, lr=1.0, D=y))
            xs.append(d)
            ys.append(y)
    fit = ladder_report.slope_fits(runs, width_v=4096, vocab_d=256)["adamw"]["D_per_lr"]["vs_d"]
    assert fit["n"] == len(runs) == 8 and fit["cells"] == 4
    slope = np.polyfit(np.log(xs), np.log(ys), 1)[0]
    np.testing.assert_allclose(fit["slopes"]["d"]["value"], slope, rtol=1e-10)
    means = [np.mean([y for x, y in zip(xs, ys, strict=True) if x == d]) for d in widths]
    assert not np.isclose(slope, np.polyfit(np.log(widths), np.log(means), 1)[0], rtol=1e-4)
    lo, hi = fit["slopes"]["d"]["ci"]
    assert lo < 0.5 < hi and hi - lo < 0.2
    # seeds of two widths only: enough runs, too few shapes for a slope with an interval
    two = [r for r in runs if r["point"]["d"] in (128, 256)]
    fit2 = ladder_report.slope_fits(two, width_v=4096, vocab_d=256)["adamw"]["D_per_lr"]["vs_d"]
    assert "distinct shapes, got 2" in fit2["error"]


def test_joint_prediction_uses_every_seed_pair():
    """The (d, V) fit of reductions has one point per seed pair and recovers a known power law."""
    rng = np.random.default_rng(4)
    shapes = [(128, 4096), (256, 4096), (512, 4096), (256, 16384), (256, 50304)]
    runs = []
    for d, V in shapes:
        for s in (1, 2):
            red = 0.5 * d ** 0.4 * V ** 0.1 * np.exp(rng.normal(0, 0.02))
            runs += [_rec(d, V, "rownorm", s, D=0.01, hilbert=0.01),
                     _rec(d, V, "muon", s, D=0.01 * red, hilbert=0.02)]
    pred = ladder_report.predictions(runs, {"x": (1024, 50304)})["muon"]
    fit = pred["D"]["fit"]
    assert fit["n"] == 10 and fit["cells"] == 5
    assert fit["slopes"]["d"]["ci"][0] < 0.4 < fit["slopes"]["d"]["ci"][1]
    assert fit["slopes"]["V"]["ci"][0] < 0.1 < fit["slopes"]["V"]["ci"][1]
    truth = 0.5 * 1024 ** 0.4 * 50304 ** 0.1
    assert pred["D"]["at"]["x"]["ci"][0] < truth < pred["D"]["at"]["x"]["ci"][1]
    assert "error" in ladder_report.predictions(runs, {})["adamw"]["D"]["fit"]  # no AdamW runs


def test_robustness_differences_against_the_spread():
    """Per multiplier: the loss minus the head's own 1× run and RowNorm minus the head, paired
    by seed, each judged by the spread rule; divergence counts per seed."""
    runs = []
    for s, eps in ((1, 0.0), (2, 0.01), (3, -0.01)):
        runs += [_rec(128, 4096, "adamw", s, multiplier=1.0, loss=5.40 + eps),
                 _rec(128, 4096, "adamw", s, multiplier=3.0, loss=5.60 + 2 * eps),
                 _rec(128, 4096, "rownorm", s, multiplier=1.0, loss=5.42 - eps),
                 _rec(128, 4096, "rownorm", s, multiplier=3.0, loss=9.0, diverged=True)]
    rob = ladder_report.robustness(runs)
    a3 = rob["heads"]["adamw"]["rows"]["3"]
    np.testing.assert_allclose(a3["vs_tuned"]["values"], [0.20, 0.21, 0.19])
    assert a3["vs_tuned"]["verdict"] == "larger" and rob["heads"]["adamw"]["rows"]["1"][
        "vs_tuned"] is None
    one = rob["rownorm_minus_head"]["1"]["adamw"]
    np.testing.assert_allclose(one["values"], [0.02, 0.0, 0.04])  # one zero, |mean| < 2 se
    assert one["verdict"] == "within"
    assert rob["rownorm_minus_head"]["3"]["adamw"]["verdict"] == "larger"
    assert rob["heads"]["rownorm"]["rows"]["3"]["diverged"] == [True] * 3
    assert rob["heads"]["rownorm"]["stable_multipliers"] == [1.0]
    assert rob["heads"]["adamw"]["near_best_multipliers"] == [1.0]


def test_report_coverage_against_a_baseline(tmp_path):
    """Seeds per cell before -> now / planned; the page states the rule, shows mean ± std and
    the verdicts; `load_baseline` reads a whole earlier report as well as a cut one."""
    p1, p2 = Point(32, 512), Point(64, 512)
    ladder = dataclasses.replace(
        scale_ladder.quick_ladder(heads=("adamw", "rownorm"), protocols=("equal",)),
        points=(p1, p2), seeds_by_point={p1: (1, 2), p2: (1, 2)})

    def equal(seeds):
        return {"equal": [_rec(p.d, p.V, h, s, D=0.004 * (5 if h == "adamw" else 1) * (1 + s / 50),
                               loss=5.0 + (0.1 if h == "adamw" else 0) + s / 100)
                          for p in (p1, p2) for h in ("adamw", "rownorm") for s in seeds]}

    old = ladder_report.write_report(equal([1]), rules={}, ladder=ladder, out=tmp_path / "old",
                                     config={}, session_wall_s=0.0)
    base = tmp_path / "old" / "scale_ladder.json"
    assert scale_ladder.load_baseline(base)["runs"]["equal"][0]["seed"] == 1
    cut = ladder_report.baseline_from_report(old, source="seed 1 only")
    assert scale_ladder.load_baseline(None) is None
    result = ladder_report.write_report(equal([1, 2]), rules={}, ladder=ladder,
                                        out=tmp_path / "new", config={}, session_wall_s=0.0,
                                        baseline=cut)
    md = (tmp_path / "new" / "scale_ladder.md").read_text()
    assert "| equal | d32-V512-L2 |  | 1 → 2 / 2 | 1 → 2 / 2 |" in md
    assert "baseline run (seed 1 only)" in md and "|mean| > 2 standard errors" in md
    cov = {(r["point"], r["head"]): r for r in result["coverage"]}
    assert cov[("d64-V512-L2", "adamw")] == {
        "protocol": "equal", "point": "d64-V512-L2", "multiplier": "", "head": "adamw",
        "planned": 2, "now": [1, 2], "before": [1]}
    red = result["protocols"]["equal"]["measured"]["reductions"]["d32-V512-L2"]["adamw"]
    assert red["loss_delta"]["verdict"] == "larger" and red["D"]["n"] == 2
    row = f"| d32-V512-L2 | AdamW | 2 (1, 2) | {red['D']['mean']:.3g} ± {red['D']['std']:.2g}× |"
    assert row in md
    assert result["baseline"]["protocols"]["equal"]["reductions"]["d32-V512-L2"]["adamw"][
        "D"]["n"] == 1


# ----------------------------------------------------------------------------- the paper


def test_paper_shapes_and_values_are_the_published_ones():
    """The ladder predicts at the paper's head shapes (Table 1: d 512 / 768 / 1024, V 50,257),
    and the study's table is the paper's Tables 1-3 (arXiv 2608.22253 v2), typed here once more:
    the final-update D ÷ lr and the ratios the report derives from it are the paper's."""
    assert scale_ladder.PAPER_SHAPES == {"190M": (512, 50257), "380M": (768, 50257),
                                         "640M": (1024, 50257)}
    published = {  # d, updates, peak head rates; Table 3 (mean, sd): D, Hilbert RMS, loss
        "190M": (512, 7083, (4.0e-3, 3.2e-3), ((2.870e-2, 0.140e-2), (6.369e-4, 0.009e-4)),
                 ((9.076e-2, 0.605e-2), (7.506e-3, 0.017e-3)),
                 ((3.1588, 0.0027), (3.1741, 0.0031))),
        "380M": (768, 14464, (2.667e-3, 2.133e-3), ((2.303e-2, 0.324e-2), (4.241e-4, 0.015e-4)),
                 ((7.732e-2, 0.874e-2), (5.667e-3, 0.024e-3)),
                 ((2.9403, 0.0019), (2.9494, 0.0024))),
        "640M": (1024, 24406, (2.0e-3, 1.6e-3), ((1.895e-2, 0.368e-2), (3.1856e-4, 0.0029e-4)),
                 ((7.555e-2, 0.382e-2), (4.955e-3, 0.025e-3)),
                 ((2.8156, 0.0024), (2.8213, 0.0033)))}
    table = scale_ladder.PAPER_TABLE
    for name, (d, updates, lrs, D, hilbert, loss) in published.items():
        m = table[name]
        assert (m["d"], m["V"], m["updates"]) == (d, 50257, updates)
        assert (m["peak_lr"]["adamw"], m["peak_lr"]["rownorm"]) == lrs
        for key, want in (("D", D), ("hilbert_rms", hilbert), ("val_loss", loss)):
            assert (m[key]["adamw"], m[key]["rownorm"]) == want, (name, key)
        # Table 1: parameters 32·16·d² + 2·V·d, updates floor(20 tokens per parameter / 524,288)
        params = 32 * 16 * d * d + 2 * 50257 * d
        assert updates == 20 * params // scale_ladder.PAPER_RECIPE["tokens_per_update"]
    assert scale_ladder.PAPER_RECIPE["final_lr_fraction"] == 0.1
    assert scale_ladder.PAPER_RECIPE["adamw_head"] == {"b1": 0.9, "b2": 0.999, "eps": 1e-10}
    pp = ladder_report.paper(table, scale_ladder.PAPER_RECIPE)["models"]
    # at the final update the head rate is 10 % of the peak: AdamW D ÷ lr ≈ 72, 86, 95; RowNorm 2
    np.testing.assert_allclose([pp[n]["D_per_lr"]["adamw"]["mean"] for n in published],
                               [2.870e-2 / 4.0e-4, 2.303e-2 / 2.667e-4, 1.895e-2 / 2.0e-4])
    assert [round(pp[n]["D_per_lr"]["adamw"]["mean"]) for n in published] == [72, 86, 95]
    np.testing.assert_allclose([pp[n]["D_per_lr"]["rownorm"]["mean"] for n in published], 2.0,
                               atol=0.015)
    # Table 3's own ratios of means and paired loss differences (printed under the table)
    assert [round(pp[n]["reduction"]["D"], 1) for n in published] == [45.1, 54.3, 59.5]
    assert [round(pp[n]["reduction"]["hilbert_rms"], 1) for n in published] == [12.1, 13.6, 15.2]
    assert [round(pp[n]["loss_delta"], 4) for n in published] == [0.0153, 0.0091, 0.0057]
    # per unit head rate the AdamW rate's 1.25× is divided out: 72 / 2 = 36, not 45
    np.testing.assert_allclose(pp["190M"]["reduction_per_lr"]["D"],
                               pp["190M"]["reduction"]["D"] / 1.25, rtol=1e-12)


def _adam_ratios(g, b1, b2, eps=0.0):
    """|m̂_t| / (√v̂_t + eps) of one coordinate of Adam (bias-corrected) along a gradient sequence."""
    m = v = 0.0
    out = []
    for t, x in enumerate(g, start=1):
        m, v = b1 * m + (1 - b1) * x, b2 * v + (1 - b2) * x * x
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        out.append(abs(mh) / (np.sqrt(vh) + eps) if vh > 0 else 0.0)
    return np.array(out)


def test_adam_ratio_bound_holds_and_is_attained():
    """No gradient sequence takes one Adam coordinate past the bound at its step (random and
    bursty sequences), a sequence growing like (β₂/β₁)^t towards the last step attains it, and
    the D ÷ lr ceiling is 2·√d times it."""
    rng = np.random.default_rng(5)
    for b1, b2 in ((0.9, 0.95), (0.9, 0.999)):
        for g in (rng.normal(size=300), rng.normal(size=300) * (rng.random(300) < 0.02),
                  np.r_[np.zeros(250), 1.0, np.zeros(49)], np.ones(300)):
            r = _adam_ratios(g, b1, b2)
            bounds = [ladder_report.adam_ratio_bound(b1, b2, t) for t in range(1, 301)]
            assert np.all(r <= np.array(bounds) * (1 + 1e-9))
        t = 2000
        g = (b2 / b1) ** (np.arange(t) - t)  # Cauchy–Schwarz's equality case at step t
        np.testing.assert_allclose(_adam_ratios(g, b1, b2)[-1],
                                   ladder_report.adam_ratio_bound(b1, b2, t), rtol=1e-6)
    assert ladder_report.adam_ratio_bound(0.9, 0.95) < 1.17 < 7.2 < ladder_report.adam_ratio_bound(
        0.9, 0.999)
    np.testing.assert_allclose(ladder_report.adamw_ceiling(512, 0.9, 0.95),
                               2 * np.sqrt(512) * ladder_report.adam_ratio_bound(0.9, 0.95))
    assert ladder_report.adam_ratio_bound(0.99, 0.95) == np.inf  # β₁² ≥ β₂: no bound


def test_refit_rebuilds_the_report_from_stored_records_without_training(tmp_path, monkeypatch):
    """`--refit JSON` reads a stored report's run records, trains nothing, reproduces its measured
    tables, predicts D ÷ lr per head at the paper's shapes beside the paper's values, and says on
    the page what was and was not rerun."""
    rng = np.random.default_rng(6)
    shapes = [(128, 4096), (256, 4096), (512, 4096), (256, 16384), (256, 50304)]
    runs = []
    for d, V in shapes:
        for s in (1, 2):
            noise = np.exp(rng.normal(0, 0.02))
            runs += [_rec(d, V, "rownorm", s, D=0.036, hilbert=0.3 * d ** 0.3 * 0.018),
                     _rec(d, V, "adamw", s, D=0.018 * 0.8 * d ** 0.5 * noise,
                          hilbert=0.018 * 2 * d ** 0.9)]
    ladder = scale_ladder.full_ladder(heads=("adamw", "rownorm"), protocols=("equal",))
    first = ladder_report.write_report({"equal": runs}, rules={}, ladder=ladder,
                                       out=tmp_path / "a", config={"steps": 100},
                                       session_wall_s=0.0)
    stored = tmp_path / "a" / "scale_ladder.json"
    monkeypatch.setattr(scale_ladder, "run_point", lambda *a, **k: pytest.fail("trained"))
    again = scale_ladder.refit(stored, out=tmp_path / "b", ladder=ladder, log=lambda *a: None)
    assert json.dumps(again["protocols"]) == json.dumps(first["protocols"])
    pred = again["protocols"]["equal"]["predicted_per_lr"]
    fit = pred["adamw"]["D_per_lr"]["fit"]
    assert fit["n"] == 10 and fit["slopes"]["d"]["ci"][0] < 0.5 < fit["slopes"]["d"]["ci"][1]
    truth = 0.8 * 768 ** 0.5
    assert pred["adamw"]["D_per_lr"]["at"]["380M"]["ci"][0] < truth
    assert truth < pred["adamw"]["D_per_lr"]["at"]["380M"]["ci"][1]
    np.testing.assert_allclose(pred["rownorm"]["D_per_lr"]["at"]["190M"]["value"], 2.0)
    md = (tmp_path / "b" / "scale_ladder.md").read_text()
    assert "no run was trained or retrained" in md and "Not rerun: the runs themselves" in md
    assert "190M d 512 × V 50,257" in md
    assert "## The paper's measured values beside the predictions" in md
    d_per_lr = ladder_report.paper(scale_ladder.PAPER_TABLE,
                                   scale_ladder.PAPER_RECIPE)["models"]["190M"]["D_per_lr"]
    assert f"| {d_per_lr['adamw']['mean']:.3g} ± {d_per_lr['adamw']['sd']:.2g} |" in md
    assert "| 190M (512 × 50257) |" in md and "(no such head in the paper)" not in md
    # a refit of a refit keeps the shapes predicted at before the first one: the same page
    scale_ladder.refit(tmp_path / "b" / "scale_ladder.json", out=tmp_path / "b", ladder=ladder,
                       log=lambda *a: None)
    assert (tmp_path / "b" / "scale_ladder.md").read_text() == md
