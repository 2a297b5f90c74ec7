"""The recipe's options objects and its explicit plan: one home per option, no hidden state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rowgeom

LR, V, D = 1e-3, 48, 16


def tree(vocab=V, width=D):
    key = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *shape: jax.random.normal(next(key), shape)
    return {"embed": {"embedding": normal(vocab, width)},
            "layers": {"0": {"mlp": {"up": {"kernel": normal(width, 2 * width)}}}},
            "norm": {"scale": jnp.ones(width)},
            "lm_head": {"kernel": normal(width, vocab)}}


def grads_of(params, seed=1):
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    return jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)


def step(tx, params, grads):
    return jax.jit(tx.update)(grads, tx.init(params), params)[0]


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_flat_keywords_are_the_objects_attributes():
    flat = rowgeom.lm_optimizer_hparams(
        LR, ns_steps=6, head_num_valid=40, head_weight_decay=0.0, vector_learning_rate=3e-4,
        adam_b2=0.99, track_every_k_steps=1)
    objects = rowgeom.lm_optimizer_hparams(
        LR, muon=rowgeom.MuonOptions(ns_steps=6), adam=rowgeom.AdamOptions(b2=0.99),
        head=rowgeom.HeadOptions(num_valid=40, track_every_k_steps=1),
        groups={"head": rowgeom.GroupOptions(weight_decay=0.0),
                "vector": rowgeom.GroupOptions(learning_rate=3e-4)})
    assert flat == objects
    assert flat["head"].weight_decay == 0.0 and flat["vector"].learning_rate == 3e-4
    assert flat["hidden"].weight_decay == 0.1  # the other groups keep the derived values
    # Every flat keyword maps to an existing attribute of its object.
    for name, where in rowgeom.FLAT_KEYWORDS.items():
        owner = {"head": rowgeom.HeadOptions, "muon": rowgeom.MuonOptions,
                 "adam": rowgeom.AdamOptions, "groups": rowgeom.GroupOptions}[where[0]]
        assert where[-1] in owner.__dataclass_fields__, name


def test_resolved_hparams_build_the_same_optimizer():
    params = tree()
    grads = grads_of(params)
    options = dict(head="adamw", head_learning_rate=2e-3, muon=rowgeom.MuonOptions(ns_steps=4))
    hp = rowgeom.lm_optimizer_hparams(LR, **options)
    assert_trees_equal(step(rowgeom.lm_optimizer(hp), params, grads),
                       step(rowgeom.lm_optimizer(LR, **options), params, grads))
    assert str(rowgeom.describe(params, hp)) == str(rowgeom.describe(params, LR, **options))
    with pytest.raises(TypeError, match=r"part of the LMHyperparams already.*\['tied'\]"):
        rowgeom.lm_optimizer(hp, tied="embedding")
    with pytest.raises(ValueError, match="rate is given twice"):
        rowgeom.lm_optimizer_hparams(LR, head_learning_rate=1e-3,
                                     groups={"head": rowgeom.GroupOptions(learning_rate=2e-3)})


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


def test_no_state_between_calls_each_tree_gets_its_own_plan():
    """One transform on two models of different vocabulary and width, interleaved: each
    update equals the one a fresh transform computes for that model alone."""
    tx = rowgeom.lm_optimizer(LR)
    small, large = tree(), tree(vocab=2 * V, width=D // 2)
    for params in (small, large, small):
        grads = grads_of(params)
        assert_trees_equal(step(tx, params, grads), step(rowgeom.lm_optimizer(LR), params, grads))
    assert rowgeom.describe(large, LR)[2].vocab_axis == 1
    assert rowgeom.describe(large, LR).structure.vocab_size == 2 * V


def test_plan_rows_carry_the_axes_and_rates_the_chains_use():
    plan = rowgeom.describe(tree(), LR, head_weight_decay=0.0)
    rows = {row.path: row for row in plan}
    assert rows["lm_head/kernel"].vocab_axis == 1
    assert rows["lm_head/kernel"].learning_rate == pytest.approx(5 * LR)
    assert rows["lm_head/kernel"].weight_decay == 0.0
    assert rows["layers/0/mlp/up/kernel"].muon_dims == rowgeom.MuonDimensionNumbers(0, 1)
    assert rows["norm/scale"].weight_decay == 0.0 and rows["norm/scale"].muon_dims is None
    assert plan.by_label("head").keys() == {"lm_head/kernel"}
    assert plan.hparams == rowgeom.lm_optimizer_hparams(LR, head_weight_decay=0.0)


def test_labeler_is_one_frozen_object():
    merged = rowgeom.Labeler(extra_hidden_names={"router"})
    assert merged == rowgeom.Labeler(hidden_names=rowgeom.DEFAULT_HIDDEN_NAMES | {"router"})
    assert merged == rowgeom.make_labeler(extra_hidden_names={"router"})
    params = {**tree(), "router": {"kernel": jnp.zeros((D, 4))}}
    assert merged(params) == rowgeom.label_params(params, extra_hidden_names={"router"})
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


def test_deprecated_names_warn_and_alias():
    with pytest.warns(DeprecationWarning, match="rowgeom.OptimizerPlan"):
        assert rowgeom.Description is rowgeom.OptimizerPlan
    with pytest.warns(DeprecationWarning, match="rowgeom.LeafPlan"):
        assert rowgeom.ParamRow is rowgeom.LeafPlan
