"""Labels by path (rowgeom._labels) and the checked partition (rowgeom._partition)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _geometry_shared import tinylm_model
from _nnx_models import LAYERS, D, TinyLM, V
from flax import linen as nn
from flax import nnx

import rowgeom
from rowgeom._tree import is_box, tree_paths, unbox


def expected_label(path: str) -> str:
    if path.endswith("scale"):
        return "vector"
    if path.startswith("embed/"):
        return "embedding"
    if path.startswith("lm_head/"):
        return "head"
    assert path.startswith("layers/") and path.endswith("kernel"), path
    return "hidden"


def pure(tree):
    """`tree` with every Flax Variable replaced by its value (the structure kept)."""
    return jax.tree.map(unbox, tree, is_leaf=is_box)


def flat(labels):
    return {"/".join(p): lab for p, lab in tree_paths(labels)}


@pytest.fixture(scope="module")
def model():
    """TinyLM with parameters drawn on the host (eagerly, its initializers compile 16
    programs; only the tree's paths, shapes and Variables matter to the labels)."""
    return tinylm_model(0)


def test_nnx_variables_pure_and_abstract_trees_get_the_same_labels(model):
    state = nnx.state(model, nnx.Param)
    abstract = nnx.state(nnx.eval_shape(lambda: TinyLM(nnx.Rngs(0))), nnx.Param)
    expected = {p: expected_label(p) for p in flat(pure(state))}
    assert len(expected) == 2 + LAYERS * 9 + 1 and "layers/1/mlp/down_proj/kernel" in expected
    for tree in (state, pure(state), abstract):
        labels = rowgeom.label_params(tree)
        assert flat(labels) == expected
    # Labels sit at Variable positions: one label per Variable, no Variable left in the tree.
    labels = rowgeom.label_params(state)
    boxed = jax.tree.leaves(labels, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(isinstance(x, str) for x in boxed)


def test_plain_dict_shape_dtype_structs_and_common_model_names():
    m = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    llama = {"model": {"embed_tokens": {"embedding": m(V, D)},
                       "layers": {"0": {"self_attn": {"q_proj": {"kernel": m(D, D)}},
                                        "input_layernorm": {"weight": m(D)}}},
                       "norm": {"weight": m(D)}},
             "lm_head": {"kernel": m(D, V)}}
    assert flat(rowgeom.label_params(llama)) == {
        "model/embed_tokens/embedding": "embedding",
        "model/layers/0/self_attn/q_proj/kernel": "hidden",
        "model/layers/0/input_layernorm/weight": "vector",
        "model/norm/weight": "vector",
        "lm_head/kernel": "head"}
    # Meta-style names; "output" is a head at the root but BERT's attention/output is hidden.
    meta = {"tok_embeddings": np.zeros((V, D)), "output": np.zeros((V, D)),
            "encoder": {"layer": [{"attention": {"output": {"dense": np.zeros((D, D)),
                                                            "bias": np.zeros(D)}}}]},
            "scalar": 1.0}
    assert flat(rowgeom.label_params(meta)) == {
        "tok_embeddings": "embedding", "output": "head",
        "encoder/layer/0/attention/output/dense": "hidden",
        "encoder/layer/0/attention/output/bias": "vector", "scalar": "vector"}


def test_linen_params_with_partitioned_boxes():
    class Lm(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, D, name="wte")(ids)
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "mlp"))
            x = nn.Dense(D, kernel_init=init, name="mlp")(x)
            return nn.Dense(V, name="lm_head")(x)

    # Flax builds the tree (traced: no compile); its leaves are then host zeros, placed.
    abstract = jax.eval_shape(lambda: Lm().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32)))
    variables = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype)), abstract)
    assert isinstance(variables["params"]["mlp"]["kernel"], nn.Partitioned)
    assert flat(rowgeom.label_params(variables)) == {
        "params/wte/embedding": "embedding", "params/mlp/kernel": "hidden",
        "params/mlp/bias": "vector", "params/lm_head/kernel": "head",
        "params/lm_head/bias": "vector"}


