"""Mixture-of-experts layouts, routers, layer stacks by structure, nameless trees.

Each tree is written in the exact layout of a public codebase (names and shapes read from its
source), at a small size with pairwise different axis sizes, so that a wrong axis cannot pass
by coincidence. Sources:

- MaxText (``src/maxtext``): ``layers/moe.py`` ``RoutedMoE`` (``gate/kernel (d, E)``, ``wi_0`` /
  ``wi_1`` ``(E, d, f)``, ``wo (E, f, d)``, biases ``wi_0_bias (E, f)``), ``models/mixtral.py``
  (``MoeBlock_0``), ``models/qwen3.py`` (``moe_block``), ``models/gpt_oss.py`` (``GptOssMlp``,
  ``GptOssAttention/sinks``, blocks ``layers/layers_0``, ``layers/layers_1``),
  ``models/deepseek.py`` (``DeepSeekMoeBlock_0/MoeBlock_0`` and ``shared_experts``, MLA
  ``wq_a``/``q_norm``/``wq_b``/``wkv_a``/``kv_norm``/``wkv_b``), the scanned stacks
  ``dense_layers`` / ``moe_layers`` (``decoders.py``) and the checkpoint converters
  (``convert_deepseek_family_ckpt.py``, ``convert_gpt_oss_ckpt.py``): scanned layers put the
  layer axis at position 1 (``param_scan_axis: 1``), after the expert axis of expert stacks
  (``(E, L, d, f)``). MaxText needs Python >= 3.12, so these are written by hand.
- EasyDeL 0.3 (``easydel/modules/*/modeling_*.py``, ``layers/linears/_linear_moe.py``: expert
  kernels ``(E, in, out)``), as its own classes build them (``tests/rowgeom/test_real_packages.py``
  builds them for real where EasyDeL installs): Mixtral ``block_sparse_moe/{gate,experts}``,
  Qwen2-MoE ``mlp/{gate,experts,shared_expert,shared_expert_gate (d, 1)}``, DeepSeek-V3
  ``mlp/{gate,experts,shared_experts}`` with ``gate/e_score_correction_bias``, gpt-oss
  ``mlp/{router,experts}`` with ``(E, f)`` expert biases, Llama 4 ``feed_forward/{router,
  experts,shared_expert}`` on every other layer.
- praxis ``layers/transformers.py`` ``TransformerFeedForwardMoe`` (``ff_layer/gate (d, E)``,
  ``wi_0 (E, d, h)``, ``wo_0 (E, h, d)``) in ``StackedTransformerRepeated``
  (``transformer/repeat/sub/x_layers_i``, a leading repeat axis on every leaf),
  ``embedding_lookup/emb_var`` and ``softmax/logits_ffn/linear/w``.
- Hugging Face PyTorch-style numbered experts (``block_sparse_moe/experts/{i}/w1``), as
  converted checkpoints keep them.
- penzai 0.2's native training tree: ``pz.unbind_params(model, freeze=True)`` gives a tuple of
  ``ParameterValue``, whose key paths are ``(i, 'value', 'data_array')``: no names at all.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rowgeom
from rowgeom._tree import tree_paths

V, D, H, K, DH, F, E, FE, L = 96, 32, 4, 2, 8, 64, 6, 48, 3
FS, QL, KVL, NOPE, ROPE, VH, LD = 40, 16, 10, 8, 4, 6, 2  # DeepSeek: shared, MLA ranks, dense L


def S(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _filled(tree, value):
    """Numpy arrays of `tree`'s shapes and dtypes, all `value` (jnp.zeros and jnp.ones, and
    jnp.asarray, compile a program per shape)."""
    return jax.tree.map(lambda s: np.full(s.shape, value, s.dtype), tree)


@functools.cache
def _first_step(tx):
    """`tx`'s first update from a fresh state: init and update in one jitted program (eagerly,
    init compiles each of its zeros)."""
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])


def _stacked(scanned, depth=L):
    """MaxText's scanned layout: the layer axis at position 1 (after an expert axis)."""
    return (lambda *s: S(s[0], depth, *s[1:])) if scanned else S


# --------------------------------------------------------------------------- the layouts


def maxtext_mixtral(scanned=True):
    st = _stacked(scanned)
    layer = {"pre_self_attention_layer_norm": {"scale": st(D)},
             "self_attention": {"query": {"kernel": st(D, H, DH)}, "key": {"kernel": st(D, K, DH)},
                                "value": {"kernel": st(D, K, DH)},
                                "out": {"kernel": st(H, DH, D)}},
             "post_self_attention_layer_norm": {"scale": st(D)},
             "MoeBlock_0": {"gate": {"kernel": st(D, E)}, "wi_0": st(E, D, FE),
                            "wi_1": st(E, D, FE), "wo": st(E, FE, D)}}
    layers = {"layers": layer} if scanned else {f"layers_{i}": layer for i in range(L)}
    return {"params": {"token_embedder": {"embedding": S(V, D)},
                       "decoder": {**layers, "decoder_norm": {"scale": S(D)},
                                   "logits_dense": {"kernel": S(D, V)}}}}


