"""Public JAX LM layouts route exactly, with no options or one documented option.

Each tree is written in its upstream layout: the path names and shapes the upstream code
creates (read from its source), at a small size. Flax Linen models whose names Flax itself
generates (``Dense_0``, ``SelfAttention_0``, boxed by ``nn.with_logical_partitioning``) are
built by Flax from modules that mirror the upstream ones; the others are written as
``jax.ShapeDtypeStruct`` trees. The expected routing is a table per family: every leaf must
match exactly one ``(regex, label, geometry)`` row, where the geometry is Muon's
``(fan-in axes, fan-out axes)`` for hidden leaves and the vocabulary axis for the head.

Upstream sources:
- Flax ``examples/lm1b/models.py`` (``TransformerLM``; ``logits_via_embedding`` True is the
  ``examples/wmt`` default).
- Flax NNX's scan-over-layers pattern (``nnx.split_rngs`` + ``nnx.vmap`` building the blocks):
  every leaf of ``layers`` gets a leading layer axis, ``nnx.MultiHeadAttention`` kernels are
  ``(L, d, H, Dh)`` and ``(L, H, Dh, d)``.
- Flax ``examples/gemma`` (NNX): ``transformer.py``, ``modules.py`` (``Embedder.input_embedding``,
  ``Einsum.w``: ``q_einsum (N, D, H)``, ``kv_einsum (2, K, D, H)``, ``attn_vec_einsum (N, H, D)``).
- google-deepmind ``gemma`` (Linen): ``layer_{i}``, ``mlp/gating_einsum (2, F, D)``, ``linear``.
- Hugging Face ``modeling_flax_gpt2.py`` (``FlaxConv1D`` kernels are ``(out, in)``; GPT-2 ties),
  ``modeling_flax_llama.py`` (untied ``lm_head``), ``modeling_flax_opt.py`` (OPT ties).
- MaxText ``decoders.py`` / ``llama2.py`` with ``scan_layers: True`` and ``param_scan_axis: 1``
  (every stacked leaf gets the layer axis at position 1), and unscanned ``layers_{i}``.
- nanodo ``model.py`` (``blocks_{i}``, ``CausalAttn_0/query (D, H, Dh)``, ``attn_out_proj``,
  tied ``embed.attend``).
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import rowgeom
from examples.lm import model as example_model

V, D, H, K, DH, F, L, P = 96, 32, 4, 2, 8, 64, 3, 40  # vocab, width, heads, kv heads, ...


def S(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


# --------------------------------------------------------------------------- the layouts


def lm1b(logits_via_embedding=False):
    """flax/examples/lm1b TransformerLM (and wmt's tied logits), built by Flax Linen."""
    part = nn.with_logical_partitioning
    init = nn.initializers.normal(0.02)

    class MlpBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(F, kernel_init=part(init, ("embed", "mlp")))(x)
            return nn.Dense(D, kernel_init=part(init, ("mlp", "embed")))(nn.relu(x))

    class EncoderDecoder1DBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.SelfAttention(num_heads=H, qkv_features=D, use_bias=False,
                                 kernel_init=part(init, ("embed", "kv")))(nn.LayerNorm()(x))
            x = x + y
            return x + MlpBlock()(nn.LayerNorm()(x))

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(V, D, embedding_init=part(init, ("vocab", "embed")))
            y = embed(ids)
            y = y + self.param("pos_embedding", init, (1, P, D))[:, :ids.shape[1]]
            for lyr in range(2):
                y = EncoderDecoder1DBlock(name=f"encoderdecoderblock_{lyr}")(y)
            y = nn.LayerNorm(name="encoderdecoder_norm")(y)
            if logits_via_embedding:
                return embed.attend(y)
            return nn.Dense(V, kernel_init=part(init, ("embed", "vocab")), name="logitdense")(y)

    class TransformerLM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return Decoder(name="decoder")(ids)

    with warnings.catch_warnings():  # upstream still uses nn.SelfAttention (deprecated)
        warnings.simplefilter("ignore", DeprecationWarning)
        variables = jax.eval_shape(  # the key and ids traced too: nothing compiles
            lambda: TransformerLM().init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    # Upstream the position table sits in its own module, AddPositionEmbs(name='posembed_output').
    dec = dict(variables["params"]["decoder"])
    dec["posembed_output"] = {"pos_embedding": dec.pop("pos_embedding")}
    return {"params": {"decoder": dec}}


def flax_nnx_example():
    """This repository's example model (NNX): embed, layers/i/..., final_norm, lm_head."""
    cfg = example_model.ModelConfig(vocab_size=V, d_model=D, num_layers=2, num_heads=H,
                                    mlp_dim=F, max_seq_len=P)
    abstract = nnx.eval_shape(lambda: example_model.Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.state(abstract, nnx.Param)


def flax_nnx_scanned():
    """Flax NNX's scan-over-layers pattern: blocks created under nnx.vmap (layer axis 0)."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False,
                                               rngs=rngs)
            self.norm = nnx.RMSNorm(D, rngs=rngs)
            self.mlp = nnx.Linear(D, F, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)

            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.layers = make(rngs)
            self.lm_head = nnx.Linear(D, V, rngs=rngs)

    return nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)


def gemma_nnx():
    """flax/examples/gemma (NNX), grouped-query attention (tied: Embedder.decode)."""
    layer = {"pre_attention_norm": {"scale": S(D)},
             "attn": {"q_einsum": {"w": S(H, D, DH)}, "kv_einsum": {"w": S(2, K, D, DH)},
                      "attn_vec_einsum": {"w": S(H, DH, D)}},
             "post_attn_norm": {"scale": S(D)},
             "pre_ffw_norm": {"scale": S(D)},
             "mlp": {"gate_proj": {"kernel": S(D, F)}, "up_proj": {"kernel": S(D, F)},
                     "down_proj": {"kernel": S(F, D)}},
             "post_ffw_norm": {"scale": S(D)}}
    return {"embedder": {"input_embedding": S(V, D)}, "layers": {"0": layer, "1": layer},
            "final_norm": {"scale": S(D)}}


def gemma_linen():
    """google-deepmind/gemma (Linen): transformer/layer_i, fused gating einsum (tied)."""
    layer = {"pre_attention_norm": {"scale": S(D)},
             "attn": {"qkv_einsum": {"w": S(3, H, D, DH)}, "attn_vec_einsum": {"w": S(H, DH, D)}},
             "pre_ffw_norm": {"scale": S(D)},
             "mlp": {"gating_einsum": S(2, F, D), "linear": S(F, D)}}
    return {"transformer": {"embedder": {"input_embedding": S(V, D)},
                            "layer_0": layer, "layer_1": layer, "final_norm": {"scale": S(D)}}}


def hf_gpt2():
    """transformers FlaxGPT2LMHeadModel params (tied: no lm_head leaf)."""
    ln = {"scale": S(D), "bias": S(D)}
    block = {"ln_1": ln, "attn": {"c_attn": {"kernel": S(3 * D, D), "bias": S(3 * D)},
                                  "c_proj": {"kernel": S(D, D), "bias": S(D)}},
             "ln_2": ln, "mlp": {"c_fc": {"kernel": S(4 * D, D), "bias": S(4 * D)},
                                 "c_proj": {"kernel": S(D, 4 * D), "bias": S(D)}}}
    return {"transformer": {"wte": {"embedding": S(V, D)}, "wpe": {"embedding": S(P, D)},
                            "h": {"0": block, "1": block}, "ln_f": ln}}


def hf_llama():
    """transformers FlaxLlamaForCausalLM params (untied lm_head (d, V))."""
    layer = {"self_attn": {n: {"kernel": S(D, D if n in ("q_proj", "o_proj") else K * DH)}
                           for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
             "mlp": {"gate_proj": {"kernel": S(D, F)}, "up_proj": {"kernel": S(D, F)},
                     "down_proj": {"kernel": S(F, D)}},
             "input_layernorm": {"weight": S(D)}, "post_attention_layernorm": {"weight": S(D)}}
    return {"model": {"embed_tokens": {"embedding": S(V, D)}, "layers": {"0": layer, "1": layer},
                      "norm": {"weight": S(D)}},
            "lm_head": {"kernel": S(D, V)}}


def hf_opt():
    """transformers FlaxOPTForCausalLM params (OPT ties the head to embed_tokens)."""
    dense = lambda i, o: {"kernel": S(i, o), "bias": S(o)}
    ln = {"scale": S(D), "bias": S(D)}
    layer = {"self_attn": {n: dense(D, D) for n in ("k_proj", "v_proj", "q_proj", "out_proj")},
             "self_attn_layer_norm": ln, "fc1": dense(D, F), "fc2": dense(F, D),
             "final_layer_norm": ln}
    return {"model": {"decoder": {"embed_tokens": {"embedding": S(V, D)},
                                  "embed_positions": {"embedding": S(P + 2, D)},
                                  "layers": {"0": layer, "1": layer},
                                  "final_layer_norm": ln}}}


def maxtext(scanned=True):
    """MaxText llama2-style decoder; scanned layers stack every leaf on axis 1."""
    stack = (lambda *s: S(s[0], L, *s[1:])) if scanned else S
    layer = {"pre_self_attention_layer_norm": {"scale": stack(D)},
             "self_attention": {"query": {"kernel": stack(D, H, DH)},
                                "key": {"kernel": stack(D, K, DH)},
                                "value": {"kernel": stack(D, K, DH)},
                                "out": {"kernel": stack(H, DH, D)}},
             "post_self_attention_layer_norm": {"scale": stack(D)},
             "mlp": {"wi_0": {"kernel": stack(D, F)}, "wi_1": {"kernel": stack(D, F)},
                     "wo": {"kernel": stack(F, D)}}}
    layers = {"layers": layer} if scanned else {f"layers_{i}": layer for i in range(L)}
    return {"params": {"token_embedder": {"embedding": S(V, D)},
                       "decoder": {**layers, "decoder_norm": {"scale": S(D)},
                                   "logits_dense": {"kernel": S(D, V)}}}}


def nanodo():
    """google-deepmind/nanodo TransformerDo (tied: embed.attend); blocks_i from a setup list."""
    block = {"LayerNorm_0": {"scale": S(D)}, "LayerNorm_1": {"scale": S(D)},
             "CausalAttn_0": {"query": {"kernel": S(D, H, DH)}, "key": {"kernel": S(D, H, DH)},
                              "value": {"kernel": S(D, H, DH)},
                              "attn_out_proj": {"kernel": S(H, DH, D)}},
             "Mlp_0": {"Dense_0": {"kernel": S(D, F)}, "Dense_1": {"kernel": S(F, D)}}}
    return {"params": {"embed": {"embedding": S(V, D)}, "pos_embed": {"embedding": S(P, D)},
                       "blocks_0": block, "blocks_1": block, "out_ln": {"scale": S(D)}}}


# ------------------------------------------------------------------- expected routing tables

MAT = ((0,), (1,))  # a plain (in, out) matrix
TABLES = {
    "flax-lm1b": (lm1b, {}, [
        (r"Embed_0/embedding$", "embedding", None),
        (r"posembed_output/pos_embedding$", "embedding", None),
        (r"LayerNorm_\d/(scale|bias)$|encoderdecoder_norm/", "vector", None),
        (r"SelfAttention_0/(query|key|value)/kernel$", "hidden", ((0,), (1, 2))),
        (r"SelfAttention_0/out/kernel$", "hidden", ((0, 1), (2,))),
        (r"MlpBlock_0/Dense_\d/kernel$", "hidden", MAT),
        (r"MlpBlock_0/Dense_\d/bias$", "vector", None),
        (r"logitdense/kernel$", "head", 1),
        (r"logitdense/bias$", "vector", None)]),
    "flax-wmt-tied": (lambda: lm1b(logits_via_embedding=True), {"tied": "embedding"}, [
        (r"Embed_0/embedding$", "embedding", None),
        (r"posembed_output/pos_embedding$", "embedding", None),
        (r"LayerNorm_\d/(scale|bias)$|encoderdecoder_norm/", "vector", None),
        (r"SelfAttention_0/(query|key|value)/kernel$", "hidden", ((0,), (1, 2))),
        (r"SelfAttention_0/out/kernel$", "hidden", ((0, 1), (2,))),
        (r"MlpBlock_0/Dense_\d/kernel$", "hidden", MAT),
        (r"MlpBlock_0/Dense_\d/bias$", "vector", None)]),
    "flax-nnx-example": (flax_nnx_example, {}, [
        (r"^embed/embedding$", "embedding", None),
        (r"norm/scale$", "vector", None),
        (r"^layers/\d/(attn|mlp)/\w+/kernel$", "hidden", MAT),
        (r"^lm_head/kernel$", "head", 1)]),
    "flax-nnx-scanned": (flax_nnx_scanned, {}, [
        (r"^embed/embedding$", "embedding", None),
        (r"norm/scale$|/bias$", "vector", None),
        (r"^layers/attn/(query|key|value)/kernel$", "hidden", ((1,), (2, 3))),
        (r"^layers/attn/out/kernel$", "hidden", ((1, 2), (3,))),
        (r"^layers/mlp/kernel$", "hidden", ((1,), (2,))),
        (r"^lm_head/kernel$", "head", 1)]),
    "flax-gemma-nnx": (gemma_nnx, {"tied": "head"}, [
        (r"^embedder/input_embedding$", "head", 0),
        (r"norm/scale$", "vector", None),
        (r"attn/q_einsum/w$", "hidden", ((1,), (0, 2))),
        (r"attn/kv_einsum/w$", "hidden", ((2,), (0, 1, 3))),
        (r"attn/attn_vec_einsum/w$", "hidden", ((0, 1), (2,))),
        (r"mlp/\w+_proj/kernel$", "hidden", MAT)]),
    "gemma-linen": (gemma_linen, {"tied": "embedding"}, [
        (r"embedder/input_embedding$", "embedding", None),
        (r"norm/scale$", "vector", None),
        (r"attn/qkv_einsum/w$", "hidden", ((2,), (0, 1, 3))),
        (r"attn/attn_vec_einsum/w$", "hidden", ((0, 1), (2,))),
        (r"mlp/gating_einsum$", "hidden", ((0, 1), (2,))),
        (r"mlp/linear$", "hidden", MAT)]),
    "hf-flax-gpt2": (hf_gpt2, {"tied": "embedding"}, [
        (r"/wte/embedding$", "embedding", None),
        (r"/wpe/embedding$", "embedding", None),
        (r"/(ln_\w+)/(scale|bias)$|/bias$", "vector", None),
        (r"/(c_attn|c_proj|c_fc)/kernel$", "hidden", ((1,), (0,)))]),  # (out, in)
    "hf-flax-llama": (hf_llama, {}, [
        (r"embed_tokens/embedding$", "embedding", None),
        (r"(layernorm|norm)/weight$", "vector", None),
        (r"layers/\d/(self_attn|mlp)/\w+/kernel$", "hidden", MAT),
        (r"^lm_head/kernel$", "head", 1)]),
    "hf-flax-opt": (hf_opt, {"tied": "head"}, [
        (r"embed_tokens/embedding$", "head", 0),
        (r"embed_positions/embedding$", "embedding", None),
        (r"layer_norm/(scale|bias)$|/bias$", "vector", None),
        (r"layers/\d/(self_attn/\w+|fc1|fc2)/kernel$", "hidden", MAT)]),
    "maxtext-scanned": (maxtext, {}, [
        (r"token_embedder/embedding$", "embedding", None),
        (r"norm/scale$", "vector", None),
        (r"self_attention/(query|key|value)/kernel$", "hidden", ((0,), (2, 3))),
        (r"self_attention/out/kernel$", "hidden", ((0, 2), (3,))),
        (r"mlp/wi_\d/kernel$", "hidden", ((0,), (2,))),
        (r"mlp/wo/kernel$", "hidden", ((0,), (2,))),
        (r"logits_dense/kernel$", "head", 1)]),
    "maxtext-unscanned": (lambda: maxtext(scanned=False), {}, [
        (r"token_embedder/embedding$", "embedding", None),
        (r"norm/scale$", "vector", None),
        (r"self_attention/(query|key|value)/kernel$", "hidden", ((0,), (1, 2))),
        (r"self_attention/out/kernel$", "hidden", ((0, 1), (2,))),
        (r"mlp/\w+/kernel$", "hidden", MAT),
        (r"logits_dense/kernel$", "head", 1)]),
    "nanodo": (nanodo, {"tied": "embedding"}, [
        (r"/embed/embedding$", "embedding", None),
        (r"pos_embed/embedding$", "embedding", None),
        (r"(LayerNorm_\d|out_ln)/scale$", "vector", None),
        (r"CausalAttn_0/(query|key|value)/kernel$", "hidden", ((0,), (1, 2))),
        (r"CausalAttn_0/attn_out_proj/kernel$", "hidden", ((0, 1), (2,))),
        (r"Mlp_0/Dense_\d/kernel$", "hidden", MAT)]),
}


def _geometry(plan):
    """The plan's geometry in the table's terms."""
    if plan.label == "hidden":
        as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
        return as_tuple(plan.muon_dims.reduction_axis), as_tuple(plan.muon_dims.output_axis)
    return plan.vocab_axis if plan.label == "head" else None


@pytest.mark.parametrize("family", sorted(TABLES))
def test_public_layout_routes_exactly(family):
    build, options, table = TABLES[family]
    params = build()
    plans = rowgeom.describe(params, **options)
    assert plans, family
    for plan in plans:
        path = plan.path
        rows = [(label, geom) for regex, label, geom in table if re.search(regex, path)]
        assert len(rows) == 1, f"{family}: {path} {plan.shape} matches {len(rows)} table rows"
        assert (plan.label, _geometry(plan)) == rows[0], f"{family}: {path} {plan.shape}"
    # label_params agrees with lm_optimizer's plan, leaf by leaf.
    labels = {"/".join(p): lab for p, lab in rowgeom._tree.tree_paths(
        rowgeom.label_params(params, tied=options.get("tied")))}
    assert labels == {p.path: p.label for p in plans}


@pytest.mark.parametrize("family", sorted(f for f, (_, opts, _) in TABLES.items() if opts))
def test_the_one_option_is_what_the_error_asks_for(family):
    """Tied families: with no options the error names the table and offers tied=."""
    build, options, _ = TABLES[family]
    assert list(options) == ["tied"]
    with pytest.raises(ValueError, match=r"no head matrix.*tied='embedding'.*tied='head'"):
        rowgeom.label_params(build())
    # Both tied policies route; the other one is checked too.
    for tied in ("embedding", "head"):
        labels = [p.label for p in rowgeom.describe(build(), tied=tied)]
        assert labels.count("head") == (tied == "head")


def test_describe_prints_the_scanned_maxtext_plan():
    rows = rowgeom.describe(maxtext(), 1e-3)
    text = str(rows)
    assert "params/decoder/layers/self_attention/query/kernel" in text
    assert "Muon, in 0 out 2,3 batch 1" in text
    assert "params/decoder/logits_dense/kernel" in text and "RowNorm, vocab axis 1" in text
    by_path = {r.path: r for r in rows}
    assert by_path["params/decoder/logits_dense/kernel"].label == "head"
    assert rows.groups["head"].learning_rate == pytest.approx(5e-3)
    assert by_path["params/decoder/layers/pre_self_attention_layer_norm/scale"].label == "vector"


def test_scanned_stack_is_orthogonalised_layer_by_layer():
    """lm_optimizer on MaxText's scanned layout: each layer's slice gets the Muon step of that
    layer's matrix alone (the layer axis is a batch axis), checked against a per-layer run."""
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), maxtext())  # host arrays:
    rng = np.random.default_rng(0)                                           # no compile
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    tx = rowgeom.lm_optimizer(1e-2, weight_decay=0.0,
                              muon=rowgeom.MuonOptions(momentum=0.0, nesterov=False))
    ref = rowgeom.muon_orthogonalize(dimension_numbers=rowgeom.MuonDimensionNumbers(0, (1, 2)))
    layers = grads["params"]["decoder"]["layers"]
    query = layers["self_attention"]["query"]["kernel"]          # (D, L, H, DH)
    # The step (init included) and the per-layer reference, each layer's slice orthogonalised
    # alone, in one jitted program (eagerly, every operation compiles on its own).
    updates, wants = jax.jit(lambda g, p, slices: (
        tx.update(g, tx.init(p), p)[0], [ref.update(x, ref.init(x))[0] for x in slices]))(
        grads, params, [query[:, i] for i in range(L)])
    got = np.asarray(updates["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"])
    for i, want in enumerate(wants):  # on the host: no slicing or scaling compiles
        np.testing.assert_allclose(got[:, i], -1e-2 * np.asarray(want), rtol=2e-3, atol=1e-7,
                                   err_msg=f"layer {i}")
    # Stacked norm scales went to AdamW (first step: -lr * sign(g) up to eps), not Muon.
    scale_g = layers["pre_self_attention_layer_norm"]["scale"]
    scale_u = updates["params"]["decoder"]["layers"]["pre_self_attention_layer_norm"]["scale"]
    np.testing.assert_allclose(scale_u, -1e-2 * np.sign(scale_g), rtol=1e-4)


def test_ambiguous_kernel_raises_naming_the_leaf_and_the_fix_works():
    """An expert stack (E, d, F): which axis indexes the experts is not in the shapes."""
    params = maxtext(scanned=False)
    decoder = params["params"]["decoder"]
    decoder["layers_0"] = {**decoder["layers_0"],
                           "mlp": {**decoder["layers_0"]["mlp"], "experts": {"wi": S(4, D, F)}}}
    with pytest.raises(ValueError, match=r"(?s)layers_0/mlp/experts/wi \(4, 32, 64\).*"
                                         r"MuonOptions\(dimension_numbers=\{\n    "
                                         r"'params/decoder/layers_0"):
        rowgeom.describe(params)
    fix = {"params/decoder/layers_0/mlp/experts/wi": optax.contrib.MuonDimensionNumbers(1, 2)}
    rows = {r.path: r for r in rowgeom.describe(
        params, muon=rowgeom.MuonOptions(dimension_numbers=fix))}
    assert rows["params/decoder/layers_0/mlp/experts/wi"].geometry == "Muon, in 1 out 2 batch 0"
    assert rows["params/decoder/layers_0/mlp/wi_0/kernel"].geometry == "Muon, in 0 out 1"


def test_dimension_number_overrides_by_parent_path():
    """A parent path overrides the inference for every hidden leaf under it; a wrong path is
    an error naming the hidden parameters."""
    params = maxtext()
    stack = "params/decoder/layers/mlp"
    rows = {r.path: r for r in rowgeom.describe(
        params, muon=rowgeom.MuonOptions(
            dimension_numbers={stack: rowgeom.MuonDimensionNumbers(2, 0)}))}
    assert rows[f"{stack}/wi_0/kernel"].geometry == "Muon, in 2 out 0 batch 1"
    assert rows["params/decoder/layers/self_attention/out/kernel"].geometry == (
        "Muon, in 0,2 out 3 batch 1")  # not under the override: still inferred
    with pytest.raises(ValueError, match=r"names \['params/decoder/mpl'\], which are not in"):
        rowgeom.describe(params, muon=rowgeom.MuonOptions(dimension_numbers={
            "params/decoder/mpl": rowgeom.MuonDimensionNumbers()}))