def test_custom_names_and_rules_take_priority():
    params = {"tok": np.zeros((V, D)), "trunk": {"mix": np.zeros((D, D))},
              "readout": np.zeros((D, V)), "lm_head": {"kernel": np.zeros((D, V))}}
    labels = rowgeom.label_params(
        params, embedding_names={"tok"}, hidden_names={"trunk"}, head_names={"readout"},
        rules=[(r"^lm_head/", "hidden")])
    assert flat(labels) == {"tok": "embedding", "trunk/mix": "hidden", "readout": "head",
                            "lm_head/kernel": "hidden"}
    # The first matching rule wins; rules are plain re.search over the "/"-joined path.
    labels = rowgeom.label_params(params, rules=[("mix", "hidden"), ("trunk", "head")],
                                  default="hidden", extra_embedding_names={"tok"})
    assert flat(labels)["trunk/mix"] == "hidden"
    # Unnamed (d, V) matrices outside the blocks are heads by shape: "readout" and lm_head.
    assert flat(labels)["readout"] == "head"
    # The explicit default cannot send a vocabulary-sized matrix outside the blocks to Muon.
    with pytest.raises(ValueError, match=r"readout \(64, 16\) would be 'hidden' \(by "
                                         r"default='hidden'\)"):
        rowgeom.label_params({"tok": {"embedding": np.zeros((V, D))}, "readout": np.zeros((V, D)),
                              "lm_head": np.zeros((D, V))}, default="hidden")


def test_unlabelled_matrix_raises_naming_its_path_and_the_fixes():
    params = {"embed": np.zeros((V, D)), "lm_head": np.zeros((D, V)),
              "Dense_0": {"kernel": np.zeros((D, D))}}
    with pytest.raises(ValueError, match=r"Dense_0/kernel \(16, 16\)") as err:
        rowgeom.label_params(params)
    assert "rules=" in str(err.value) and "default='hidden'" in str(err.value)
    assert flat(rowgeom.label_params(params, default="hidden"))["Dense_0/kernel"] == "hidden"


def test_tied_embedding_needs_a_policy():
    params = {"wte": np.zeros((V, D)), "wpe": np.zeros((8, D)),
              "h": [{"attn": {"c_attn": np.zeros((D, 3 * D))}}]}
    with pytest.raises(ValueError, match="tied") as err:
        rowgeom.label_params(params)
    assert "wte" in str(err.value)
    as_embedding = flat(rowgeom.label_params(params, tied="embedding"))
    assert as_embedding == {"wte": "embedding", "wpe": "embedding", "h/0/attn/c_attn": "hidden"}
    # tied="head": the token table (not the position table) is trained by the head optimizer.
    as_head = flat(rowgeom.label_params(params, tied="head"))
    assert as_head == {"wte": "head", "wpe": "embedding", "h/0/attn/c_attn": "hidden"}
    # An ambiguous pair of tables needs a rule; the rule-labelled table is then the tied head.
    two = {"embed_a": {"embedding": np.zeros((V, D))}, "embed_b": {"embedding": np.zeros((V, D))}}
    with pytest.raises(ValueError, match="several embedding tables"):
        rowgeom.label_params(two, tied="head")
    ruled = rowgeom.label_params(two, tied="head", rules=[("embed_b", "head")])
    assert flat(ruled) == {"embed_a/embedding": "embedding", "embed_b/embedding": "head"}


