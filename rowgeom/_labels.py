"""Parameter labels for per-block update geometry, and a checked `optax.partition`.

A language model has four kinds of parameters, and each wants its own geometry:

- ``"hidden"``: matrices inside the transformer blocks (attention and MLP projections).
  Muon's spectral geometry fits them.
- ``"head"``: the output (unembedding) matrix. Its step is seen by the softmax through
  the row diameter (arXiv 2608.22253), so it gets projected RowNorm.
- ``"embedding"``: lookup tables. Only the rows of tokens in the batch get a gradient;
  an orthogonalized step would spread it over all rows, so they get AdamW.
- ``"vector"``: every rank < 2 leaf (biases, norm scales), trained with AdamW.

`label_params` names matrices by their path, never by shape alone: a rank-2 rule such as
the default of ``optax.contrib.muon`` silently sends the embedding table and the head to
Muon. A matrix that no name matches is an error unless the caller opts into a fallback.

Trees from plain dicts, Flax Linen (``{"params": ...}``, boxed ``nn.Partitioned``) and
Flax NNX (``nnx.State`` of ``nnx.Variable`` as given to ``tx.init``, and the plain arrays
given to ``tx.update``) are supported. Only shapes are read, so abstract trees
(``jax.ShapeDtypeStruct``, ``nnx.eval_shape``) work too. Flax is optional and never imported
here: its box types are recognised only if the caller already imported it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
import optax

LABELS = ("hidden", "head", "embedding", "vector")
"""The four parameter labels, one per update geometry.

``"hidden"`` (Muon), ``"head"`` (projected RowNorm), ``"embedding"`` and ``"vector"`` (AdamW);
the keys `lm_optimizer` partitions by and `label_params` assigns.

Examples:
    >>> import rowgeom
    >>> rowgeom.LABELS
    ('hidden', 'head', 'embedding', 'vector')
"""

DEFAULT_HEAD_NAMES = frozenset({
    "lm_head", "head", "output", "output_layer", "unembed", "unembedding", "unembedder",
    "logits", "logits_dense", "to_logits",
})
# Token-embedding names: used to pick the tied table when several embeddings exist.
TOKEN_EMBEDDING_NAMES = frozenset({
    "wte", "tok_embeddings", "tok_embedding", "tok_embed", "token_embedder", "token_embedding",
    "token_embeddings", "embed_tokens", "word_embeddings", "word_embedding",
})
DEFAULT_EMBEDDING_NAMES = TOKEN_EMBEDDING_NAMES | frozenset({
    "embed", "embedding", "embeddings", "embedder", "wpe", "pos_embed", "pos_embedding",
    "position_embedding", "position_embeddings", "embed_positions",
})
DEFAULT_HIDDEN_NAMES = frozenset({
    # block containers
    "layers", "layer", "blocks", "block", "h", "transformer_blocks",
    # attention
    "attn", "attention", "self_attn", "self_attention", "cross_attn", "cross_attention",
    "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "qkv", "qkv_proj", "kv_proj",
    "query", "key", "value", "out", "wq", "wk", "wv", "wo", "c_attn",
    # MLP
    "mlp", "ffn", "feed_forward", "feedforward", "gate", "up", "down", "gate_proj", "up_proj",
    "down_proj", "wi", "wi_0", "wi_1", "w1", "w2", "w3", "c_fc", "c_proj", "fc1", "fc2",
    "experts",
})
_TIED_POLICIES = (None, "embedding", "head")


def _box_types() -> tuple[type, ...]:
    """Flax's parameter boxes, if Flax is loaded (a tree cannot hold them otherwise)."""
    types = []
    variablelib = sys.modules.get("flax.nnx.variablelib")
    if variablelib is not None:
        types.append(variablelib.Variable)
    meta = sys.modules.get("flax.core.meta")
    if meta is not None:
        types.append(meta.AxisMetadata)
    return tuple(types)


def _unbox(x, box_types):
    """The array (or ShapeDtypeStruct) inside a Flax box; `x` itself otherwise."""
    if box_types and isinstance(x, box_types):
        if hasattr(x, "get_value"):
            return x.get_value()
        if hasattr(x, "unbox"):
            return x.unbox()
        return x.value
    return x


def _shape(x, box_types) -> tuple[int, ...]:
    x = _unbox(x, box_types)
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else np.shape(x)