def moe_only(scanned=True):
    """maxtext_mixtral without attention: the smallest tree with a scanned router and experts."""
    tree = maxtext_mixtral(scanned)
    for name, block in tree["params"]["decoder"].items():
        if name.startswith("layers"):
            block.pop("self_attention", None)  # the unscanned layers share one dict
    return tree


def maxtext_qwen3_moe():
    st = _stacked(True)
    layer = {"pre_self_attention_layer_norm": {"scale": st(D)},
             "self_attention": {"query": {"kernel": st(D, H, DH)}, "key": {"kernel": st(D, K, DH)},
                                "value": {"kernel": st(D, K, DH)},
                                "out": {"kernel": st(H, DH, D)},
                                "query_norm": {"scale": st(DH)}, "key_norm": {"scale": st(DH)}},
             "post_self_attention_layer_norm": {"scale": st(D)},
             "moe_block": {"gate": {"kernel": st(D, E)}, "wi_0": st(E, D, FE),
                           "wi_1": st(E, D, FE), "wo": st(E, FE, D)}}
    return {"params": {"token_embedder": {"embedding": S(V, D)},
                       "decoder": {"layers": layer, "decoder_norm": {"scale": S(D)},
                                   "logits_dense": {"kernel": S(D, V)}}}}


def _mla(st):
    return {"wq_a": {"kernel": st(D, QL)}, "q_norm": {"scale": st(QL)},
            "wq_b": {"kernel": st(QL, H, NOPE + ROPE)},
            "wkv_a": {"kernel": st(D, KVL + ROPE)}, "kv_norm": {"scale": st(KVL)},
            "wkv_b": {"kernel": st(KVL, H, NOPE + VH)}, "out": {"kernel": st(H, VH, D)}}


def maxtext_deepseek3():
    dense, moe = _stacked(True, LD), _stacked(True, L)
    norms = lambda st: {"pre_self_attention_layer_norm": {"scale": st(D)},
                        "post_self_attention_layer_norm": {"scale": st(D)}}
    return {"params": {"token_embedder": {"embedding": S(V, D)}, "decoder": {
        "dense_layers": {**norms(dense), "self_attention": _mla(dense),
                         "mlp": {"wi_0": {"kernel": dense(D, F)}, "wi_1": {"kernel": dense(D, F)},
                                 "wo": {"kernel": dense(F, D)}}},
        "moe_layers": {**norms(moe), "self_attention": _mla(moe), "DeepSeekMoeBlock_0": {
            "MoeBlock_0": {"gate": {"kernel": moe(D, E), "bias": moe(E)}, "wi_0": moe(E, D, FE),
                           "wi_1": moe(E, D, FE), "wo": moe(E, FE, D)},
            "shared_experts": {"wi_0": {"kernel": moe(D, FS)}, "wi_1": {"kernel": moe(D, FS)},
                               "wo": {"kernel": moe(FS, D)}}}},
        "decoder_norm": {"scale": S(D)}, "logits_dense": {"kernel": S(D, V)}}}}


def maxtext_gpt_oss():
    st = _stacked(True)

    def block():
        attn = {n: {"kernel": st(D, h, DH), "bias": st(h, DH)}
                for n, h in (("query", H), ("key", K), ("value", K))}
        attn["out"] = {"kernel": st(H, DH, D), "bias": st(D)}
        attn["sinks"] = st(H)
        return {"pre_self_attention_layer_norm": {"scale": st(D)},
                "post_self_attention_layer_norm": {"scale": st(D)},
                "GptOssAttention": attn,
                "GptOssMlp": {"gate": {"kernel": st(D, E), "bias": st(E)},
                              "wi_0": st(E, D, FE), "wi_0_bias": st(E, FE),
                              "wi_1": st(E, D, FE), "wi_1_bias": st(E, FE),
                              "wo": st(E, FE, D), "wo_bias": st(E, D)}}

    return {"params": {"token_embedder": {"embedding": S(V, D)}, "decoder": {
        "layers": {"layers_0": block(), "layers_1": block()},
        "decoder_norm": {"scale": S(D)}, "logits_dense": {"kernel": S(D, V)}}}}


def _easydel_attn():
    return {"self_attn": {"q_proj": {"kernel": S(D, H * DH)}, "k_proj": {"kernel": S(D, K * DH)},
                          "v_proj": {"kernel": S(D, K * DH)}, "o_proj": {"kernel": S(H * DH, D)}},
            "input_layernorm": {"kernel": S(D)}, "post_attention_layernorm": {"kernel": S(D)}}