def test_tied_policy_next_to_a_head_shaped_leaf():
    """tied= with a head of the table's shape beside it (EasyDeL's tied models keep an unused
    lm_head): the table is trained as the policy says, the head is flagged as probably unused
    (trained as an embedding); a separate head of another shape contradicts tied=."""
    params = {"embed": np.zeros((V, D)), "lm_head": np.zeros((D, V))}
    for tied in ("head", "embedding"):
        assert flat(rowgeom.label_params(params, tied=tied)) == {
            "embed": tied, "lm_head": "embedding"}
        notes = {r.path: r.note for r in rowgeom.describe(params, tied=tied)}
        assert notes["lm_head"].startswith("probably unused") and notes["embed"] == ""
    wider = {"embed": np.zeros((V, D)), "lm_head": np.zeros((2 * D, V))}  # not a copy of E
    with pytest.raises(ValueError, match=r"separate, untied head lm_head \(32, 64\)"):
        rowgeom.label_params(wider, tied="embedding")
    with pytest.raises(ValueError, match="tied must be one of"):
        rowgeom.label_params(params, tied="yes")
    with pytest.raises(ValueError, match="no embedding table"):
        rowgeom.label_params({"h": np.zeros((D, D))}, tied="head")


def test_bad_rules_and_names_are_reported():
    with pytest.raises(ValueError, match=r"rules\[0\] has an invalid regex"):
        rowgeom.label_params({}, rules=[("(", "hidden")])
    with pytest.raises(TypeError, match=r"rules\[0\] must be a \(regex, label\) pair"):
        rowgeom.label_params({}, rules=["hidden"])
    with pytest.raises(TypeError, match="hidden_names must be a collection"):
        rowgeom.label_params({}, hidden_names="mlp")


def _scales():
    # A distinct, recognisable step per label: update = -k * gradient.
    return {lab: optax.scale(-float(k)) for k, lab in enumerate(rowgeom.LABELS, start=1)}


def _expected_new_params(state, labels):
    ks = {lab: float(k) for k, lab in enumerate(rowgeom.LABELS, start=1)}
    table = flat(labels)
    return {p: np.asarray(x) - ks[table[p]] for p, x in flat(pure(state)).items()}


FORMS = ["prefix", "boxed", "dict", "callable", "partial"]


@functools.cache
def _partitioned_steps():
    """``{form: (labels, expected new params, new params)}``: one step of
    `partition_by_label` under nnx.Optimizer with the labels in each form, on its own TinyLM
    (host-drawn parameters: no initializer compile), the five steps in one nnx.jit program
    (a program per form would be five compiles)."""
    cases = {}
    for form in FORMS:
        model = tinylm_model(1)
        state = nnx.state(model, nnx.Param)
        labels = rowgeom.label_params(state)
        expected = _expected_new_params(state, labels)
        labels = {
            "prefix": labels,  # strings at Variable positions
            # strings inside Variables, as jax.tree.map over the state without is_leaf gives
            "boxed": jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(labels)),
            "dict": nnx.to_pure_dict(labels),  # a plain dict, not an nnx.State
            "callable": rowgeom.Labeler(),
            "partial": functools.partial(rowgeom.label_params),
        }[form]
        optimizer = nnx.Optimizer(model, rowgeom.partition_by_label(_scales(), labels),
                                  wrt=nnx.Param)
        cases[form] = model, optimizer, labels, expected

    @nnx.jit
    def step(pairs):
        for model, optimizer in pairs:
            grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
            optimizer.update(model, grads)

    step([(model, optimizer) for model, optimizer, _, _ in cases.values()])
    return {form: (labels, expected, flat(pure(nnx.state(model, nnx.Param))))
            for form, (model, _, labels, expected) in cases.items()}


@pytest.mark.parametrize("form", FORMS)
def test_partition_by_label_in_nnx_optimizer(form):
    labels, expected, got = _partitioned_steps()[form]
    if form == "boxed":
        assert isinstance(labels["lm_head"]["kernel"], nnx.Variable)
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-6, err_msg=path)


