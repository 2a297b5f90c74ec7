"""The recipe's options and its explicit plan: one spelling per field, every field reachable,
every choice in the plan, the plan cached per tree structure and nowhere else."""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rowgeom
from rowgeom import _plan

LR, V, D = 1e-3, 48, 16


def tree(vocab=V, width=D, dtype=jnp.float32):
    key = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *shape: jax.random.normal(next(key), shape, dtype)
    return {"embed": {"embedding": normal(vocab, width)},
            "layers": {"0": {"mlp": {"up": {"kernel": normal(width, 2 * width)}}}},
            "norm": {"scale": jnp.ones(width, dtype)},
            "lm_head": {"kernel": normal(width, vocab)}}


def grads_of(params, seed=1):
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    return jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params)


def step(tx, params, grads):
    return jax.jit(tx.update)(grads, tx.init(params), params)[0]


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- The deprecated flat keywords: each an alias of one field --------------------------------

# A valid value other than the default for every flat keyword.
FLAT_VALUES = {
    **{f"{g}_learning_rate": 2e-3 for g in ("hidden", "head", "embedding", "vector", "router")},
    **{f"{g}_weight_decay": 0.05 for g in ("hidden", "head", "embedding", "vector", "router")},
    "momentum": 0.9, "nesterov": False, "ns_steps": 6, "ns_coeffs": "polar_express",
    "muon_scale": "spectral", "shard_matrices": False,
    "muon_dimension_numbers": {"layers": rowgeom.MuonDimensionNumbers(1, 0)},
    "head_momentum": 0.9, "head_vocab_axis": 1, "head_rescale": "exact", "head_num_valid": 40,
    "track_head": False, "track_every_k_steps": 1, "adam_b1": 0.8, "adam_b2": 0.99,
    "adam_eps": 1e-6,
}
OBJECTS = {"head": rowgeom.HeadOptions, "muon": rowgeom.MuonOptions, "adam": rowgeom.AdamOptions}


def canonical(name, value):
    """The options-object spelling of one flat keyword."""
    where = rowgeom.FLAT_KEYWORDS[name]
    if where[0] == "groups":
        return {"groups": {where[1]: rowgeom.GroupOptions(**{where[2]: value})}}
    return {where[0]: OBJECTS[where[0]](**{where[1]: value})}


def test_every_flat_keyword_has_a_test_value_and_names_a_field():
    assert set(FLAT_VALUES) == set(rowgeom.FLAT_KEYWORDS)
    for name, where in rowgeom.FLAT_KEYWORDS.items():
        owner = rowgeom.GroupOptions if where[0] == "groups" else OBJECTS[where[0]]
        assert where[-1] in owner.__dataclass_fields__, name


def beside(name):
    """Another field of the same object, given by its canonical spelling: the flat keyword
    merges with it (a group's other field; a head optimizer named by string)."""
    where = rowgeom.FLAT_KEYWORDS[name]
    if where[0] == "groups":
        other = "weight_decay" if where[2] == "learning_rate" else "learning_rate"
        return {"groups": {where[1]: rowgeom.GroupOptions(**{other: 1e-4})}}
    if where[0] == "head" and name != "head_rescale":
        return {"head": "muon"}
    return {}