def _easydel(layers, tied=False):
    model = {"embed_tokens": {"embedding": S(V, D)}, "layers": dict(enumerate(layers)),
             "norm": {"kernel": S(D)}}
    model["layers"] = {str(i): layer for i, layer in model["layers"].items()}
    return {"model": model, "lm_head": {"kernel": S(D, V)}}


def _experts(*names, bias=False):
    out = {}
    for name in names:
        shape = (E, FE, D) if name in ("w2", "down_proj") else (E, D, FE)
        out[name] = {"kernel": S(*shape)}
        if bias:
            out[name]["bias"] = S(E, shape[-1])
    return out


def easydel_mixtral():
    moe = {"gate": {"kernel": S(D, E)}, "experts": _experts("w1", "w2", "w3")}
    return _easydel([{**_easydel_attn(), "block_sparse_moe": moe} for _ in range(2)])


def easydel_qwen2_moe():
    mlp = {"gate": {"kernel": S(D, E)}, "experts": _experts("gate_proj", "up_proj", "down_proj"),
           "shared_expert": {"gate_proj": {"kernel": S(D, FS)}, "up_proj": {"kernel": S(D, FS)},
                             "down_proj": {"kernel": S(FS, D)}},
           "shared_expert_gate": {"kernel": S(D, 1)}}
    return _easydel([{**_easydel_attn(), "mlp": mlp} for _ in range(2)])


def easydel_deepseek_v3():
    attn = {"self_attn": {"q_a_proj": {"kernel": S(D, QL)}, "q_a_layernorm": {"kernel": S(QL)},
                          "q_b_proj": {"kernel": S(QL, H * (NOPE + ROPE))},
                          "kv_a_proj_with_mqa": {"kernel": S(D, KVL + ROPE)},
                          "kv_a_layernorm": {"kernel": S(KVL)},
                          "kv_b_proj": {"kernel": S(KVL, H * (NOPE + VH))},
                          "o_proj": {"kernel": S(H * VH, D)}},
            "input_layernorm": {"kernel": S(D)}, "post_attention_layernorm": {"kernel": S(D)}}
    dense = {**attn, "mlp": {"gate_proj": {"kernel": S(D, F)}, "up_proj": {"kernel": S(D, F)},
                             "down_proj": {"kernel": S(F, D)}}}
    moe = {**attn, "mlp": {"gate": {"kernel": S(D, E), "e_score_correction_bias": S(E)},
                           "experts": _experts("gate_proj", "up_proj", "down_proj"),
                           "shared_experts": {"gate_proj": {"kernel": S(D, FS)},
                                              "up_proj": {"kernel": S(D, FS)},
                                              "down_proj": {"kernel": S(FS, D)}}}}
    return _easydel([dense, moe, moe])


def easydel_gpt_oss():
    mlp = {"router": {"kernel": S(D, E), "bias": S(E)},
           "experts": _experts("gate_proj", "up_proj", "down_proj", bias=True)}
    layer = {**_easydel_attn(), "mlp": mlp}
    layer["self_attn"] = {**layer["self_attn"], "sinks": S(H)}
    return _easydel([layer, layer])


def easydel_llama4():
    dense = {**_easydel_attn(), "feed_forward": {
        "gate_proj": {"kernel": S(D, F)}, "up_proj": {"kernel": S(D, F)},
        "down_proj": {"kernel": S(F, D)}}}
    moe = {**_easydel_attn(), "feed_forward": {
        "router": {"kernel": S(D, E)}, "experts": _experts("gate_proj", "up_proj", "down_proj"),
        "shared_expert": {"gate_proj": {"kernel": S(D, F)}, "up_proj": {"kernel": S(D, F)},
                          "down_proj": {"kernel": S(F, D)}}}}
    return _easydel([dense, moe])


def praxis_moe():
    """praxis LM with a repeated stack (leading repeat axis) of MoE transformer layers."""
    rep = lambda *s: S(L, *s)
    layer = {"layer_norm": {"scale": rep(D), "bias": rep(D)},
             "self_attention": {n: {"w": rep(D, H, DH)} for n in ("query", "key", "value", "post")},
             "ff_layer": {"layer_norm": {"scale": rep(D), "bias": rep(D)},
                          "gate": rep(D, E), "wi_0": rep(E, D, FE), "wo_0": rep(E, FE, D)}}
    return {"params": {"lm": {"embedding_lookup": {"emb_var": S(V, D)},
                              "transformer": {"repeat": {"sub": {"x_layers_0": layer}}},
                              "final_ln": {"scale": S(D), "bias": S(D)},
                              "softmax": {"logits_ffn": {"linear": {"w": S(D, V)}}}}}}


