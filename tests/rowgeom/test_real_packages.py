"""The public JAX model packages, built by their own classes from tiny configs (no weights).

Each family is routed the way a user of that package would: with no options first, then with
the one option its error asks for. Every leaf is checked against a ``(regex, label,
geometry)`` table (geometry: Muon's ``(fan-in axes, fan-out axes)``, the head's vocabulary
axis). A package that is not installed skips its tests, saying why; install them with
``pip install -e ".[models]"`` (``.ci/run`` does, in a separate step). EasyDeL pins
``transformers~=5.5`` (no Flax models), so it needs an environment of its own; MaxText needs
Python >= 3.12: ``tests/rowgeom/test_moe.py`` holds both in their exact layouts, written by hand.

Packages: transformers 4.57 (its Flax models; transformers 5 has none), penzai 0.2
(``pz.unbind_params(..., freeze=True)``: the tuple penzai trains), Equinox 0.13 (``Linear.weight``
is ``(out, in)``), EasyDeL 0.3 (``EASYDEL_AUTO=0`` on CPU).
"""

import importlib
import os
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rowgeom
from rowgeom._tree import tree_paths

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

V, D, H, K, F, E, FE, P = 96, 32, 4, 2, 64, 6, 48, 64
MAT = ((0,), (1,))  # (fan-in axes, fan-out axes) of a Flax kernel (in, out)
OUT_IN = ((1,), (0,))  # GPT-2's FlaxConv1D kernel: (features, inputs), transposed when applied


def _transformers():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models (4.x has)")
    return transformers


# --------------------------------------------------------------------------- transformers

_HF_COMMON = [(r"/bias$|final_logits_bias$", "vector", None),
              (r"(norm|ln_\w+|layernorm\w*|layer_norm|ln_f)/(scale|weight|bias)$", "vector", None)]