def test_plain_optax_partition_breaks_where_partition_by_label_does_not():
    """Why the wrapper exists: optax.partition matches labels by tree structure."""
    model = tinylm_model(2)  # host-drawn parameters: no initializer compile
    state = nnx.state(model, nnx.Param)
    as_dict = nnx.to_pure_dict(rowgeom.label_params(state))
    tx = optax.partition(_scales(), as_dict)
    with pytest.raises(ValueError, match="structure|Expected dict"):  # optax 0.2.8 | 0.2.6
        tx.init(state)  # dict labels vs nnx.State params
    tx = rowgeom.partition_by_label(_scales(), as_dict)
    opt_state = tx.init(state)
    grads = jax.tree.map(lambda x: np.ones(x.shape, x.dtype), pure(state))  # host: no compile
    updates, _ = jax.jit(tx.update)(grads, pure(opt_state), pure(state))
    assert float(np.asarray(updates["lm_head"]["kernel"])[0, 0]) == -2.0  # "head" is label 2


def test_partition_by_label_reports_missing_transforms_and_labels():
    params = {"embed": np.zeros((V, D)), "lm_head": {"kernel": np.zeros((D, V))},
              "norm": np.zeros(D)}
    labels = rowgeom.label_params(params)
    txs = _scales()
    del txs["head"], txs["vector"]
    with pytest.raises(ValueError, match=r"'head' \(used by lm_head/kernel\).*'vector'"):
        rowgeom.partition_by_label(txs, labels).init(params)
    with pytest.raises(ValueError, match="no label for parameter.*norm"):
        rowgeom.partition_by_label(_scales(), {"embed": "embedding", "lm_head": "head"}).init(
            params)
    with pytest.raises(TypeError, match=r"transforms\['head'\] must be an optax"):
        rowgeom.partition_by_label({"head": 1.0}, labels)


# ------------------------------------------------ never silently wrong: the structural checks

H, DH = 4, 4  # heads, head width (H * DH == D)


def _suggested_rules(message: str) -> list:
    """The ``rules=[...]`` literal an error message suggests (the fix a user would paste)."""
    import ast
    import re
    match = re.search(r"rules=(\[\(.*?\)\])", message)
    assert match, message
    return ast.literal_eval(match.group(1))


def _out_proj_model():
    """Head named out_proj (a hidden name) and a token table under an unknown name."""
    return {"vocab_table": {"embedding": np.zeros((V, D))},
            "blocks": [{"attn": {"query": {"kernel": np.zeros((D, H, DH)),
                                           "bias": np.zeros((H, DH))},
                                 "out": {"kernel": np.zeros((H, DH, D))}},
                        "ln": {"scale": np.zeros(D)}} for _ in range(LAYERS)],
            "out_proj": {"kernel": np.zeros((D, V)), "bias": np.zeros(V)}}


def test_regression_out_proj_head_is_never_sent_to_muon():
    """Issue: the error said "the head may be tied"; tied='embedding' then sent the real head
    and the per-head attention biases to Muon, silently."""
    params = _out_proj_model()
    for kwargs in ({}, {"tied": "embedding"}, {"default": "hidden"}):
        with pytest.raises(ValueError, match=r"out_proj/kernel \(16, 64\) would be 'hidden'") as e:
            rowgeom.label_params(params, **kwargs)
    rules = _suggested_rules(str(e.value))
    assert rules == [("^out_proj/kernel$", "head")]
    labels = flat(rowgeom.label_params(params, rules=rules))  # following the fix: exact
    assert labels["out_proj/kernel"] == "head" and labels["vocab_table/embedding"] == "embedding"
    assert labels["blocks/0/attn/query/bias"] == "vector"  # per-head bias (H, Dh): a vector
    assert labels["blocks/1/attn/out/kernel"] == "hidden"
    assert labels["out_proj/bias"] == "vector"
    # The other documented fix: extend the head names (out_proj inside the blocks stays hidden).
    extended = flat(rowgeom.label_params(
        {**params, "layers": {"0": {"out_proj": {"kernel": np.zeros((D, D))}}}},
        extra_head_names={"out_proj"}))
    assert extended["out_proj/kernel"] == "head"
    assert extended["layers/0/out_proj/kernel"] == "hidden"