@pytest.mark.parametrize("name", sorted(FLAT_VALUES))
def test_deprecated_flat_keyword_still_works_and_warns_once(name):
    value, params = FLAT_VALUES[name], tree()
    want = canonical(name, value)
    for call in (lambda **kw: rowgeom.lm_optimizer_hparams(LR, **kw),
                 lambda **kw: str(rowgeom.describe(params, LR, **kw)),
                 lambda **kw: rowgeom.lm_optimizer(LR, **kw)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call(**{name: value})
        assert [w.category for w in caught] == [DeprecationWarning], name
        assert f"{name}= -> " in str(caught[0].message)
        assert caught[0].filename == __file__  # points at the caller's line
        if not isinstance(got, optax.GradientTransformation):
            assert got == call(**want), name
    field = rowgeom.FLAT_KEYWORDS[name]  # the value is no default: the check can fail
    default = (rowgeom.GroupOptions() if field[0] == "groups" else OBJECTS[field[0]]())
    assert getattr(default, field[-1]) != value
    # Beside another field of its object it merges into that object.
    other = beside(name)
    with pytest.warns(DeprecationWarning):
        merged = rowgeom.lm_optimizer_hparams(LR, **{name: value}, **other)
    if field[0] == "groups":
        both = dataclasses.replace(other["groups"][field[1]], **{field[2]: value})
        assert merged == rowgeom.lm_optimizer_hparams(LR, groups={field[1]: both})
    elif other:
        assert merged == rowgeom.lm_optimizer_hparams(
            LR, head=rowgeom.HeadOptions(optimizer="muon", **{field[1]: value}))


@pytest.mark.parametrize("name", sorted(FLAT_VALUES))
def test_a_flat_keyword_beside_its_object_is_an_error_naming_both(name):
    where = rowgeom.FLAT_KEYWORDS[name]
    if where[0] == "groups":
        other = {"groups": {where[1]: rowgeom.GroupOptions(**{where[2]: 1e-4})}}
        spelled = f"groups={{'{where[1]}': GroupOptions({where[2]}=...)}}"
    else:
        other = {where[0]: OBJECTS[where[0]]()}
        spelled = f"{where[0]}={OBJECTS[where[0]].__name__}(...)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raised before any warning
        with pytest.raises(ValueError) as err:
            rowgeom.lm_optimizer(LR, **{name: FLAT_VALUES[name]}, **other)
    assert f"{name}= and {spelled} both set" in str(err.value)


# --- One spelling per field -----------------------------------------------------------------


@pytest.mark.parametrize("keyword, value", [
    ("head", "adamw"), ("labels", None), ("tied", None), ("weight_decay", 0.1), ("groups", {}),
    ("muon", rowgeom.MuonOptions()), ("adam", rowgeom.AdamOptions()), ("router", "muon")])
def test_any_option_beside_an_lm_hyperparams_is_an_error_naming_it(keyword, value):
    """Whether it was given decides, not its value: the default value conflicts too."""
    hp = rowgeom.lm_optimizer_hparams(LR)
    for call in (lambda: rowgeom.lm_optimizer(hp, **{keyword: value}),
                 lambda: rowgeom.describe(tree(), hp, **{keyword: value})):
        with pytest.raises(ValueError, match=rf"LMHyperparams holds every option, and "
                                             rf"{keyword}= set some again"):
            call()


def test_the_tied_policy_is_said_once_and_reaches_labels_and_centring():
    params = {"wte": {"embedding": jnp.zeros((V, D))},
              "h": {"0": {"mlp": {"c_fc": {"kernel": jnp.zeros((D, 2 * D))}}}}}
    table = lambda **kw: next(r for r in rowgeom.describe(params, LR, **kw) if r.path.startswith(
        "wte"))
    by_labeler, by_keyword = table(labels=rowgeom.Labeler(tied="head")), table(tied="head")
    assert by_labeler == by_keyword
    assert by_labeler.centred is False and by_labeler.geometry == "RowNorm uncentred, vocab axis 0"
    assert table(labels=rowgeom.Labeler(extra_hidden_names={"c_fc"}), tied="head").label == "head"
    with pytest.raises(ValueError, match=r"tied='embedding' and labels=Labeler\(tied='head'\) "
                                         "both set the tied policy"):
        rowgeom.lm_optimizer(LR, tied="embedding", labels=rowgeom.Labeler(tied="head"))


def test_signature_is_written_once():
    assert inspect.signature(rowgeom.lm_optimizer).parameters.keys() == inspect.signature(
        rowgeom.lm_optimizer_hparams).parameters.keys()
    keywords = [p for p in inspect.signature(rowgeom.lm_optimizer).parameters.values()
                if p.kind == p.KEYWORD_ONLY]
    assert [p.name for p in keywords] == ["head", "labels", "tied", "weight_decay", "groups",
                                          "muon", "adam", "router"]


def test_options_that_another_optimizer_would_ignore_are_errors():
    for bad, match in [
            (lambda: rowgeom.HeadOptions(optimizer="adamw", momentum=0.9), "AdamOptions.b1"),
            (lambda: rowgeom.HeadOptions(optimizer="muon", eps=1e-6), "HeadOptions.eps applies"),
            (lambda: rowgeom.HeadOptions(optimizer="adamw", rescale="exact"), "rescale applies"),
            (lambda: rowgeom.RouterOptions(momentum=0.9), "RouterOptions.momentum applies"),
            (lambda: rowgeom.MuonOptions(compute_dtype=jnp.int32), "MuonOptions.compute_dtype"),
            (lambda: rowgeom.MuonOptions(ns_coeffs="nope"), "MuonOptions.ns_coeffs"),
            (lambda: rowgeom.AdamOptions(b2=1.0), r"AdamOptions.b2 must be in \[0.0, 1.0\)"),
            (lambda: rowgeom.HeadOptions(eps=1e-20), "HeadOptions.eps must be")]:
        with pytest.raises((TypeError, ValueError), match=match):
            bad()


# --- Every field of every transform is reachable ----------------------------------------------


def test_every_transform_field_reaches_its_chain():
    """Non-default values of the fields lm_optimizer passes on (Muon's dtypes, eps and RMS
    scale, RowNorm's eps, AdamW's eps_root, mu_dtype and Nesterov) give the steps of the
    chains built by hand with them, and differ from the defaults' steps."""
    params, grads = tree(), grads_of(tree())
    muon = rowgeom.MuonOptions(eps=1e-2, compute_dtype=jnp.bfloat16, rms_scale=0.3,
                               mu_dtype=jnp.bfloat16)
    adam = rowgeom.AdamOptions(eps_root=1e-3, mu_dtype=jnp.bfloat16, nesterov=True)
    head = rowgeom.HeadOptions(eps=10.0, track=False)
    tx = rowgeom.lm_optimizer(LR, muon=muon, adam=adam, head=head, weight_decay=0.0)
    default = rowgeom.lm_optimizer(LR, weight_decay=0.0, head=rowgeom.HeadOptions(track=False))
    hidden = optax.chain(optax.trace(0.95, nesterov=True, accumulator_dtype=jnp.bfloat16),
                         rowgeom.muon_orthogonalize(eps=1e-2, compute_dtype=jnp.bfloat16,
                                                    rms_scale=0.3),
                         optax.scale_by_learning_rate(LR))
    adamw = optax.adamw(LR, b1=0.9, b2=0.95, eps_root=1e-3, mu_dtype=jnp.bfloat16,
                        nesterov=True, weight_decay=0.0)
    rownorm = optax.chain(optax.ema(0.95, debias=False, accumulator_dtype=jnp.float32),
                          rowgeom.projected_rownorm(vocab_axis=1, eps=10.0),
                          optax.scale_by_learning_rate(5 * LR))
    refs = {"layers": hidden, "embed": adamw, "lm_head": rownorm}

    @jax.jit  # one compile for all of them
    def steps(grads, params):
        first = lambda t, g, p: t.update(g, t.init(p), p)[0]
        return (first(tx, grads, params), first(default, grads, params),
                {k: first(ref, grads[k], params[k]) for k, ref in refs.items()})

    got, other, want = steps(grads, params)
    for path in refs:
        np.testing.assert_allclose(jax.tree.leaves(got[path])[0], jax.tree.leaves(want[path])[0],
                                   rtol=1e-6, atol=1e-9, err_msg=path)
        assert not np.allclose(jax.tree.leaves(other[path])[0], jax.tree.leaves(got[path])[0])


# --- The plan holds every choice --------------------------------------------------------------


def test_plan_rows_carry_every_choice_the_chains_use():
    plan = rowgeom.describe(tree(), LR, groups={"head": rowgeom.GroupOptions(weight_decay=0.0)})
    rows = {row.path: row for row in plan}
    head, up, norm = rows["lm_head/kernel"], rows["layers/0/mlp/up/kernel"], rows["norm/scale"]
    assert (head.optimizer, head.centred, head.vocab_axis, head.momentum, head.reason) == (
        "rownorm", True, 1, 0.95, "name")
    assert head.learning_rate == pytest.approx(5 * LR) and head.weight_decay == 0.0
    assert (up.optimizer, up.muon_dims, up.batch_axes, up.momentum) == (
        "muon", rowgeom.MuonDimensionNumbers(0, 1), (), 0.95)
    assert (norm.optimizer, norm.centred, norm.weight_decay, norm.momentum, norm.reason) == (
        "adamw", None, 0.0, 0.9, "rank")
    assert plan.by_label("head").keys() == {"lm_head/kernel"}
    assert plan.group("head").centred is True
    assert plan.group("head").learning_rate == head.learning_rate
    assert rows["embed/embedding"].reason == "name"
    given = rowgeom.describe(tree(), LR, labels={"lm_head": "head", "layers": "hidden",
                                                 "embed": "embedding", "norm": "vector"})
    assert {r.reason for r in given} == {"given"}


def test_the_router_group_follows_the_hidden_groups_override():
    hp = rowgeom.lm_optimizer_hparams(LR, groups={"hidden": rowgeom.GroupOptions(
        learning_rate=2e-3, weight_decay=0.0)})
    assert (hp["router"].learning_rate, hp["router"].weight_decay) == (2e-3, 0.0)


def test_resolved_hparams_build_the_same_optimizer():
    params = tree()
    grads = grads_of(params)
    options = dict(head="adamw", groups={"head": rowgeom.GroupOptions(learning_rate=2e-3)},
                   muon=rowgeom.MuonOptions(ns_steps=4))
    hp = rowgeom.lm_optimizer_hparams(LR, **options)
    assert_trees_equal(step(rowgeom.lm_optimizer(hp), params, grads),
                       step(rowgeom.lm_optimizer(LR, **options), params, grads))
    assert str(rowgeom.describe(params, hp)) == str(rowgeom.describe(params, LR, **options))


def test_with_rates_maps_every_group_and_keeps_the_options():
    params = tree()
    grads = grads_of(params)
    hp = rowgeom.lm_optimizer_hparams(LR, head="adamw", muon=rowgeom.MuonOptions(ns_steps=4))
    halved = hp.with_rates(lambda group, lr: 0.5 * lr)
    assert halved.muon == hp.muon and halved.head == hp.head
    assert {g: halved[g].learning_rate for g in halved} == {
        g: 0.5 * hp[g].learning_rate for g in hp}
    # Weight decay is scaled by the rate too (optax's decoupled decay), so every step halves.
    full = step(rowgeom.lm_optimizer(hp), params, grads)
    half = step(rowgeom.lm_optimizer(halved), params, grads)
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(half), strict=True):
        np.testing.assert_allclose(np.asarray(y), 0.5 * np.asarray(x), rtol=1e-5, atol=1e-10)