HF_FAMILIES = {
    # family: (config class, model class, config, option the error asks for, table)
    "gpt2": ("GPT2Config", "FlaxGPT2LMHeadModel",
             dict(vocab_size=V, n_embd=D, n_layer=2, n_head=H, n_positions=P), "embedding", [
                 *_HF_COMMON, (r"/(wte|wpe)/embedding$", "embedding", None),
                 (r"/h/\d/(attn|mlp)/c_\w+/kernel$", "hidden", OUT_IN)]),
    "gpt2-untied": ("GPT2Config", "FlaxGPT2LMHeadModel",
                    dict(vocab_size=V, n_embd=D, n_layer=2, n_head=H, n_positions=P,
                         tie_word_embeddings=False), None, [
                        *_HF_COMMON, (r"/(wte|wpe)/embedding$", "embedding", None),
                        (r"/h/\d/(attn|mlp)/c_\w+/kernel$", "hidden", OUT_IN),
                        (r"^lm_head/kernel$", "head", 1)]),
    "llama": ("LlamaConfig", "FlaxLlamaForCausalLM",
              dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=2,
                   num_attention_heads=H, num_key_value_heads=K, max_position_embeddings=P),
              None, [*_HF_COMMON, (r"embed_tokens/embedding$", "embedding", None),
                     (r"layers/\d/(self_attn|mlp)/\w+/kernel$", "hidden", MAT),
                     (r"^lm_head/kernel$", "head", 1)]),
    "mistral": ("MistralConfig", "FlaxMistralForCausalLM",
                dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=2,
                     num_attention_heads=H, num_key_value_heads=K, max_position_embeddings=P),
                None, [*_HF_COMMON, (r"embed_tokens/embedding$", "embedding", None),
                       (r"layers/\d/(self_attn|mlp)/\w+/kernel$", "hidden", MAT),
                       (r"^lm_head/kernel$", "head", 1)]),
    "gemma": ("GemmaConfig", "FlaxGemmaForCausalLM",
              dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=2,
                   num_attention_heads=H, num_key_value_heads=K, head_dim=8,
                   max_position_embeddings=P), "embedding", [
                  *_HF_COMMON, (r"embed_tokens/embedding$", "embedding", None),
                  (r"layers/\d/(self_attn|mlp)/\w+/kernel$", "hidden", MAT)]),
    "opt": ("OPTConfig", "FlaxOPTForCausalLM",
            dict(vocab_size=V, hidden_size=D, ffn_dim=F, num_hidden_layers=2,
                 num_attention_heads=H, max_position_embeddings=P, word_embed_proj_dim=D),
            "embedding", [*_HF_COMMON, (r"embed_(tokens|positions)/embedding$", "embedding", None),
                          (r"layers/\d/(self_attn/\w+|fc1|fc2)/kernel$", "hidden", MAT)]),
    "gpt-neo": ("GPTNeoConfig", "FlaxGPTNeoForCausalLM",
                dict(vocab_size=V, hidden_size=D, num_layers=2, num_heads=H,
                     attention_types=[[["global", "local"], 1]], max_position_embeddings=P),
                "embedding", [*_HF_COMMON, (r"/(wte|wpe)/embedding$", "embedding", None),
                              (r"/h/\d/(attn/attention|mlp)/\w+/kernel$", "hidden", MAT)]),
    "gpt-j": ("GPTJConfig", "FlaxGPTJForCausalLM",
              dict(vocab_size=V, n_embd=D, n_layer=2, n_head=H, rotary_dim=4, n_positions=P),
              None, [*_HF_COMMON, (r"/wte/embedding$", "embedding", None),
                     (r"/h/\d/(attn|mlp)/\w+/kernel$", "hidden", MAT),
                     (r"^lm_head/kernel$", "head", 1)]),
    "bloom": ("BloomConfig", "FlaxBloomForCausalLM",
              dict(vocab_size=V, hidden_size=D, n_layer=2, n_head=H), "embedding", [
                  *_HF_COMMON, (r"word_embeddings/embedding$", "embedding", None),
                  (r"word_embeddings_layernorm/", "vector", None),
                  (r"/h/\d/(self_attention|mlp)/\w+/kernel$", "hidden", MAT)]),
    "xglm": ("XGLMConfig", "FlaxXGLMForCausalLM",
             dict(vocab_size=V, d_model=D, ffn_dim=F, num_layers=2, attention_heads=H,
                  max_position_embeddings=P), "embedding", [
                 *_HF_COMMON, (r"embed_tokens/embedding$", "embedding", None),
                 (r"layers/\d/(self_attn/\w+|fc1|fc2)/kernel$", "hidden", MAT)]),
    "bart": ("BartConfig", "FlaxBartForConditionalGeneration",
             dict(vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=H, decoder_attention_heads=H, encoder_ffn_dim=F,
                  decoder_ffn_dim=F, max_position_embeddings=P), "embedding", [
                 *_HF_COMMON, (r"(shared|embed_positions)/embedding$", "embedding", None),
                 (r"layers/\d/(self_attn|encoder_attn)/\w+/kernel$", "hidden", MAT),
                 (r"layers/\d/(fc1|fc2)/kernel$", "hidden", MAT)]),
}


def _check(family, plans, table):
    for plan in plans:
        rows = [(label, geom) for regex, label, geom in table if re.search(regex, plan.path)]
        assert rows, f"{family}: {plan.path} {plan.shape} matches no table row"
        geom = None
        if plan.muon_dims is not None:
            as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
            geom = as_tuple(plan.muon_dims.reduction_axis), as_tuple(plan.muon_dims.output_axis)
        elif plan.label == "head":
            geom = plan.vocab_axis
        assert (plan.label, geom) == rows[0], f"{family}: {plan.path} {plan.shape}"


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_transformers_flax_family_routes_exactly(family):
    config_cls, model_cls, config, tied, table = HF_FAMILIES[family]
    transformers = _transformers()
    with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):  # upstream broadcasts
        warnings.simplefilter("ignore")
        params = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config),
                                                 _do_init=False).params_shape_tree
    if tied is None:
        _check(family, rowgeom.describe(params), table)
        return
    # A tied family: the zero-config error names the pattern and asks for tied=; following it
    # routes every leaf.
    with pytest.raises(ValueError, match=r"the pattern of tied embeddings.*tied='embedding'"):
        rowgeom.describe(params)
    _check(family, rowgeom.describe(params, tied=tied), table)


# --------------------------------------------------------------------------------- penzai


def _penzai(stacked, tied=False):
    pytest.importorskip("penzai", reason="penzai is not installed")
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common

    cfg = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=K, query_head_multiplier=2, embedding_dim=D, projection_dim=8,
        mlp_hidden_dim=F, num_decoder_blocks=3, vocab_size=V, mlp_variant="swiglu",
        tie_embedder_and_logits=tied, use_layer_stack=stacked)
    def build():
        model = llamalike_common.build_llamalike_transformer(cfg,
                                                             init_base_rng=jax.random.key(0))
        return pz.unbind_params(model, freeze=True)[1]

    with jax.numpy_rank_promotion("allow"):  # shapes only: op-by-op init compiled ~100 programs
        return jax.eval_shape(build)