def _key_str(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tree_paths(tree):
    """Yields (path tuple of str, leaf) with Flax boxes (nnx.Variable, ...) as leaves.

    DictKey / GetAttrKey / SequenceKey are normalised to their names, so an ``nnx.State``
    of Variables, the same state as plain arrays, and a nested dict give the same paths.
    """
    box_types = _box_types()
    is_leaf = (lambda x: isinstance(x, box_types)) if box_types else None
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    for path, leaf in flat:
        yield tuple(_key_str(k) for k in path), leaf


def map_with_paths(fn, tree, *, is_leaf=None):
    """Maps fn(path tuple of str, leaf) over `tree`, with Flax boxes (and `is_leaf`) as leaves."""
    box_types = _box_types()
    extra = is_leaf if is_leaf is not None else (lambda x: False)
    leaf = lambda x: extra(x) or (bool(box_types) and isinstance(x, box_types))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fn(tuple(_key_str(k) for k in p), x), tree, is_leaf=leaf)


def leaf_shape(x) -> tuple[int, ...]:
    """Shape of a leaf, a Flax box's content or a ShapeDtypeStruct (values are never read)."""
    return _shape(x, _box_types())


def _check_names(names, argname):
    if isinstance(names, str):
        raise TypeError(f"{argname} must be a collection of names, not the string {names!r}")
    return frozenset(str(n).lower() for n in names)


def _compile_rules(rules):
    compiled = []
    for i, rule in enumerate(rules):
        try:
            pattern, label = rule
        except (TypeError, ValueError):
            raise TypeError(
                f"rules[{i}] must be a (regex, label) pair, got {rule!r}") from None
        if not isinstance(label, str):
            raise TypeError(f"rules[{i}] label must be a string, got {label!r}")
        try:
            compiled.append((re.compile(pattern), label))
        except (re.error, TypeError) as e:
            raise ValueError(f"rules[{i}] has an invalid regex {pattern!r}: {e}") from None
    return tuple(compiled)


def make_labeler(
    *,
    head_names=DEFAULT_HEAD_NAMES,
    embedding_names=DEFAULT_EMBEDDING_NAMES,
    hidden_names=DEFAULT_HIDDEN_NAMES,
    rules: Sequence[tuple[str, str]] = (),
    tied: str | None = None,
    default: str | None = None,
) -> Callable:
    """Returns ``labeler(params) -> tree of labels``: `label_params` with its options bound.

    Arguments are checked once, here. The result suits ``optax.partition`` and
    `partition_by_label`, which call it with the params at init and the updates at update.
    """
    head_names = _check_names(head_names, "head_names")
    embedding_names = _check_names(embedding_names, "embedding_names")
    hidden_names = _check_names(hidden_names, "hidden_names")
    rules = _compile_rules(rules)
    if tied not in _TIED_POLICIES:
        raise ValueError(f"tied must be one of {_TIED_POLICIES}, got {tied!r}")
    if default is not None and not isinstance(default, str):
        raise TypeError(f"default must be a label string or None, got {default!r}")

    def by_name(path):
        # The first component (from the root) that names a known block decides, so
        # "layers/0/attention/output/dense" (BERT) is hidden although "output" names a head.
        for component in path:
            c = component.lower()
            if c in head_names:
                return "head"
            if c in embedding_names:
                return "embedding"
            if c in hidden_names:
                return "hidden"
        return None

    def labeler(params):
        box_types = _box_types()
        labelled = {}  # path -> (label, source)
        unmatched = []

        def label_leaf(path, leaf):
            shape = _shape(leaf, box_types)
            if len(shape) < 2:
                return "vector"
            path_str = "/".join(path)
            for pattern, label in rules:
                if pattern.search(path_str):
                    labelled[path] = (label, "rule")
                    return label
            label = by_name(path)
            if label is None:
                if default is None:
                    unmatched.append(f"{path_str} {shape}")
                    return None
                label = default
            labelled[path] = (label, "name")
            return label

        labels = map_with_paths(label_leaf, params)
        if unmatched:
            raise ValueError(
                "label_params: no label for these matrices: " + ", ".join(unmatched)
                + ". Name them with rules=[(regex, label)] (labels: hidden, head, embedding), "
                "add their container names to hidden_names=/head_names=/embedding_names=, "
                "or pass default='hidden' to send every unnamed matrix to Muon explicitly.")
        retie = _tied_table(labelled, tied)
        if retie is not None:
            labels = map_with_paths(
                lambda p, lab: "head" if p == retie else lab, labels)
        return labels

    return labeler