def hf_numbered_experts():
    """Hugging Face PyTorch-style Mixtral, one module per expert, converted to (in, out)."""
    experts = {str(i): {"w1": {"kernel": S(D, FE)}, "w2": {"kernel": S(FE, D)},
                        "w3": {"kernel": S(D, FE)}} for i in range(E)}
    layer = {**_easydel_attn(), "block_sparse_moe": {"gate": {"kernel": S(D, E)},
                                                      "experts": experts}}
    return _easydel([layer, layer])


# ------------------------------------------------------------------- expected routing tables

MAT = ((0,), (1,))
EXP = ((1,), (2,))          # an unscanned expert stack (E, in, out)
EXP_SCANNED = ((2,), (3,))  # (E, L, in, out)
ATT_SCANNED = {"q": ((0,), (2, 3)), "o": ((0, 2), (3,))}
TABLES = {
    "maxtext-mixtral-scanned": (maxtext_mixtral, [
        (r"token_embedder/", "embedding", None), (r"norm/scale$", "vector", None),
        (r"self_attention/(query|key|value)/", "hidden", ATT_SCANNED["q"]),
        (r"self_attention/out/", "hidden", ATT_SCANNED["o"]),
        (r"MoeBlock_0/gate/kernel$", "router", ((0,), (2,))),
        (r"MoeBlock_0/w[io](_\d)?$", "hidden", EXP_SCANNED),
        (r"logits_dense/", "head", 1)]),
    "maxtext-mixtral-unscanned": (lambda: maxtext_mixtral(False), [
        (r"token_embedder/", "embedding", None), (r"norm/scale$", "vector", None),
        (r"self_attention/(query|key|value)/", "hidden", ((0,), (1, 2))),
        (r"self_attention/out/", "hidden", ((0, 1), (2,))),
        (r"MoeBlock_0/gate/kernel$", "router", MAT),
        (r"MoeBlock_0/w[io](_\d)?$", "hidden", EXP),
        (r"logits_dense/", "head", 1)]),
    "maxtext-qwen3-moe": (maxtext_qwen3_moe, [
        (r"token_embedder/", "embedding", None), (r"norm/scale$", "vector", None),
        (r"self_attention/(query|key|value)/kernel", "hidden", ATT_SCANNED["q"]),
        (r"self_attention/out/", "hidden", ATT_SCANNED["o"]),
        (r"moe_block/gate/kernel$", "router", ((0,), (2,))),
        (r"moe_block/w[io](_\d)?$", "hidden", EXP_SCANNED),
        (r"logits_dense/", "head", 1)]),
    "maxtext-deepseek3": (maxtext_deepseek3, [
        (r"token_embedder/", "embedding", None), (r"norm/scale$|gate/bias$", "vector", None),
        (r"self_attention/(wq_a|wkv_a)/", "hidden", ((0,), (2,))),
        (r"self_attention/(wq_b|wkv_b)/", "hidden", ((0,), (2, 3))),
        (r"self_attention/out/", "hidden", ATT_SCANNED["o"]),
        (r"dense_layers/mlp/", "hidden", ((0,), (2,))),
        (r"MoeBlock_0/gate/kernel$", "router", ((0,), (2,))),
        (r"MoeBlock_0/w[io](_\d)?$", "hidden", EXP_SCANNED),
        (r"shared_experts/", "hidden", ((0,), (2,))),
        (r"logits_dense/", "head", 1)]),
    "maxtext-gpt-oss": (maxtext_gpt_oss, [
        (r"token_embedder/", "embedding", None),
        (r"norm/scale$|/bias$|_bias$|/sinks$", "vector", None),
        (r"GptOssAttention/(query|key|value)/kernel", "hidden", ATT_SCANNED["q"]),
        (r"GptOssAttention/out/kernel", "hidden", ATT_SCANNED["o"]),
        (r"GptOssMlp/gate/kernel$", "router", ((0,), (2,))),
        (r"GptOssMlp/w[io](_\d)?$", "hidden", EXP_SCANNED),
        (r"logits_dense/", "head", 1)]),
    "praxis-moe-repeated": (praxis_moe, [
        (r"embedding_lookup/", "embedding", None), (r"/(scale|bias)$", "vector", None),
        (r"self_attention/(query|key|value|post)/w$", "hidden", ((1,), (2, 3))),
        (r"ff_layer/gate$", "router", ((1,), (2,))),
        (r"ff_layer/w[io]_0$", "hidden", EXP_SCANNED),
        (r"logits_ffn/", "head", 1)]),
}
_EASYDEL_ROWS = [
    (r"embed_tokens/", "embedding", None),
    (r"(norm|layernorm)/kernel$|bias$|sinks$", "vector", None),
    (r"shared_expert_gate/kernel$", "vector", None),  # (d, 1): no matrix structure
    (r"self_attn/\w+_proj(_with_mqa)?/kernel$", "hidden", MAT),
    (r"/(gate|router)/kernel$", "router", MAT),
    (r"/experts/\w+/kernel$", "hidden", EXP),
    (r"/experts/\d+/w\d/kernel$", "hidden", MAT),
    (r"(mlp|feed_forward)/(shared_experts?/)?(gate|up|down)_proj/kernel$", "hidden", MAT),
    (r"^lm_head/kernel$", "head", 1)]
