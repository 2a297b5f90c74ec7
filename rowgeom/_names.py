"""Every name rowgeom recognises, in one place: the labels, the optimizer names, and the path
components that say what a parameter is for.

The labels (`rowgeom._labels`) and the model structure (`rowgeom._structure`) read whole,
case-insensitive path components against these sets; the public ones are the defaults a user can
replace or extend (``Labeler(extra_hidden_names=...)``). Nothing here is logic.
"""

from __future__ import annotations

import re
import types

LABELS = ("hidden", "head", "embedding", "vector", "router")
"""The five parameter labels, one per optimizer group.

``"hidden"`` (Muon), ``"head"`` (projected RowNorm), ``"embedding"`` and ``"vector"`` (AdamW),
``"router"`` (a mixture-of-experts router: Muon by default, projected RowNorm over the experts
on request, `rowgeom.RouterOptions`); the keys `lm_optimizer` partitions by and `label_params`
assigns.

Examples:
    >>> import rowgeom
    >>> rowgeom.LABELS
    ('hidden', 'head', 'embedding', 'vector', 'router')
"""

TIED_POLICIES = (None, "embedding", "head")
"""How a head tied to the embedding table is trained: not tied, as the embedding, as the head."""

HEAD_OPTIMIZERS = ("rownorm", "adamw", "muon")
"""The head optimizers `lm_optimizer` builds."""

ROUTER_OPTIMIZERS = ("muon", "rownorm", "adamw")
"""The router optimizers `lm_optimizer` builds (`rowgeom.RouterOptions`)."""

DEFAULT_HEAD_NAMES = frozenset({
    "lm_head", "head", "output", "output_layer", "unembed", "unembedding", "unembedder",
    "logits", "logits_dense", "logitdense", "to_logits", "logits_ffn",
})
"""Path components that name the output (unembedding) matrix: label ``"head"``.

Examples:
    >>> import rowgeom
    >>> "lm_head" in rowgeom.DEFAULT_HEAD_NAMES and "logits_dense" in rowgeom.DEFAULT_HEAD_NAMES
    True
"""

TOKEN_EMBEDDING_NAMES = frozenset({
    "wte", "tok_embeddings", "tok_embedding", "tok_embed", "token_embedder", "token_embedding",
    "token_embeddings", "embed_tokens", "word_embeddings", "word_embedding", "input_embedding",
    "shared_embedding", "embedding_lookup",
})
"""Path components that name the token embedding table (the one a tied head reuses).

Its ``(V, d)`` shape gives `label_params` the vocabulary size and the model width.

Examples:
    >>> import rowgeom
    >>> "wte" in rowgeom.TOKEN_EMBEDDING_NAMES and "wpe" not in rowgeom.TOKEN_EMBEDDING_NAMES
    True
"""

POSITION_EMBEDDING_NAMES = frozenset({
    "wpe", "pos_embed", "pos_embedding", "position_embedding", "position_embeddings",
    "embed_positions", "posembed_input", "posembed_output",
})
"""Path components that name a position table: an embedding, never the source of ``V``."""

POSITION_WORD = re.compile(r"(?:pos|positions?|positional)(?:emb\w*)?")
"""A ``_``-separated word of a component that names positions (``W_pos``, ``abs_pos_emb``,
``PositionEmbedding``), matched whole: ``composer`` or ``transposed`` are no position words."""

DEFAULT_EMBEDDING_NAMES = TOKEN_EMBEDDING_NAMES | frozenset({
    "embed", "embedding", "embeddings", "embedder", "wpe", "pos_embed", "pos_embedding",
    "position_embedding", "position_embeddings", "embed_positions",
})
"""Path components that name lookup tables (token and position embeddings): ``"embedding"``.

Examples:
    >>> import rowgeom
    >>> rowgeom.TOKEN_EMBEDDING_NAMES <= rowgeom.DEFAULT_EMBEDDING_NAMES
    True
"""

BLOCK_CONTAINER_NAMES = frozenset({
    "layers", "layer", "blocks", "block", "h", "transformer_blocks", "decoder_layers",
    "encoder_layers", "decoder_blocks", "encoder_blocks", "resblocks",
})
"""Path components that hold the repeated transformer blocks (numbered children or a stack).

Any component ending in ``_layers`` or ``_blocks`` does too (MaxText DeepSeek's
``dense_layers`` / ``moe_layers``, praxis' ``x_layers_3``), and a container whose leaves all
carry one layer axis is a stack whatever its name (`rowgeom._structure.find_stacks`)."""

CONTAINER_SUFFIXES = ("_layers", "_blocks")
"""Name endings that make a path component a block container (see `BLOCK_CONTAINER_NAMES`)."""