@pytest.mark.parametrize("stacked", [False, True], ids=["blocks", "layer-stack"])
def test_penzai_training_tree_is_refused_naming_every_matrix_then_routes(stacked):
    """penzai trains a tuple whose paths carry no names: never labelled by shape alone. Its
    parameters' own labels name them: labelling a tree keyed by those routes each leaf."""
    params = _penzai(stacked)
    matrices = [p for p in params if np.ndim(p.value.data_array) >= 2]
    with pytest.raises(ValueError, match=rf"{len(matrices)} parameter\(s\) have no names"):
        rowgeom.describe(params)
    named = {p.label.replace(".", "/"): p.value.data_array for p in params}
    by_label = {"/".join(k): lab for k, lab in tree_paths(rowgeom.label_params(named))}
    labels = tuple(by_label[p.label.replace(".", "/")] for p in params)
    expect = {"embedder": "embedding", "lm_head": "head", "scale": "vector"}
    for p, label in zip(params, labels, strict=True):
        want = next((v for k, v in expect.items() if k in p.label), "hidden")
        assert label == want, p.label
    plan_named = {r.path: r for r in rowgeom.describe(named)}
    dims = {str(i): plan_named[p.label.replace(".", "/")].muon_dims
            for i, p in enumerate(params) if labels[i] == "hidden"}
    if stacked:  # the layer axis (named 'blocks' in penzai) is a batch axis
        query = plan_named["transformer/blocks/attention/query/weights"]
        assert query.geometry == "Muon, in 1 out 2,3,4 batch 0"
    plans = rowgeom.describe(params, labels=labels,
                             muon=rowgeom.MuonOptions(dimension_numbers=dims))
    assert [r.label for r in plans] == list(labels)
    tx = rowgeom.lm_optimizer(1e-3, labels=labels,
                              muon=rowgeom.MuonOptions(dimension_numbers=dims))
    step = jax.jit(lambda p: tx.update(jax.tree.map(jnp.ones_like, p), tx.init(p), p)[0])
    updates = step(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params))
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


# ------------------------------------------------------------------------------- Equinox


def test_equinox_linear_weights_are_read_out_in_and_route_with_no_options():
    """Equinox's ``Linear.weight`` is ``(out_features, in_features)`` and its ``Embedding``
    ``weight`` ``(V, d)``: the tree ``eqx.filter(model, eqx.is_array)`` a user trains routes
    with no options, each matrix's fan-in on axis 1 (Muon's "keller"/"spectral" scales read
    it)."""
    eqx = pytest.importorskip("equinox", reason="equinox is not installed")

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
            self.attn = eqx.nn.MultiheadAttention(H, D, key=k[0])
            self.up, self.down = eqx.nn.Linear(D, F, key=k[1]), eqx.nn.Linear(F, D, key=k[2])

    class GPT(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm
        lm_head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(V, D, key=k[0])
            self.blocks = [Block(k[1]), Block(k[2])]
            self.ln_f = eqx.nn.LayerNorm(D)
            self.lm_head = eqx.nn.Linear(D, V, use_bias=False, key=k[3])

    model = eqx.filter_eval_shape(GPT, jax.random.key(0))  # shapes only: nothing compiles
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    assert model.blocks[0].up.weight.shape == (F, D)  # (out, in), as upstream documents
    _check("equinox", rowgeom.describe(params), [
        (r"^embed/weight$", "embedding", None), (r"(ln\w*)/(weight|bias)$|/bias$", "vector", None),
        (r"blocks/\d/(attn/\w+_proj|up|down)/weight$", "hidden", OUT_IN),
        (r"^lm_head/weight$", "head", 0)])
    tx = rowgeom.lm_optimizer(1e-3, muon=rowgeom.MuonOptions(scale="keller"))
    state = jax.eval_shape(tx.init, params)
    jax.eval_shape(tx.update, params, state, params)


# -------------------------------------------------------------------------------- EasyDeL


def _easydel():
    if importlib.util.find_spec("easydel") is None:
        pytest.skip("easydel is not installed (it pins transformers~=5.5: an environment of "
                    "its own)")
    os.environ.setdefault("EASYDEL_AUTO", "0")
    # EasyDeL 0.3 patches a few Hugging Face PyTorch model classes at import; without torch
    # those modules raise on attribute access. Stand-ins keep the patches no-ops (no EasyDeL
    # model reads them).
    for name in ("dbrx", "glm4v_moe", "llama4", "phimoe", "qwen3_5_moe", "qwen3_next"):
        try:
            package = importlib.import_module(f"transformers.models.{name}")
        except ImportError:
            continue
        if importlib.util.find_spec("torch") is None:
            setattr(package, f"modeling_{name}", types.ModuleType(f"modeling_{name}"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module("easydel")


_ATTN = [(r"self_attn/\w+_proj(_with_mqa)?/kernel$", "hidden", MAT)]
_EASYDEL_ROWS = [
    (r"embed_tokens/", "embedding", None),
    (r"(norm|layernorm)/kernel$|bias$|sinks$|shared_expert_gate/kernel$", "vector", None),
    *_ATTN, (r"/(gate|router)/kernel$", "router", MAT), (r"/experts/\w+/kernel$", "hidden",
                                                         ((1,), (2,))),
    (r"(mlp|feed_forward)/(shared_experts?/)?(gate|up|down)_proj/kernel$", "hidden", MAT),
    (r"^lm_head/kernel$", "head", 1)]
_COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=2,
               num_attention_heads=H, num_key_value_heads=K, head_dim=8,
               max_position_embeddings=P)
EASYDEL_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E,
                                                            num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=FE,
                       shared_expert_intermediate_size=40)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=FE)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=FE,
                         n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                         kv_lora_rank=10, qk_nope_head_dim=8, qk_rope_head_dim=4,
                         v_head_dim=6, n_group=1, topk_group=1)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=E,
                                                          num_experts_per_tok=2)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(num_local_experts=E, num_experts_per_tok=1, intermediate_size_mlp=F,
                    interleave_moe_layer_step=2)),
}