TABLES.update({name: (build, _EASYDEL_ROWS) for name, build in {
    "easydel-mixtral": easydel_mixtral, "easydel-qwen2-moe": easydel_qwen2_moe,
    "easydel-deepseek-v3": easydel_deepseek_v3, "easydel-gpt-oss": easydel_gpt_oss,
    "easydel-llama4": easydel_llama4, "hf-numbered-experts": hf_numbered_experts}.items()})


def _geometry(plan):
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
    if plan.muon_dims is not None:
        return as_tuple(plan.muon_dims.reduction_axis), as_tuple(plan.muon_dims.output_axis)
    return plan.vocab_axis if plan.label == "head" else None


def check_table(family, plans, table):
    for plan in plans:
        rows = [(label, geom) for regex, label, geom in table if re.search(regex, plan.path)]
        assert rows, f"{family}: {plan.path} {plan.shape} matches no table row"
        assert (plan.label, _geometry(plan)) == rows[0], f"{family}: {plan.path} {plan.shape}"


@pytest.mark.parametrize("family", sorted(TABLES))
def test_moe_layout_routes_exactly_with_no_options(family):
    build, table = TABLES[family]
    plans = rowgeom.describe(build())
    check_table(family, plans, table)
    assert any(p.label == "router" for p in plans)
    labels = {"/".join(p): lab for p, lab in tree_paths(rowgeom.label_params(build()))}
    assert labels == {p.path: p.label for p in plans}  # label_params agrees with the plan


@pytest.mark.slow
def test_expert_stacks_are_orthogonalised_per_expert_and_per_layer():
    """Muon on a scanned MaxText expert stack (E, L, d, f) equals Muon on each (d, f) slice."""
    params = _filled(moe_only(), 0.0)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    tx = rowgeom.lm_optimizer(1e-2, weight_decay=0.0,
                              muon=rowgeom.MuonOptions(momentum=0.0, nesterov=False))
    updates = _first_step(tx)(grads, params)
    ref = rowgeom.muon_orthogonalize()
    ref_step = jax.jit(lambda u: ref.update(u, ref.init(u)))  # one compile for the four
    g = grads["params"]["decoder"]["layers"]["MoeBlock_0"]["wo"]
    got = np.asarray(updates["params"]["decoder"]["layers"]["MoeBlock_0"]["wo"])
    for e in (0, E - 1):
        for layer in (0, L - 1):
            want, _ = ref_step(g[e, layer])
            np.testing.assert_allclose(got[e, layer], -1e-2 * np.asarray(want), rtol=2e-3,
                                       atol=1e-7)


# --------------------------------------------------------------------- the router group


def _router_grads(params, shift_only, seed=0):
    """Random grads; the router's a gradient whose expert rows are equal when `shift_only`."""
    rng = np.random.default_rng(seed)
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)  # numpy
    gate = grads["params"]["decoder"]["layers"]["MoeBlock_0"]["gate"]["kernel"]  # (d, L, E)
    if shift_only:
        # dL/dz = c(token)·1_E: every logit shifted by the same amount, so G = g 1ᵀ per layer.
        g = rng.normal(size=gate.shape[:2] + (1,))
        gate = np.broadcast_to(g, gate.shape).astype(np.float32)
    grads["params"]["decoder"]["layers"]["MoeBlock_0"]["gate"]["kernel"] = gate
    return grads


@pytest.mark.slow
def test_rownorm_router_gives_a_zero_step_for_an_equal_shift_of_all_logits():
    params = _filled(moe_only(), 1.0)
    path = ("params", "decoder", "layers", "MoeBlock_0", "gate", "kernel")
    pick = lambda tree: tree[path[0]][path[1]][path[2]][path[3]][path[4]][path[5]]
    rownorm = rowgeom.lm_optimizer(1e-2, router="rownorm", weight_decay=0.0)
    muon = rowgeom.lm_optimizer(1e-2, weight_decay=0.0)
    for tx in (rownorm, muon):
        grads = _router_grads(params, shift_only=True)
        step = _first_step(tx)(grads, params)
        size = float(np.abs(pick(step)).max())
        if tx is rownorm:
            assert size == 0.0  # the shift is no direction a softmax router can see
        else:
            assert size > 1e-4  # Muon moves along it
    # A general gradient: each layer's step is -lr (u_i - ū) over the experts with ||u_i|| <= 1,
    # so its expert rows sum to zero and their diameter is at most 2 lr, layer by layer.
    grads = _router_grads(params, shift_only=False)
    step = _first_step(rownorm)(grads, params)
    s = np.asarray(pick(step))
    for layer in range(L):
        rows = s[:, layer, :].T  # (E, d): one row per expert
        np.testing.assert_allclose(rows.sum(axis=0), 0.0, atol=1e-7)
        assert float(rowgeom.row_diameter(rows, vocab_axis=0)) <= 2e-2 * (1 + 1e-5)
    plan = {r.path: r for r in rowgeom.describe(params, 1e-2, router="rownorm")}
    row = plan["/".join(path)]
    assert row.geometry == "RowNorm over experts, expert axis 2 batch 1" and row.vocab_axis == 2