DEFAULT_HIDDEN_NAMES = frozenset({
    # block containers (a subset of BLOCK_CONTAINER_NAMES: the others are told by structure)
    "layers", "layer", "blocks", "block", "h", "transformer_blocks",
    # attention
    "attn", "attention", "self_attn", "self_attention", "cross_attn", "cross_attention",
    "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "qkv", "qkv_proj", "kv_proj",
    "query", "key", "value", "out", "wq", "wk", "wv", "wo", "c_attn",
    # MLP
    "mlp", "ffn", "feed_forward", "feedforward", "gate", "up", "down", "gate_proj", "up_proj",
    "down_proj", "wi", "wi_0", "wi_1", "w1", "w2", "w3", "c_fc", "c_proj", "fc1", "fc2",
    # mixture of experts (routers are told apart by `DEFAULT_ROUTER_NAMES` and the shapes)
    "experts", "wo_0", "wi_gate_0", "gate_up_proj",
})
"""Path components that name blocks, attention and MLP projections: label ``"hidden"``.

Examples:
    >>> import rowgeom
    >>> {"layers", "q_proj", "mlp"} <= rowgeom.DEFAULT_HIDDEN_NAMES
    True
"""

DEFAULT_ROUTER_NAMES = frozenset({"router", "gate", "gating", "moe_gate", "router_gate"})
"""Path components that name a mixture-of-experts router: label ``"router"``.

``router`` always does (gpt-oss, Llama 4); the others (MaxText's and EasyDeL's ``gate/kernel``,
praxis' ``gate``) only when the shapes agree: the router is ``(d, E)`` (``(E, d)`` for a
PyTorch-style ``weight``; a scanned layer axis aside) and ``E`` is the expert count of the expert
stacks beside it, ``(E, d, f)``-like leaves in the same module, or of its numbered experts. A
dense MLP's ``gate`` (``(d, f)``, no experts beside it) stays ``"hidden"``.

Examples:
    >>> import rowgeom
    >>> {"router", "gate"} <= rowgeom.DEFAULT_ROUTER_NAMES
    True
"""

EXPERT_MODULE = re.compile(r"expert|moe")
"""A path component naming a mixture-of-experts module or its expert stacks (``experts``,
``MoeBlock_0``, ``block_sparse_moe``); ``shared_expert(s)`` (a dense MLP every token uses) and
block containers (``moe_layers``) excepted."""

WRAPPER_SUFFIXES = (("value", "data_array"), ("data_array",))
"""Trailing path components that wrap a parameter instead of naming it: penzai's
``Parameter.value`` holding a ``NamedArray.data_array``. Names are read from the path without
them, so ``(3, 'value', 'data_array')`` carries no name at all."""

DEFAULT_VECTOR_NAMES = frozenset({"scale", "bias", "biases", "gain", "beta", "gamma", "offset"})
"""Leaf names that make a parameter a ``"vector"`` whatever its rank.

A norm scale stacked over scanned layers ``(L, d)`` or a per-head bias ``(H, Dh)`` has rank 2
but no matrix structure. A leaf whose own module is a norm (a component containing ``norm``,
or ``ln_f``, ``ln_1``, ...) is a vector too, e.g. Hugging Face's ``input_layernorm/weight``.

Examples:
    >>> import rowgeom
    >>> sorted(rowgeom.DEFAULT_VECTOR_NAMES)[:3]
    ['beta', 'bias', 'biases']
"""

BIAS_LEAF = re.compile(r"b_[a-z0-9]+")
"""A leaf name, matched whole and lower-cased, of a bias of any rank: TransformerLens's
per-head ``b_Q``, ``b_K``, ``b_V`` ``(n_heads, d_head)``, its ``b_in``, ``b_out``, ``b_U``."""

NORM_MODULE = re.compile(r"norm|^ln(_|\d|f|$)")
"""A path component naming a normalisation module (``final_norm``, ``ln_f``, ``ln_1``)."""

MATRIX_LEAF_NAMES = frozenset({"kernel", "embedding"})
"""Leaf names that stay matrices even inside a norm module."""

GENERIC_LEAF_NAMES = frozenset({"kernel", "weight", "weights", "w", "embedding"})
"""Leaf names that say how a parameter is stored, not what it is for (the module name does)."""

OUT_IN_LEAF_NAMES = frozenset({"weight"})
"""Leaf names of matrices stored ``(out, in)``: PyTorch's and Equinox's ``Linear.weight`` (as
for a head, ``(V, d)``, and a router, ``(E, d)``). Flax's ``kernel`` is ``(in, out)``. Which side
is fan-in matters to Muon's ``"keller"`` and ``"spectral"`` scales."""

GPT2_CONV1D_NAMES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})
"""GPT-2's ``Conv1D`` modules. Hugging Face's Flax GPT-2 stores their ``kernel`` ``(out, in)``
and transposes it in the forward pass; its fused ``c_attn`` of shape ``(3d, d)`` tells such a
tree (a Flax port built on ``nn.Dense`` has ``(d, 3d)``, ``(in, out)`` like any ``kernel``)."""

VOCAB_AXIS_BY_LEAF_NAME = types.MappingProxyType({"kernel": 1, "embedding": 0, "weight": 0})
"""A rank-2 head's vocabulary axis from its leaf name when the shapes cannot tell: Flax's
``kernel`` is ``(d, V)``, an ``embedding`` table and PyTorch-style ``weight`` are ``(V, d)``."""