def _tied_table(labelled, tied):
    """Checks the tied-embedding policy; returns the path of a table to relabel "head"."""
    heads = [p for p, (lab, _) in labelled.items() if lab == "head"]
    embeds = [p for p, (lab, _) in labelled.items() if lab == "embedding"]
    show = lambda paths: ", ".join("/".join(p) for p in paths)
    if tied is None:
        if embeds and not heads:
            raise ValueError(
                f"label_params: found embedding table(s) {show(embeds)} but no head matrix; "
                "the head may be tied to the embedding. Pass tied='embedding' (train the "
                "table with AdamW as an embedding) or tied='head' (train it with the head "
                "optimizer, uncentred RowNorm), or name the head with rules=...")
        return None
    named_heads = [p for p in heads if labelled[p][1] == "name"]
    if named_heads:
        raise ValueError(
            f"label_params: tied={tied!r} but the params have a separate head {show(named_heads)}; "
            "pass tied=None for an untied head")
    if tied == "embedding" or heads:  # a head labelled by a user rule is the tied table
        if not embeds and not heads:
            raise ValueError(f"label_params: tied={tied!r} but no embedding table was found")
        return None
    if len(embeds) > 1:
        tokens = [p for p in embeds if any(c.lower() in TOKEN_EMBEDDING_NAMES for c in p)]
        if len(tokens) != 1:
            raise ValueError(
                f"label_params: tied='head' but several embedding tables {show(embeds)}; "
                "label the tied one with rules=[(regex, 'head')]")
        embeds = tokens
    if not embeds:
        raise ValueError("label_params: tied='head' but no embedding table was found")
    return embeds[0]


def label_params(
    params,
    *,
    head_names=DEFAULT_HEAD_NAMES,
    embedding_names=DEFAULT_EMBEDDING_NAMES,
    hidden_names=DEFAULT_HIDDEN_NAMES,
    rules: Sequence[tuple[str, str]] = (),
    tied: str | None = None,
    default: str | None = None,
):
    """Labels every leaf of `params` with one of `LABELS` (or a custom label from `rules`).

    - Rank < 2 leaves (biases, norm scales, scalars): ``"vector"``.
    - Matrices (rank >= 2): the first `rules` entry ``(regex, label)`` whose regex
      ``re.search``-es the ``"/"``-joined path; else the first path component, from the
      root, found in `head_names`, `embedding_names` or `hidden_names` (in that priority
      within one component); else `default`; else ValueError naming the path.
    - Tied embeddings: a model with an embedding table but no head raises unless `tied`
      says how to train the table: ``"embedding"`` (AdamW) or ``"head"`` (the head
      optimizer; arXiv 2608.22253 geometry without centring, since the shift is no symmetry
      of an input embedding). With ``tied="head"`` the single (token) embedding table is
      labelled ``"head"``, or the table a rule labelled ``"head"``.

    Matching is on whole, case-insensitive path components: ``"h"`` matches GPT-2's
    ``h/0/attn`` but not ``head``. Flax boxes (``nnx.Variable``, ``nn.Partitioned``) are
    labelled as a whole, so the labels tree is a prefix of both the Variable tree NNX
    passes to ``tx.init`` and the plain-array tree it passes to ``tx.update``.

    Args:
      params: any pytree of arrays, ``jax.ShapeDtypeStruct`` or Flax boxes (shapes only).
      head_names: path component names that mean ``"head"``.
      embedding_names: path component names that mean ``"embedding"``.
      hidden_names: path component names that mean ``"hidden"``.
      rules: ``(regex, label)`` pairs tried first, in order, on matrices.
      tied: None, ``"embedding"`` or ``"head"``: policy for a head tied to the embedding.
      default: label for matrices nothing names (e.g. ``"hidden"``); None raises instead.

    Returns:
      A tree of label strings with the structure of `params` (boxes replaced by labels).
      For an ``optax.partition`` label function use `make_labeler` or
      ``functools.partial(label_params, ...)``.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> params = {"embed": {"embedding": jnp.zeros((100, 16))},
      ...           "layers": {"0": {"attn": {"q_proj": {"kernel": jnp.zeros((16, 16))}}}},
      ...           "final_norm": {"scale": jnp.ones(16)},
      ...           "lm_head": {"kernel": jnp.zeros((16, 100))}}
      >>> labels = rowgeom.label_params(params)
      >>> labels["lm_head"]["kernel"], labels["embed"]["embedding"], labels["final_norm"]["scale"]
      ('head', 'embedding', 'vector')
      >>> labels["layers"]["0"]["attn"]["q_proj"]["kernel"]
      'hidden'
      >>> params["router"] = {"kernel": jnp.zeros((16, 4))}   # no known name: an error
      >>> rowgeom.label_params(params)
      Traceback (most recent call last):
      ...
      ValueError: label_params: no label for these matrices: router/kernel (16, 4). ...
      >>> rowgeom.label_params(params, rules=[(r"^router/", "hidden")])["router"]["kernel"]
      'hidden'
    """
    return make_labeler(
        head_names=head_names, embedding_names=embedding_names, hidden_names=hidden_names,
        rules=rules, tied=tied, default=default)(params)