def test_rownorm_router_matches_rownorm_direction_per_layer():
    params = _filled(moe_only(), 0.0)
    grads = _router_grads(params, shift_only=False, seed=1)
    tx = rowgeom.lm_optimizer(3e-3, router=rowgeom.RouterOptions(optimizer="rownorm",
                                                                   momentum=0.0))
    g = grads["params"]["decoder"]["layers"]["MoeBlock_0"]["gate"]["kernel"]
    # The step and each layer's rownorm_direction in one jitted program (numpy in and out).
    step, directions = jax.jit(lambda grads, params, g: (
        tx.update(grads, tx.init(params), params)[0],
        [rowgeom.rownorm_direction(g[:, layer, :], vocab_axis=1) for layer in range(L)]))(
        grads, params, g)
    got = np.asarray(step["params"]["decoder"]["layers"]["MoeBlock_0"]["gate"]["kernel"])
    for layer in range(L):
        want = -3e-3 * np.asarray(directions[layer], np.float64)
        np.testing.assert_allclose(got[:, layer, :], want, rtol=1e-5, atol=1e-8)


def test_router_group_options_resolve_and_adamw_mode_runs():
    hp = rowgeom.group_options(2e-3, router="adamw",
                               groups={"router": rowgeom.GroupOptions(learning_rate=1e-3)})
    assert hp["router"] == rowgeom.GroupOptions(1e-3, 0.1, 0.9)  # AdamW's b1
    assert rowgeom.group_options(1e-3)["router"].momentum == 0.95  # the hidden group's Muon
    with pytest.raises(ValueError, match="RouterOptions.optimizer must be one of"):
        rowgeom.RouterOptions(optimizer="sgd")
    params = _filled(moe_only(scanned=False), 0.0)
    options = dict(router="adamw", groups={"router": rowgeom.GroupOptions(learning_rate=1e-3)})
    rows = {r.path: r for r in rowgeom.describe(params, 2e-3, **options)}
    gate = "params/decoder/layers_0/MoeBlock_0/gate/kernel"
    assert rows[gate].geometry == "AdamW"
    tx = rowgeom.lm_optimizer(2e-3, **options)
    step = _first_step(tx)(jax.tree.map(np.ones_like, params), params)
    np.testing.assert_allclose(step["params"]["decoder"]["layers_0"]["MoeBlock_0"]["gate"]["kernel"],
                               -1e-3, rtol=1e-4)  # AdamW's first step: -lr·sign(g)


# ------------------------------------------------------- one round of questions, never wrong


def test_undecided_expert_stacks_are_listed_in_one_error_with_the_mapping_to_paste():
    """Expert stacks with no router to tell E: every one of them in one error, and pasting its
    mapping routes the whole tree."""
    params = maxtext_mixtral()
    for block in (params["params"]["decoder"]["layers"],):
        block["experts"] = block.pop("MoeBlock_0")
        del block["experts"]["gate"]
    with pytest.raises(ValueError) as err:
        rowgeom.describe(params)
    message = str(err.value)
    assert message.startswith("lm_optimizer: cannot infer Muon's matrix axes of 3 parameter(s)")
    for name in ("wi_0", "wi_1", "wo"):
        assert f"params/decoder/layers/experts/{name} (6, 3, " in message
    pasted = message[message.index("muon=rowgeom.MuonOptions("):]
    muon = eval(pasted.removeprefix("muon="), {"rowgeom": rowgeom})  # noqa: S307
    rows = {r.path: r for r in rowgeom.describe(params, muon=muon)}
    assert rows["params/decoder/layers/experts/wo"].geometry == "Muon, in 2 out 3 batch 0,1"
    assert "batch axes 0 (experts), 1 (layers)" in message


def test_layer_stacks_are_found_by_structure_whatever_their_name():
    """A scanned stack under an unknown container name: its layer axis is a batch axis."""
    tree = maxtext_mixtral()
    dec = tree["params"]["decoder"]
    dec["stack_of_blocks"] = dec.pop("layers")
    rows = {r.path: r for r in rowgeom.describe(tree)}
    assert rows["params/decoder/stack_of_blocks/self_attention/query/kernel"].geometry == (
        "Muon, in 0 out 2,3 batch 1")
    assert rows["params/decoder/stack_of_blocks/MoeBlock_0/wo"].geometry == (
        "Muon, in 2 out 3 batch 0,1")
    assert rows["params/decoder/stack_of_blocks/pre_self_attention_layer_norm/scale"].label == (
        "vector")