def test_regression_auto_named_top_level_head_is_the_head():
    """Issue: Flax's automatic name (Dense_0 / Linear_0) for a top-level head was not a head."""
    for auto in ("Dense_0", "Linear_0"):
        params = {"Embed_0": {"embedding": np.zeros((V, D))},
                  "layers_0": {"Dense_0": {"kernel": np.zeros((D, 4 * D))},
                               "Dense_1": {"kernel": np.zeros((4 * D, D))}},
                  auto: {"kernel": np.zeros((D, V)), "bias": np.zeros(V)}}
        labels = flat(rowgeom.label_params(params))
        assert labels == {"Embed_0/embedding": "embedding",
                          "layers_0/Dense_0/kernel": "hidden", "layers_0/Dense_1/kernel": "hidden",
                          f"{auto}/kernel": "head", f"{auto}/bias": "vector"}
        # Saying it is tied: the head-shaped matrix is flagged as unused, not trained as a head.
        tied = rowgeom.describe(params, tied="embedding")
        assert [(r.label, r.note[:15]) for r in tied if r.path == f"{auto}/kernel"] == [
            ("embedding", "probably unused")]


def test_norms_and_biases_are_vectors_at_any_rank_and_layer_axes_are_not_matrix_axes():
    L = 3
    params = {"token_embedder": {"embedding": np.zeros((V, D))},
              "decoder": {"layers": {  # scanned, layer axis 1 (MaxText's param_scan_axis=1)
                  "pre_norm": {"scale": np.zeros((D, L))},
                  "input_layernorm": {"weight": np.zeros((D, L))},
                  "gate": {"w": np.zeros((D, L))},          # unnamed stacked vector
                  "self_attention": {"query": {"kernel": np.zeros((D, L, H, DH))}},
                  "mlp": {"wi": {"kernel": np.zeros((D, L, 4 * D))}}},
                  "logits_dense": {"kernel": np.zeros((D, V))}}}
    labels = flat(rowgeom.label_params(params))
    assert labels["decoder/layers/pre_norm/scale"] == "vector"
    assert labels["decoder/layers/input_layernorm/weight"] == "vector"
    assert labels["decoder/layers/gate/w"] == "vector"
    assert labels["decoder/layers/mlp/wi/kernel"] == "hidden"
    assert labels["decoder/logits_dense/kernel"] == "head"


def test_named_head_without_a_vocabulary_axis_raises_and_its_fix_works():
    params = {"embed": {"embedding": np.zeros((V, D))}, "layers": [{"mlp": np.zeros((D, D))}],
              "head": {"kernel": np.zeros((D, 10))},          # e.g. a classifier, not the LM head
              "lm_out": {"kernel": np.zeros((D, V))}}
    with pytest.raises(ValueError, match=r"head/kernel \(16, 10\) is named as the head") as e:
        rowgeom.label_params(params)
    labels = flat(rowgeom.label_params(params, rules=_suggested_rules(str(e.value))))
    assert labels["head/kernel"] == "hidden" and labels["lm_out/kernel"] == "head"


def test_every_unlabelled_matrix_suggestion_leads_to_a_labelling_or_a_clear_error():
    params = {"embed": {"embedding": np.zeros((V, D))}, "lm_head": {"kernel": np.zeros((D, V))},
              "router": {"kernel": np.zeros((D, 8))}}
    with pytest.raises(ValueError, match=r"router/kernel \(16, 8\)") as e:
        rowgeom.label_params(params)
    msg = str(e.value)
    assert flat(rowgeom.label_params(params, rules=_suggested_rules(msg)))["router/kernel"] \
        == "hidden"
    assert "extra_hidden_names=" in msg and "default='hidden'" in msg
    assert flat(rowgeom.label_params(params, extra_hidden_names={"router"}))["router/kernel"] \
        == "hidden"
    assert flat(rowgeom.label_params(params, default="hidden"))["router/kernel"] == "hidden"
    # A (V, d) matrix nobody names: the message says both readings; default='hidden' is refused.
    pt = {"embed": {"embedding": np.zeros((V, D))}, "layers": [{"mlp": np.zeros((D, D))}],
          "decoder_weight": np.zeros((V, D))}
    with pytest.raises(ValueError, match=r"\(V, d\)-shaped") as e:
        rowgeom.label_params(pt)
    with pytest.raises(ValueError, match="would be 'hidden'"):
        rowgeom.label_params(pt, default="hidden")
    assert flat(rowgeom.label_params(pt, rules=[("^decoder_weight$", "head")]))[
        "decoder_weight"] == "head"