def _lookup(table: Mapping[tuple[str, ...], object], path: tuple[str, ...]):
    """The label of the longest prefix of `path` in `table` (label trees may be prefixes)."""
    for n in range(len(path), -1, -1):
        if path[:n] in table:
            return True, table[path[:n]]
    return False, None


def partition_by_label(transforms: Mapping[str, optax.GradientTransformation], labels):
    """``optax.partition`` with labels checked and matched to the tree by path.

    `labels` is a tree of label strings (the same structure as the params or a prefix of
    it) or a callable ``params -> such a tree``. Labels are looked up by normalised key
    path, not by tree structure, so one labels tree serves both calls ``nnx.Optimizer``
    makes: ``tx.init`` with an ``nnx.State`` of ``nnx.Variable`` and ``tx.update`` with the
    plain arrays. (Plain ``optax.partition`` fails on the update when the labels tree still
    holds Variables, e.g. ``jax.tree.map(f, state)`` without ``is_leaf``, or when the labels
    are a dict but the params an ``nnx.State``.)

    Every parameter needs a label and every label a transform; otherwise a ValueError at
    init (and update) lists the missing labels and their paths.

    Returns:
      The ``optax.partition`` transformation.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, rowgeom
      >>> params = {"mlp": {"kernel": jnp.zeros((8, 8))}, "lm_head": {"kernel": jnp.zeros((8, 32))}}
      >>> head = optax.chain(rowgeom.projected_rownorm(vocab_axis=1),
      ...                    optax.scale_by_learning_rate(1e-2))
      >>> tx = rowgeom.partition_by_label({"hidden": optax.sgd(1e-2), "head": head},
      ...                                 rowgeom.label_params)
      >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
      >>> rowgeom.partition_by_label({"hidden": optax.sgd(1e-2)}, rowgeom.label_params).init(params)
      Traceback (most recent call last):
      ...
      ValueError: partition_by_label: no transform for label(s) 'head' (used by lm_head/kernel). ...
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(f"transforms must be a mapping label -> transformation, got "
                        f"{type(transforms).__name__}")
    for name, tx in transforms.items():
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"transforms[{name!r}] must be an optax GradientTransformation, "
                            f"got {type(tx).__name__}")

    def label_fn(params):
        tree = labels(params) if callable(labels) else labels
        box_types = _box_types()
        # Labels boxed in Variables (a map without is_leaf) are unboxed to their strings.
        table = {p: _unbox(lab, box_types) for p, lab in tree_paths(tree)}
        missing_label, missing_tx = [], {}

        def label_of(path, _):
            found, label = _lookup(table, path)
            if not found:
                missing_label.append("/".join(path))
                return None
            if label not in transforms:
                missing_tx.setdefault(label, []).append("/".join(path))
            return label

        out = map_with_paths(label_of, params)
        if missing_label:
            raise ValueError("partition_by_label: no label for parameter(s) "
                             + ", ".join(missing_label))
        if missing_tx:
            detail = "; ".join(f"{lab!r} (used by {', '.join(paths)})"
                               for lab, paths in missing_tx.items())
            raise ValueError(
                f"partition_by_label: no transform for label(s) {detail}. "
                f"transforms has {sorted(map(str, transforms))}")
        return out

    return optax.partition(dict(transforms), label_fn)