def test_a_dense_gate_is_not_a_router_and_a_router_needs_experts_beside_it():
    dense = {"embed": {"embedding": S(V, D)}, "lm_head": {"kernel": S(D, V)},
             "layers": {"0": {"mlp": {"gate": {"kernel": S(D, F)}, "up": {"kernel": S(D, F)},
                                      "down": {"kernel": S(F, D)}}}}}
    labels = {r.path: r.label for r in rowgeom.describe(dense)}
    assert labels["layers/0/mlp/gate/kernel"] == "hidden"
    # A "router" with no expert stacks beside it: named, but never labelled by the name alone.
    lone = {"embed": {"embedding": S(V, D)}, "lm_head": {"kernel": S(D, V)},
            "router": {"kernel": S(D, E)}}
    with pytest.raises(ValueError, match=r"router/kernel \(32, 6\): 'hidden' or 'router'"):
        rowgeom.label_params(lone)
    assert rowgeom.label_params(lone, rules=[("^router/", "router")])["router"]["kernel"] == (
        "router")


def test_an_unnamed_router_is_found_by_its_shape_beside_expert_stacks():
    tree = easydel_mixtral()
    for layer in tree["model"]["layers"].values():
        moe = layer["block_sparse_moe"] = dict(layer["block_sparse_moe"])
        moe["wg"] = moe.pop("gate")
    rows = {r.path: r for r in rowgeom.describe(tree)}
    assert rows["model/layers/0/block_sparse_moe/wg/kernel"].label == "router"
    assert rows["model/layers/0/block_sparse_moe/experts/w2/kernel"].geometry == (
        "Muon, in 1 out 2 batch 0")


def penzai_unbound(stacked=True):
    """penzai 0.2's unbind_params(freeze=True) tuple: key paths (i, 'value', 'data_array')
    (a ParameterValue's value, a NamedArray's data_array; the names live in metadata only)."""
    shapes = [(V, D), (L, D), (L, D, K, 2, DH), (L, D, F), (L, F, D), (D,), (D, V)] if stacked \
        else [(V, D), (D,), (D, K, 2, DH), (D, F), (F, D), (D,), (D, V)]
    return tuple({"value": {"data_array": S(*s)}} for s in shapes)


def test_a_nameless_tree_is_refused_naming_every_matrix_with_the_labels_that_fit():
    tree = penzai_unbound()
    assert "/".join(tree_paths(tree)[0][0]) == "0/value/data_array"
    with pytest.raises(ValueError, match=r"6 parameter\(s\) have no names in their paths") as err:
        rowgeom.describe(tree)
    message = str(err.value)
    for i, shape in enumerate(((V, D), (L, D), (L, D, K, 2, DH))):
        assert f"{i}/value/data_array {shape}" in message
    assert "0/value/data_array (96, 32): 'embedding' or 'head' or 'hidden' or 'vector'" in message
    assert "2/value/data_array (3, 32, 2, 2, 8): 'hidden' or 'vector'" in message
    # Labels given: the kernels are outside any named block, so a layer axis is not told from
    # a head axis: one error lists them all with the reading to paste, which routes the tree.
    labels = {"0": "embedding", "1": "vector", "2": "hidden", "3": "hidden", "4": "hidden",
              "5": "vector", "6": "head"}
    for stacked in (True, False):
        tree = penzai_unbound(stacked)
        count = 3 if stacked else 1  # the unstacked (d, f) matrices are decided
        with pytest.raises(ValueError, match=rf"cannot infer Muon's matrix axes of {count} ") as e:
            rowgeom.describe(tree, labels=labels)
        message = str(e.value)
        muon = eval(message[message.index("muon=") + 5:], {"rowgeom": rowgeom})  # noqa: S307
        rows = {r.path: r.geometry for r in rowgeom.describe(tree, labels=labels, muon=muon)}
        if stacked:  # the (L, d) vectors tell L: the layer axis is a batch axis
            assert rows["2/value/data_array"] == "Muon, in 1 out 2,3,4 batch 0"
            assert rows["4/value/data_array"] == "Muon, in 1 out 2 batch 0"
        else:
            assert rows["2/value/data_array"] == "Muon, in 0 out 1,2,3"


def test_a_1xV_bias_is_a_vector_and_a_d_by_1_gate_too():
    bart = {"model": {"shared": {"embedding": S(V, D)},
                      "decoder": {"layers": {"0": {"fc1": {"kernel": S(D, F)}}}}},
            "final_logits_bias": S(1, V)}
    labels = rowgeom.label_params(bart, tied="embedding")
    assert labels["final_logits_bias"] == "vector"