def test_tied_suggestions_lead_to_correct_labels():
    params = {"wte": {"embedding": np.zeros((V, D))},
              "h": [{"attn": {"c_attn": {"kernel": np.zeros((D, 3 * D))}}}]}
    with pytest.raises(ValueError, match="tied='embedding'.*tied='head'") as e:
        rowgeom.label_params(params)
    assert "rules=[(regex, 'head')]" in str(e.value)
    assert flat(rowgeom.label_params(params, tied="embedding"))["wte/embedding"] == "embedding"
    assert flat(rowgeom.label_params(params, tied="head"))["wte/embedding"] == "head"


def test_structure_edge_cases_route_or_raise():
    # A root list of modules (sequential) is not a block container: the last entry's (d, V)
    # matrix is the head, and an unnamed middle matrix is an error, never a silent 'hidden'.
    seq = [{"embedding": np.zeros((V, D))}, {"w": np.zeros((D, D))}, {"kernel": np.zeros((D, V))}]
    with pytest.raises(ValueError, match=r"no label for these matrices: 1/w \(16, 16\)"):
        rowgeom.label_params(seq)
    assert flat(rowgeom.label_params(seq, rules=[("^1/w$", "hidden")])) == {
        "0/embedding": "embedding", "1/w": "hidden", "2/kernel": "head"}
    # Two vocabularies (source and target tables): the head matches the target one.
    seq2seq = {"encoder_embed": {"embedding": np.zeros((2 * V, D))},
               "decoder_embed": {"embedding": np.zeros((V, D))},
               "layers": [{"mlp": np.zeros((D, D))}], "logitdense": {"kernel": np.zeros((D, V))}}
    assert flat(rowgeom.label_params(seq2seq))["logitdense/kernel"] == "head"
    # A kernel inside a norm module (adaptive norms project a condition) is a matrix.
    ada = {"embed": {"embedding": np.zeros((V, D))}, "lm_head": {"kernel": np.zeros((D, V))},
           "layers": [{"ada_norm": {"kernel": np.zeros((D, 2 * D)), "scale": np.zeros(D)}}]}
    labels = flat(rowgeom.label_params(ada))
    assert labels["layers/0/ada_norm/kernel"] == "hidden"
    assert labels["layers/0/ada_norm/scale"] == "vector"


def test_an_unstacked_block_container_is_not_taken_for_scanned_layers():
    """One block under "layers" with no numbered children: its rank-2 kernels are matrices
    (no layer axis), never stacked vectors; with a scanned stack beside it nothing changes."""
    one = {"embed": {"embedding": np.zeros((V, D))}, "lm_head": {"kernel": np.zeros((D, V))},
           "layers": {"attn": {"q": {"kernel": np.zeros((D, D))}},
                      "mlp": {"w": np.zeros((D, 4 * D))}, "norm": {"scale": np.zeros(D)}}}
    labels = flat(rowgeom.label_params(one))
    assert labels["layers/attn/q/kernel"] == "hidden" and labels["layers/mlp/w"] == "hidden"
    rows = {r.path: r.geometry for r in rowgeom.describe(one)}
    assert rows["layers/mlp/w"] == "Muon, in 0 out 1"
    del one["layers"]["norm"]  # no norm either: every leaf's axis 0 is d, still no layer axis
    labels = flat(rowgeom.label_params(one))
    assert labels["layers/attn/q/kernel"] == "hidden" and labels["layers/mlp/w"] == "hidden"
