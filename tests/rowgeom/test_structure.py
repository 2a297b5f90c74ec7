"""Every structure heuristic on its own (rowgeom._structure),
table-driven: each case a small tree of shapes, each heuristic with a positive and a negative
case, checked by what the labels, the plan or the structure say about it."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import pytest
from _nnx_models import unflatten

import rowgeom
from rowgeom._structure import (
    NOT_STACKED,
    ModelStructure,
    StructureError,
    block_position,
    is_position_embedding,
    is_vector_name,
    router_axes,
)
from rowgeom._tree import tree_paths

V, D, F, E, L, H, DH = 40, 16, 24, 6, 3, 2, 8


def nested(flat: dict[str, tuple]) -> dict:
    """A tree of ShapeDtypeStructs from ``{"a/b": shape}``."""
    return unflatten(flat, lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32))


LM = {"embed/embedding": (V, D), "lm_head/kernel": (D, V)}  # what most cases sit beside
TIED = {"tied": "embedding"}  # a tree of tables and no head


class Case(NamedTuple):
    heuristic: str
    positive: bool             # the heuristic applies (True) or must not (False)
    tree: dict[str, tuple]
    check: str                 # "labels", "geometry", "structure" or "raises"
    expect: dict[str, Any]     # path -> label / geometry, structure field -> value, "match"
    options: dict = {}         # label_params' (labels) or describe's (geometry) options


CASES = [
    # Position tables: whole path components (a word of one), never a substring.
    Case("position table", True, {"tokens/embedding": (V, D), "positions/embedding": (64, D)},
         "structure", {"vocab_size": V}, TIED),
    Case("position table", True, {"vocab/embedding": (V, D), "abs_pos_emb/embedding": (64, D)},
         "structure", {"vocab_size": V}, TIED),
    Case("position table", False,
         {"purpose_embed/embedding": (V, D), "embed_positions/embedding": (64, D)},
         "structure", {"vocab_size": V}, TIED),
    Case("position table", False, {"composer/embedding": (V, D)}, "structure",
         {"vocab_size": V, "width": D}, TIED),
    # Router names from the labeler: its extra names reach the router's layout too.
    Case("router names", True, {**LM, "layers/0/ffn/switch/kernel": (D, E),
                                "layers/0/ffn/wi": (E, D, F)},
         "labels", {"layers/0/ffn/switch/kernel": "router"}, {"extra_router_names": {"switch"}}),
    Case("router names", False, {**LM, "layers/0/ffn/switch/kernel": (D, E),
                                 "layers/0/ffn/wi": (E, D, F)},
         "labels", {"layers/0/ffn/switch/kernel": "hidden"}),
    Case("router names", False, {**LM, "layers/0/mlp/switch/kernel": (D, F),
                                 "layers/0/mlp/up/kernel": (D, F)},
         "labels", {"layers/0/mlp/switch/kernel": "hidden"}, {"extra_router_names": {"switch"}}),
    # Expert axes: the one axis of the router's E in each stack beside it is a batch axis.
    Case("expert axes", True, {**LM, "layers/0/moe/router/kernel": (D, E),
                               "layers/0/moe/experts/wi": (E, D, F),
                               "layers/0/moe/experts/wo": (E, F, D)},
         "geometry", {"layers/0/moe/experts/wi": "Muon, in 1 out 2 batch 0",
                      "layers/0/moe/experts/wo": "Muon, in 1 out 2 batch 0"}),
    Case("expert axes", False, {**LM, "layers/0/moe/router/kernel": (D, E),
                                "layers/0/moe/experts/wi": (E, D, F),
                                "layers/0/moe/shared_expert/wi/kernel": (D, F)},
         "geometry", {"layers/0/moe/shared_expert/wi/kernel": "Muon, in 0 out 1"}),
    Case("expert axes", False, {**LM, "layers/0/mlp/gate/kernel": (D, F),
                                "layers/0/mlp/up/kernel": (D, F)},
         "labels", {"layers/0/mlp/gate/kernel": "hidden"}),
    # Layer axes of scanned stacks: read off the stacked norm scales, (L, d) or (d, L).
    Case("layer axes", True, {**LM, "layers/attn/query/kernel": (L, D, H, DH),
                              "layers/norm/scale": (L, D)},
         "geometry", {"layers/attn/query/kernel": "Muon, in 1 out 2,3 batch 0",
                      "layers/norm/scale": "AdamW"}),
    Case("layer axes", True, {**LM, "layers/attn/query/kernel": (D, L, H, DH),
                              "layers/norm/scale": (D, L)},
         "geometry", {"layers/attn/query/kernel": "Muon, in 0 out 2,3 batch 1"}),
    Case("layer axes", True, {**LM, "stack/attn/q/kernel": (L, D, D),
                              "stack/mlp/up/kernel": (L, D, F), "stack/norm/scale": (L, D)},
         "structure", {"stacks": {("stack",): (0, L)}}),
    Case("layer axes", False, {**LM, "layers/attn/query/kernel": (D, D),
                               "layers/norm/scale": (D,)},
         "structure", {"stacks": {("layers",): NOT_STACKED}}),
    # Tied patterns: a token table and no head needs a policy; an unused head is flagged.
    Case("tied", True, {"wte/embedding": (V, D), "h/0/mlp/c_fc/kernel": (D, F)},
         "raises", {"match": "the pattern of tied embeddings"}),
    Case("tied", True, {"wte/embedding": (V, D), "h/0/mlp/c_fc/kernel": (D, F)},
         "labels", {"wte/embedding": "head"}, {"tied": "head"}),
    Case("tied", True, {"wte/embedding": (V, D), "lm_head/kernel": (V, D),
                        "h/0/mlp/c_fc/kernel": (D, F)},
         "labels", {"lm_head/kernel": "embedding", "wte/embedding": "embedding"},
         {"tied": "embedding"}),
    Case("tied", False, {**LM, "h/0/mlp/c_fc/kernel": (D, F)},
         "labels", {"embed/embedding": "embedding", "lm_head/kernel": "head"}),
    # Per-head biases: TransformerLens's b_Q (n_heads, d_head) is a vector, W_Q a matrix.
    Case("per-head bias", True, {**LM, "blocks/0/attn/W_Q": (H, D, DH),
                                 "blocks/0/attn/b_Q": (H, DH), "blocks/0/mlp/b_in": (F,)},
         "labels", {"blocks/0/attn/b_Q": "vector", "blocks/0/mlp/b_in": "vector"}),
    Case("per-head bias", False, {**LM, "blocks/0/attn/W_Q": (H, D, DH),
                                  "blocks/0/attn/bias_proj/kernel": (D, D)},
         "labels", {"blocks/0/attn/W_Q": "hidden", "blocks/0/attn/bias_proj/kernel": "hidden"}),
    # The head's vocabulary axis: the one axis of size V, else the leaf name's convention.
    Case("vocab axis", True, {"embed/embedding": (V, D), "lm_head/weight": (V, D)},
         "geometry", {"lm_head/weight": "RowNorm, vocab axis 0"}),
    Case("vocab axis", False, {"embed/embedding": (D, D), "output/w": (D, D)},
         "raises", {"match": r"output/w.*HeadOptions\(vocab_axis"}),
    # Matrix axes of rank >= 3: the one axis of size d against the rest.
    Case("matrix axes", True, {**LM, "layers/0/attn/query/kernel": (D, H, DH)},
         "geometry", {"layers/0/attn/query/kernel": "Muon, in 0 out 1,2"}),
    Case("matrix axes", False, {**LM, "layers/0/attn/mix/kernel": (D, H, D)},
         "raises", {"match": r"mix/kernel \(16, 2, 16\) has 2 axes of the model width"}),
    # Which side is fan-in (Muon's "keller" and "spectral" scales read it): a Flax kernel is
    # (in, out); a PyTorch/Equinox `weight` is (out, in), and so is Hugging Face's Flax GPT-2
    # Conv1D kernel, told by its fused c_attn (3d, d) (a Flax nn.Dense port has (d, 3d)).
    Case("stored (out, in)", True, {**LM, "layers/0/mlp/up/weight": (F, D)},
         "geometry", {"layers/0/mlp/up/weight": "Muon, in 1 out 0"}),
    Case("stored (out, in)", True, {**LM, "h/0/attn/c_attn/kernel": (3 * D, D),
                                    "h/0/mlp/c_fc/kernel": (F, D),
                                    "h/0/mlp/c_proj/kernel": (D, F)},
         "geometry", {"h/0/attn/c_attn/kernel": "Muon, in 1 out 0",
                      "h/0/mlp/c_fc/kernel": "Muon, in 1 out 0",
                      "h/0/mlp/c_proj/kernel": "Muon, in 1 out 0"}),
    Case("stored (out, in)", True, {**LM, "layers/0/moe/experts/up/weight": (E, F, D)},
         "raises", {"match": r"experts/up/weight.*reduction_axis=2, output_axis=1"}),
    Case("stored (out, in)", False, {**LM, "h/0/attn/c_attn/kernel": (D, 3 * D),
                                     "h/0/mlp/c_fc/kernel": (D, F),
                                     "h/0/mlp/c_proj/kernel": (F, D)},
         "geometry", {"h/0/attn/c_attn/kernel": "Muon, in 0 out 1",
                      "h/0/mlp/c_fc/kernel": "Muon, in 0 out 1",
                      "h/0/mlp/c_proj/kernel": "Muon, in 0 out 1"}),
    # Repeated blocks: a numbered component or container; a norm named "layer..." is none.
    Case("blocks", True, {**LM, "layers_0/adapter/kernel": (D, F),
                          "layers_1/adapter/kernel": (D, F)},
         "labels", {"layers_0/adapter/kernel": "hidden", "layers_1/adapter/kernel": "hidden"}),
    Case("blocks", False, {**LM, "layernorm/scale": (D,), "adapter/kernel": (D, 4)},
         "raises", {"match": r"no label for these matrices: adapter/kernel \(16, 4\)"}),
    # A nameless tree (penzai's unbind_params tuple) is refused; the same shapes named route.
    Case("nameless", True, {"0/value/data_array": (V, D), "1/value/data_array": (D, V)},
         "raises", {"match": r"2 parameter\(s\) have no names"}),
    Case("nameless", False, {"0/embed/data_array": (V, D), "0/lm_head/data_array": (D, V)},
         "labels", {"0/embed/data_array": "embedding", "0/lm_head/data_array": "head"}),
]


def _flat_labels(tree, **options) -> dict[str, str]:
    return {"/".join(p): lab for p, lab in tree_paths(rowgeom.label_params(tree, **options))}


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{c.heuristic}-{'pos' if c.positive else 'neg'}")
def test_heuristic(case: Case):
    tree = nested(case.tree)
    if case.check == "labels":
        labels = _flat_labels(tree, **case.options)
        assert {p: labels[p] for p in case.expect} == case.expect
    elif case.check == "geometry":
        rows = {r.path: r.geometry for r in rowgeom.describe(tree, **case.options)}
        assert {p: rows[p] for p in case.expect} == case.expect
    elif case.check == "structure":
        structure = rowgeom.describe(tree, **case.options).structure
        assert {k: getattr(structure, k) for k in case.expect} == case.expect
    else:
        with pytest.raises(ValueError, match=case.expect["match"]):
            rowgeom.describe(tree, **case.options)


def test_every_heuristic_has_a_positive_and_a_negative_case():
    kinds: dict[str, set[bool]] = {}
    for case in CASES:
        kinds.setdefault(case.heuristic, set()).add(case.positive)
    assert all(seen == {True, False} for seen in kinds.values()), kinds


# --- The predicates themselves ----------------------------------------------------------------


@pytest.mark.parametrize("path, expected", [
    (("wpe",), True), (("W_pos",), True), (("abs_pos_emb", "embedding"), True),
    (("positionembedding_0",), True), (("PositionEmbedding",), True),
    (("composer", "embedding"), False), (("purpose",), False), (("transposed_proj",), False),
    (("positive_mask",), False), (("post_attention_layernorm",), False)])
def test_position_tables_are_matched_by_whole_words(path, expected):
    assert is_position_embedding(path) is expected


@pytest.mark.parametrize("name, expected", [
    ("b_Q", True), ("b_in", True), ("b_U", True), ("final_logits_bias", True), ("bias", True),
    ("W_Q", False), ("kernel", False), ("b", False), ("bq_proj", False)])
def test_bias_names(name, expected):
    assert is_vector_name(("blocks", "0", "attn", name), rowgeom.DEFAULT_VECTOR_NAMES) is expected


@pytest.mark.parametrize("path, expected", [
    (("layers", "0", "mlp", "kernel"), (1, False)), (("h_3", "attn", "kernel"), (0, False)),
    (("layers", "mlp", "kernel"), (0, True)), (("layernorm", "scale"), None),
    (("0", "mlp", "kernel"), None)])
def test_block_positions(path, expected):
    assert block_position(path) == expected


def test_router_layout_names_come_from_the_structure():
    """No expert count, no width: the leaf name says the layout, and the labeler's router
    names count as much as the defaults."""
    bare = ModelStructure(None, None, None)
    with pytest.raises(StructureError, match="cannot tell the expert axis"):
        router_axes(("moe", "switch"), (8, 4), bare)
    named = bare._replace(router_names=frozenset({"switch"}))
    assert router_axes(("moe", "switch"), (8, 4), named) == (0, 1)
    assert router_axes(("moe", "weight"), (4, 8), bare) == (1, 0)  # PyTorch-style (E, d)


def test_the_structure_is_read_only():
    structure = rowgeom.describe(nested(LM)).structure
    for field in ("stacks", "experts", "routers"):
        with pytest.raises(TypeError):
            getattr(structure, field)["x"] = 1
    assert ModelStructure(None, None, None).experts is ModelStructure(None, None, None).experts