@pytest.mark.parametrize("family", sorted(EASYDEL_FAMILIES))
def test_easydel_moe_family_routes_exactly_with_no_options(family):
    ed = _easydel()
    from flax import nnx

    config_cls, model_cls, extra = EASYDEL_FAMILIES[family]
    cfg = getattr(ed, config_cls)(**_COMMON, **extra)
    with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):
        warnings.simplefilter("ignore")
        model = nnx.eval_shape(lambda: getattr(ed, model_cls)(
            config=cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    plans = rowgeom.describe(state)
    _check(family, plans, _EASYDEL_ROWS)
    assert any(r.label == "router" for r in plans) and any(
        r.note.startswith("experts axis 0") for r in plans)



@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_transformers_tied_llama_keeps_an_unused_head_that_tied_flags(family):
    """transformers' Flax Llama and Mistral with tie_word_embeddings=True keep lm_head/kernel (the
    logits read the token table instead): the tree alone looks untied, so tied= is the user's to
    give; with it the kernel is flagged as probably unused, and nothing is trained as the head."""
    config_cls, model_cls, config, _, _ = HF_FAMILIES[family]
    transformers = _transformers()
    with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):
        warnings.simplefilter("ignore")
        params = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
            **config, tie_word_embeddings=True), _do_init=False).params_shape_tree
    rows = {r.path: r for r in rowgeom.describe(params, tied="embedding")}
    assert rows["lm_head/kernel"].label == "embedding"
    assert rows["lm_head/kernel"].note.startswith("probably unused")
    assert not any(r.label == "head" for r in rows.values())


def test_easydel_tied_model_keeps_an_unused_head_that_describe_flags():
    """EasyDeL builds lm_head/kernel even with tie_word_embeddings=True (the logits read the
    token table): under tied= it is flagged as probably unused, not trained as the head."""
    ed = _easydel()
    from flax import nnx

    cfg = ed.Qwen3MoeConfig(**_COMMON, num_experts=E, num_experts_per_tok=2,
                            moe_intermediate_size=FE, tie_word_embeddings=True)
    with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):
        warnings.simplefilter("ignore")
        model = nnx.eval_shape(lambda: ed.Qwen3MoeForCausalLM(
            config=cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rows = {r.path: r for r in rowgeom.describe(nnx.state(model, nnx.Param), tied="embedding")}
    assert rows["lm_head/kernel"].label == "embedding"
    assert rows["lm_head/kernel"].note.startswith("probably unused")
    assert not any(r.label == "head" for r in rows.values())
