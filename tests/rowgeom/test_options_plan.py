"""The recipe's options and its explicit plan: one spelling per field, every field reachable,
every per-leaf fact in the plan, the plan a pure function memoised on paths, shapes and dtypes,
no optimizer kept anywhere."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rowgeom
from rowgeom import _recipe as _plan

LR, V, D = 1e-3, 48, 16


def tree(vocab=V, width=D, dtype=jnp.float32):
    """A small LM tree of device arrays, drawn on the host and placed with `jax.device_put`
    (compiles nothing; `jnp.asarray` of a host array compiles a program per shape)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jax.device_put(rng.standard_normal(shape).astype(dtype))
    return {"embed": {"embedding": normal(vocab, width)},
            "layers": {"0": {"mlp": {"up": {"kernel": normal(width, 2 * width)}}}},
            "norm": {"scale": jax.device_put(np.ones(width, dtype))},
            "lm_head": {"kernel": normal(width, vocab)}}


def abstract(params):
    """The tree's shapes and dtypes: what the plan reads (tracing with them compiles nothing)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def grads_of(params, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jax.device_put(rng.standard_normal(p.shape).astype(p.dtype)), params)


def first_update(tx, grads, params):
    """The first update from a fresh state (traced inside a jitted function)."""
    return tx.update(grads, tx.init(params), params)[0]


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- One spelling per field -----------------------------------------------------------------


def test_a_misspelt_keyword_is_a_type_error_from_python():
    for call in (lambda: rowgeom.lm_optimizer(LR, head_learning_rate=1e-3),
                 lambda: rowgeom.describe(tree(), LR, ns_steps=6),
                 lambda: rowgeom.group_options(LR, momentum=0.9)):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call()


def test_the_tied_policy_is_said_once_and_reaches_labels_and_centring():
    params = {"wte": {"embedding": np.zeros((V, D), np.float32)},
              "h": {"0": {"mlp": {"c_fc": {"kernel": np.zeros((D, 2 * D), np.float32)}}}}}
    table = lambda **kw: next(r for r in rowgeom.describe(params, LR, **kw) if r.path.startswith(
        "wte"))
    by_labeler, by_keyword = table(labels=rowgeom.Labeler(tied="head")), table(tied="head")
    assert by_labeler == by_keyword
    assert by_labeler.centred is False and by_labeler.geometry == "RowNorm uncentred, vocab axis 0"
    assert table(labels=rowgeom.Labeler(extra_hidden_names={"c_fc"}), tied="head").label == "head"
    with pytest.raises(ValueError, match=r"tied='embedding' and labels=Labeler\(tied='head'\) "
                                         "both set the tied policy"):
        rowgeom.lm_optimizer(LR, tied="embedding", labels=rowgeom.Labeler(tied="head"))


def test_the_signatures_are_explicit_and_agree():
    params = inspect.signature(rowgeom.lm_optimizer).parameters
    assert not [p for p in params.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    keywords = [p.name for p in params.values() if p.kind == p.KEYWORD_ONLY]
    assert keywords == ["head", "muon", "adam", "router", "labels", "tied", "weight_decay",
                        "groups"]
    described = inspect.signature(rowgeom.describe).parameters
    assert [p for p in described if described[p].kind == described[p].KEYWORD_ONLY] == keywords
    assert all(described[k].default == params[k].default for k in keywords)
    grouped = inspect.signature(rowgeom.group_options).parameters
    assert all(grouped[k].default == params[k].default for k in grouped if k in params)


def test_muon_orthogonalize_reads_its_defaults_from_muon_options():
    defaults = rowgeom.MuonOptions()
    for name, p in inspect.signature(rowgeom.muon_orthogonalize).parameters.items():
        if name != "dimension_numbers":
            assert p.default == getattr(defaults, name), name


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


def test_plan_rows_carry_every_fact_the_chains_use():
    plan = rowgeom.describe(tree(), LR, groups={"head": rowgeom.GroupOptions(weight_decay=0.0)})
    rows = {row.path: row for row in plan}
    head, up, norm = rows["lm_head/kernel"], rows["layers/0/mlp/up/kernel"], rows["norm/scale"]
    assert (head.optimizer, head.centred, head.vocab_axis, head.reason) == (
        "rownorm", True, 1, "name")
    assert plan.groups["head"] == rowgeom.GroupOptions(5 * LR, 0.0, 0.95)
    assert (up.optimizer, up.muon_dims, up.batch_axes) == (
        "muon", rowgeom.MuonDimensionNumbers(0, 1), ())
    assert plan.groups["hidden"].momentum == 0.95
    assert (norm.optimizer, norm.centred, norm.reason) == ("adamw", None, "rank")
    assert plan.groups["vector"] == rowgeom.GroupOptions(LR, 0.0, 0.9)
    assert plan.by_label("head").keys() == {"lm_head/kernel"}
    assert rows["embed/embedding"].reason == "name"
    given = rowgeom.describe(tree(), LR, labels={"lm_head": "head", "layers": "hidden",
                                                 "embed": "embedding", "norm": "vector"})
    assert {r.reason for r in given} == {"given"}


def test_a_muon_heads_fan_in_is_the_width_axis_of_either_layout():
    """Muon's "keller"/"spectral" scales read fan-in and fan-out: a head's fan-out is V."""
    table = {"embed": {"embedding": jax.ShapeDtypeStruct((V, D), jnp.float32)}}
    for name, shape, dims in [("kernel", (D, V), (0, 1)), ("weight", (V, D), (1, 0))]:
        params = {**table, "lm_head": {name: jax.ShapeDtypeStruct(shape, jnp.float32)}}
        row = rowgeom.describe(params, head="muon").by_label("head")[f"lm_head/{name}"]
        assert row.muon_dims == rowgeom.MuonDimensionNumbers(*dims), name
    with pytest.raises(ValueError, match=r"vocab_axis=2 is not an axis of the head lm_head"):
        rowgeom.describe(params, head=rowgeom.HeadOptions(optimizer="muon", vocab_axis=2))


def test_the_router_group_follows_the_hidden_groups_override():
    groups = rowgeom.group_options(LR, groups={"hidden": rowgeom.GroupOptions(
        learning_rate=2e-3, weight_decay=0.0)})
    assert (groups["router"].learning_rate, groups["router"].weight_decay) == (2e-3, 0.0)


def test_a_group_momentum_override_reaches_its_chain():
    params = tree()
    grads = grads_of(params)
    tx = rowgeom.lm_optimizer(LR, groups={"embedding": rowgeom.GroupOptions(momentum=0.5)})
    ref = optax.adamw(LR, b1=0.5, b2=0.95, weight_decay=0.1)
    got, want = jax.jit(lambda g, p: (  # both first updates in one program: one compile
        first_update(tx, g, p)["embed"], first_update(ref, g["embed"], p["embed"])))(
        grads, params)
    np.testing.assert_allclose(got["embedding"], want["embedding"], rtol=1e-6)


# --- The plan: pure, memoised, and nothing else kept -------------------------------------------


def test_the_plan_is_memoised_on_paths_shapes_and_dtypes():
    """The same paths, shapes and dtypes (arrays or abstract) give the same plan object; another
    shape or dtype another plan."""
    params = tree()
    assert rowgeom.make_plan(params) is rowgeom.make_plan(abstract(params))
    assert rowgeom.make_plan(tree(vocab=2 * V)) is not rowgeom.make_plan(params)
    assert rowgeom.make_plan(tree(dtype=jnp.bfloat16)) is not rowgeom.make_plan(params)
    assert rowgeom.make_plan(params, head="adamw") is not rowgeom.make_plan(params)
    assert rowgeom.make_plan(tree(vocab=2 * V)).structure.vocab_size == 2 * V


def test_init_and_update_use_one_plan(monkeypatch):
    """init and updates on one tree read the plan of its paths, shapes and dtypes: the same
    object every time (concrete arrays in init, tracers in the updates)."""
    seen = []
    real = _plan.plan_of

    def recording(tree, options):
        seen.append(real(tree, options))
        return seen[-1]

    from rowgeom import _recipe
    monkeypatch.setattr(_recipe, "plan_of", recording)
    params = tree()
    tx = rowgeom.lm_optimizer(LR, head=rowgeom.HeadOptions(track=False))
    state = jax.eval_shape(tx.init, params)
    for _ in range(2):  # a new function each time: jax's trace cache would skip the second
        jax.eval_shape(lambda g, s, p: tx.update(g, s, p), abstract(params), state,
                       abstract(params))
    assert len(seen) == 3 and all(plan is seen[0] for plan in seen)


def test_nothing_in_rowgeom_holds_an_optimizer():
    """No cache of optimizers or label trees: only the plan's memo (a pure function's)."""
    import pathlib
    source = "\n".join(p.read_text() for p in pathlib.Path(rowgeom.__file__).parent.glob("*.py"))
    for name in ("PlanCache", "_PerStructure", "OrderedDict", "_traced_as",
                 "platform_dependent", "__signature__"):
        assert name not in source, name


def test_no_state_between_calls_each_tree_gets_its_own_plan():
    """One transform on two models of different vocabulary and width, interleaved: each
    update is the program a fresh transform traces for that model alone, with the same state
    (traced, not compiled: the same jaxpr and constants run the same computation)."""
    tx = rowgeom.lm_optimizer(LR)
    small, large = tree(), tree(vocab=2 * V, width=D // 2)

    def program(transform, params):
        state = transform.init(params)
        traced = jax.make_jaxpr(transform.update)(grads_of(params), state, params)
        return state, str(traced.jaxpr), traced.consts

    alone = {id(p): program(rowgeom.lm_optimizer(LR), p) for p in (small, large)}
    for params in (small, large, small):
        state, jaxpr, consts = program(tx, params)
        fresh_state, fresh_jaxpr, fresh_consts = alone[id(params)]
        assert jaxpr == fresh_jaxpr
        assert_trees_equal(consts, fresh_consts)
        assert_trees_equal(state, fresh_state)
    assert alone[id(small)][1] != alone[id(large)][1]  # the two models' programs do differ
    assert rowgeom.describe(large, LR)[2].vocab_axis == 1
    assert rowgeom.describe(large, LR).structure.vocab_size == 2 * V


# --- Labelers and per-leaf options ------------------------------------------------------------


def test_labeler_is_one_frozen_object():
    merged = rowgeom.Labeler(extra_hidden_names={"router"})
    assert merged == rowgeom.Labeler(hidden_names=rowgeom.DEFAULT_HIDDEN_NAMES | {"router"})
    params = {**tree(), "router": {"kernel": np.zeros((D, 4), np.float32)}}
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
    outs = jax.jit(lambda g, p: [tx.update(g, tx.init(p), p)[0]  # one compile for the three
                                 for tx in (nested, flat, prefix)])(grads, params)
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


def test_nnx_optimizer_init_and_update_read_one_plan(monkeypatch):
    """nnx.Optimizer hands ``init`` Variables and ``update`` plain arrays: the same paths,
    shapes and dtypes, so the same plan object, and the update is the one a plain tree gets."""
    from _geometry_shared import shared_lm_optimizer, small_lm_model, small_lm_values
    from flax import nnx

    from rowgeom import _recipe

    seen = []
    real = _plan.plan_of
    monkeypatch.setattr(_recipe, "plan_of", lambda t, o: seen.append(real(t, o)) or seen[-1])
    # The small LM (an NNX model of _geometry_shared.SMALL_LM_PATHS), parameters drawn on the
    # host: no initializer compiles.
    model = small_lm_model(small_lm_values(0))
    params = nnx.state(model, nnx.Param)
    arrays = jax.tree.map(lambda x: x, nnx.to_pure_dict(params))
    ones = jax.tree.map(lambda x: jax.device_put(np.ones(x.shape, x.dtype)), arrays)
    grads = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(grads, ones)
    # The default recipe at test_recipe.py's rate: in one process the plain tree's jitted update
    # below is the one test_recipe.py and test_recipe_defaults.py compile for this tree.
    tx = shared_lm_optimizer(1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
    assert len(seen) == 2 and seen[0] is seen[1]
    assert rowgeom.make_plan(arrays) is seen[0]
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    updates, _ = jax.jit(tx.update)(ones, tx.init(arrays), arrays)
    want = jax.tree.map(lambda p, u: np.asarray(p) + np.asarray(u), arrays, updates)
    # Two compiled programs (nnx.jit's and jax.jit's): equal to float32 rounding.
    for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)


def test_the_plan_memo_keeps_no_arrays():
    import gc
    import weakref

    params = tree(vocab=V + 3)
    ref = weakref.ref(params["lm_head"]["kernel"])
    rowgeom.make_plan(params)
    del params
    gc.collect()
    assert ref() is None