def test_default_hidden_is_refused_where_the_vocabulary_cannot_be_read():
    """No token table or head is named: a (1000, 64) table and a (64, 1000) output matrix are
    not sent to Muon by default='hidden' without an error."""
    params = {"tok": {"table": S(1000, 64)}, "blocks": {"0": {"mlp": {"kernel": S(64, 256)}}},
              "proj": {"kernel": S(64, 1000)}}
    with pytest.raises(ValueError, match=r"default='hidden' cannot be checked for proj/kernel "
                                         r"\(64, 1000\), tok/table \(1000, 64\)"):
        rowgeom.label_params(params, default="hidden")
    labels = rowgeom.label_params(params, rules=[("^tok/", "embedding"), ("^proj/", "head")])
    assert labels["blocks"]["0"]["mlp"]["kernel"] == "hidden"


def test_tied_models_name_the_pattern_and_an_unused_head_is_flagged():
    tied = {"model": {"embed_tokens": {"embedding": S(V, D)},
                      "layers": {"0": {"mlp": {"up_proj": {"kernel": S(D, F)}}}}}}
    with pytest.raises(ValueError, match=r"the pattern of tied embeddings.*a token table "
                                         r"model/embed_tokens/embedding \(96, 32\)"):
        rowgeom.label_params(tied)
    # EasyDeL's tied models keep an lm_head the logits never read: with tied= it is flagged.
    easydel_tied = {**tied, "lm_head": {"kernel": S(D, V)}}
    plan = {r.path: r for r in rowgeom.describe(easydel_tied, tied="embedding")}
    assert plan["lm_head/kernel"].label == "embedding"
    assert plan["lm_head/kernel"].note.startswith("probably unused")
    assert "probably unused" in str(rowgeom.describe(easydel_tied, tied="embedding"))
    # A head of no table's shape contradicts tied=: still an error.
    with pytest.raises(ValueError, match=r"lm_head/kernel \(32, 192\) is named as the head but"):
        rowgeom.label_params({**tied, "lm_head": {"kernel": S(D, 2 * V)}}, tied="embedding")


def test_describe_on_an_moe_model_shows_expert_and_layer_axes():
    text = str(rowgeom.describe(maxtext_mixtral(), 1e-3))
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert lines["params/decoder/layers/MoeBlock_0/wi_0"].endswith(
        "Muon, in 2 out 3 batch 0,1  0.001  0.1  experts axis 0, layers axis 1")
    assert lines["params/decoder/layers/MoeBlock_0/gate/kernel"].endswith(
        "router over E=6 experts, layers axis 1")


def test_labels_has_five_entries_and_every_group_is_built():
    assert rowgeom.LABELS == ("hidden", "head", "embedding", "vector", "router")
    assert set(rowgeom.group_options(1e-3)) == set(rowgeom.LABELS)
    for group in rowgeom.LABELS:
        rowgeom.group_options(1e-3, groups={group: rowgeom.GroupOptions(
            learning_rate=1e-4)})
    dense = {"embed": {"embedding": S(V, D)}, "lm_head": {"kernel": S(D, V)},
             "layers": {"0": {"mlp": {"kernel": S(D, F)}}}}
    tx = rowgeom.lm_optimizer(1e-3)  # no router in the tree: the empty group is harmless
    # Traced, not run: building and updating the groups is what this checks (no compile).
    jax.eval_shape(lambda p: tx.update(jax.tree.map(jnp.ones_like, p), tx.init(p), p), dense)
    opt = optax.inject_hyperparams(rowgeom.lm_optimizer, static_args=rowgeom.STATIC_ARGS)(
        learning_rate=1e-3, router="rownorm")
    params = _filled(moe_only(scanned=False), 0.0)
    step = _first_step(opt)(jax.tree.map(np.ones_like, params), params)
    gate = step["params"]["decoder"]["layers_0"]["MoeBlock_0"]["gate"]["kernel"]
    assert float(np.abs(gate).max()) == 0.0  # an all-ones gradient is a pure shift


def test_a_dense_model_keeps_its_optimizer_state_structure():
    """The router group exists only where the tree has a router: the state of a dense model
    (and so its checkpoints) is what it was before the group existed."""
    dense = {"embed": {"embedding": S(V, D)}, "lm_head": {"kernel": S(D, V)},
             "layers": {"0": {"mlp": {"kernel": S(D, F)}}}}
    # The state's structure, traced (jax.eval_shape): eagerly, init compiles each zero.
    state = jax.eval_shape(rowgeom.lm_optimizer(1e-3).init, dense)
    assert sorted(state.inner_states) == ["embedding", "head", "hidden", "vector"]
    assert "router" in jax.eval_shape(rowgeom.lm_optimizer(1e-3).init, moe_only()).inner_states