# --- The plan cache ---------------------------------------------------------------------------


@pytest.fixture
def plans_made(monkeypatch):
    """The trees `make_plan` is called on, counted."""
    made = []
    real = _plan.make_plan

    def counting(tree, hparams):
        made.append(_plan.tree_key(tree))
        return real(tree, hparams)

    monkeypatch.setattr(_plan, "make_plan", counting)
    return made


def test_a_tree_seen_before_is_not_planned_again(plans_made):
    """One plan per paths, shapes and dtypes, per transform: eager updates on the same tree
    plan once; another shape, dtype or transform plans again."""
    params = tree()
    grads = grads_of(params)
    tx = rowgeom.lm_optimizer(LR, head=rowgeom.HeadOptions(track=False))
    state = tx.init(params)
    for _ in range(3):
        tx.update(grads, state, params)
    assert len(plans_made) == 1  # init and the updates share the plan of these shapes
    tx.init(tree(vocab=2 * V))
    tx.init(tree(dtype=jnp.bfloat16))
    rowgeom.lm_optimizer(LR).init(params)
    assert len(plans_made) == 4 and len(set(plans_made)) == 3


def test_no_state_between_calls_each_tree_gets_its_own_plan():
    """One transform on two models of different vocabulary and width, interleaved: each
    update equals the one a fresh transform computes for that model alone."""
    tx = rowgeom.lm_optimizer(LR)
    update = jax.jit(tx.update)  # retraced per shapes, as a training loop's jit would be
    small, large = tree(), tree(vocab=2 * V, width=D // 2)
    alone = {id(p): step(rowgeom.lm_optimizer(LR), p, grads_of(p)) for p in (small, large)}
    for params in (small, large, small):
        grads = grads_of(params)
        assert_trees_equal(update(grads, tx.init(params), params)[0], alone[id(params)])
    assert rowgeom.describe(large, LR)[2].vocab_axis == 1
    assert rowgeom.describe(large, LR).structure.vocab_size == 2 * V


def test_the_cache_keeps_only_recent_trees():
    cache = _plan.PlanCache(rowgeom.lm_optimizer_hparams(LR), lambda plan: plan, size=2)
    trees = [tree(vocab=V + k) for k in range(3)]
    first = cache.built(trees[0])
    assert cache.built(trees[0]) is first
    cache.built(trees[1])
    cache.built(trees[2])
    assert cache.built(trees[0]) is not first  # dropped, planned again (equal, not the same)
    assert cache.built(trees[0]) == first


# --- Labelers and per-leaf options ------------------------------------------------------------


def test_labeler_is_one_frozen_object():
    merged = rowgeom.Labeler(extra_hidden_names={"router"})
    assert merged == rowgeom.Labeler(hidden_names=rowgeom.DEFAULT_HIDDEN_NAMES | {"router"})
    params = {**tree(), "router": {"kernel": jnp.zeros((D, 4))}}
    assert merged(params) == rowgeom.label_params(params, extra_hidden_names={"router"})
    assert dataclasses.replace(merged, tied="head") == rowgeom.Labeler(
        extra_hidden_names={"router"}, tied="head")
    with pytest.raises(ValueError, match="tied must be one of"):
        rowgeom.Labeler(tied="yes")
    with pytest.raises(TypeError, match=r"rules\[0\] must be a \(regex, label\) pair"):
        rowgeom.Labeler(rules=["^router"])


def test_per_leaf_options_nested_and_flat_mean_the_same():
    params = tree()
    grads = grads_of(params)
    nested = rowgeom.projected_rownorm(vocab_axis={"lm_head": {"kernel": 1}})
    flat = rowgeom.projected_rownorm(vocab_axis={"lm_head/kernel": 1})
    prefix = rowgeom.projected_rownorm(vocab_axis={"lm_head": 1})
    outs = [tx.update(grads, tx.init(params), params)[0] for tx in (nested, flat, prefix)]
    assert_trees_equal(outs[0], outs[1])
    assert_trees_equal(outs[0], outs[2])
    assert_trees_equal(outs[0]["embed"], grads["embed"])  # uncovered leaves: untouched
    with pytest.raises(ValueError, match=r"vocab_axis names \['lm_haed/kernel'\]"):
        rowgeom.projected_rownorm(vocab_axis={"lm_haed/kernel": 1}).update(
            grads, optax.EmptyState(), params)
    labels = {"lm_head": "head", "layers": "hidden", "embed/embedding": "embedding",
              "norm/scale": "vector"}
    assert [r.label for r in rowgeom.describe(params, LR, labels=labels)] == [
        r.label for r in rowgeom.describe(params, LR)]


# --- Deprecated names -------------------------------------------------------------------------


@pytest.mark.parametrize("old, new", [("Description", "OptimizerPlan"), ("ParamRow", "LeafPlan")])
def test_deprecated_name_still_works_and_warns_once(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(rowgeom, old) is getattr(rowgeom, new)
    assert [w.category for w in caught] == [DeprecationWarning] and new in str(caught[0].message)


def test_make_labeler_still_works_and_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labeler = rowgeom.make_labeler(extra_hidden_names={"router"})
    assert [w.category for w in caught] == [DeprecationWarning]
    assert labeler == rowgeom.Labeler(extra_hidden_names={"router"})
