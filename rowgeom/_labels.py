"""Parameter labels for per-block update geometry: `Labeler` and `label_params`, and labels
given as a tree or callable matched to the leaves by path (`labelled_leaves`).

Every leaf gets one of `LABELS` by its path's names first, its shapes a cross-check, never by
shape alone (a rank-2 rule such as ``optax.contrib.muon``'s default silently sends the embedding
table and the head to Muon); a matrix nothing names is an error naming it, unless the caller opts
into a fallback. Only paths and shapes are read (Flax boxes and abstract trees alike). Every
problem of a tree is one error, each leaf with the labels that fit it and a fix to paste (written
by `rowgeom._messages`). The rules with examples: docs/guides/labels.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import jax

from rowgeom._messages import (
    label_problems,
    several_tied_tables,
    tied_without_head,
    untied_head,
)
from rowgeom._names import (
    DEFAULT_EMBEDDING_NAMES,
    DEFAULT_HEAD_NAMES,
    DEFAULT_HIDDEN_NAMES,
    DEFAULT_ROUTER_NAMES,
    DEFAULT_VECTOR_NAMES,
    TIED_POLICIES,
)
from rowgeom._structure import (
    ModelStructure,
    in_blocks,
    is_nameless,
    is_position_embedding,
    is_vector_name,
    layer_axis,
    model_structure,
    naming_path,
)
from rowgeom._tree import (
    leaf_shape,
    map_with_paths,
    one_of,
    path_str,
    prefix_entries,
    resolve_per_leaf,
    tree_paths,
)


def _check_names(names, argname) -> frozenset[str]:
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


class _Leaf(NamedTuple):
    path: tuple[str, ...]
    shape: tuple[int, ...]
    label: str | None
    source: str | None  # rank, rule, vector name, name, block, stack, router, shape, default,
    #                     tied, unused head; "given" for labels given as a tree or callable


def _by_name(path, cfg: Labeler) -> str | None:
    # The first component (from the root) that names a known block decides, so
    # "layers/0/attention/output/dense" (BERT) is hidden although "output" names a head.
    for component in naming_path(path):
        c = component.lower()
        if c in cfg.head_names:
            return "head"
        if c in cfg.embedding_names:
            return "embedding"
        if c in cfg.hidden_names:
            return "hidden"
    return None


def _first_pass(path, shape, cfg: Labeler) -> _Leaf:
    if len(shape) < 2:
        return _Leaf(path, shape, "vector", "rank")
    joined = path_str(path)
    for pattern, label in cfg._compiled:
        if pattern.search(joined):
            return _Leaf(path, shape, label, "rule")
    if sum(n > 1 for n in shape) < 2:  # (1, V), (d, 1): no matrix structure
        return _Leaf(path, shape, "vector", "rank")
    if is_vector_name(path, cfg.vector_names):
        return _Leaf(path, shape, "vector", "vector name")
    label = _by_name(path, cfg)
    return _Leaf(path, shape, label, None if label is None else "name")


def _resolve_leaf(leaf: _Leaf, layout: ModelStructure, vocabs: set[int], default,
                  problems: dict[str, list]) -> _Leaf:
    """One leaf after the first pass: kept (rank, rule, vector name), a stacked vector, a
    router the shapes confirm, else labelled by the structure where its names gave none, and
    its names cross-checked against the shapes (each failed check goes to `problems`)."""
    path, shape, label, why = leaf
    if why in ("rank", "rule", "vector name"):
        return leaf
    if len(shape) == 2 and label in (None, "hidden") \
            and layer_axis(path, shape, layout.stacks, min_rank=2) is not None:
        return _Leaf(path, shape, "vector", "stack")  # a vector with a layer axis
    if path in layout.routers and label in (None, "hidden"):
        return _Leaf(path, shape, "router", "router")
    if is_nameless(path) and label is None:
        problems["nameless"].append((path, shape))
        return leaf
    blocks = in_blocks(path, layout.stacks)
    if label is None and blocks:
        label, why = "hidden", "block"
    if label is None and layout.vocab_size is not None and len(shape) == 2 \
            and path != layout.source:
        if shape[0] == layout.width and shape[1] in vocabs:
            label, why = "head", "shape"
        elif shape[1] == layout.width and shape[0] in vocabs:
            problems["ambiguous"].append((path, shape))
    if label is None and default is not None:
        label, why = default, "default"
        if layout.vocab_size is None and not blocks and label in ("hidden", "router"):
            problems["unchecked"].append((path, shape))
    if label is None:
        problems["unmatched"].append((path, shape))
    elif label == "hidden" and not blocks and vocabs & set(shape) and path != layout.source:
        problems["not_hidden"].append((path, shape, why))
    elif label == "head" and why == "name" and vocabs and not vocabs & set(shape):
        problems["not_head"].append((path, shape))
    return _Leaf(path, shape, label, why)


def _resolve(leaves: list[_Leaf], cfg: Labeler) -> tuple[list[_Leaf], ModelStructure]:
    """Structural cross-checks and inference on top of the names (module docstring), read
    against the structure the names alone give; every problem of the tree in one ValueError."""
    ruled = {lf.path for lf in leaves if lf.source == "rule"}
    layout = model_structure(leaves, router_names=cfg.router_names,
                             movable=lambda p: p not in ruled)
    vocabs = set()  # every token table's size: an encoder-decoder may have two vocabularies
    if layout.vocab_size is not None:
        vocabs = {layout.vocab_size} | {
            lf.shape[0] for lf in leaves if lf.label == "embedding" and lf.source == "name"
            and len(lf.shape) == 2 and not is_position_embedding(lf.path)}
    problems: dict[str, list] = {kind: [] for kind in (
        "nameless", "not_hidden", "not_head", "unchecked", "unmatched", "ambiguous")}
    out = [_resolve_leaf(leaf, layout, vocabs, cfg.default, problems) for leaf in leaves]
    message = any(problems.values()) and label_problems(problems, vocabs, layout, cfg.default)
    if message:
        raise ValueError(message)
    return out, layout


def _tied_table(leaves: list[_Leaf], layout: ModelStructure, tied):
    """Checks the tied-embedding policy: ``(path of a table to relabel "head", unused heads)``."""
    heads = [lf for lf in leaves if lf.label == "head"]
    embeds = [lf for lf in leaves if lf.label == "embedding"]
    if tied is None:
        if embeds and not heads:
            raise ValueError(tied_without_head(embeds))
        return None, []
    unused = [lf for lf in heads if lf.source in ("name", "shape")]  # the logits read the table
    tables = {tuple(lf.shape) for lf in embeds if len(lf.shape) == 2}
    wrong = [lf for lf in unused if lf.shape not in tables | {s[::-1] for s in tables}]
    if wrong:
        raise ValueError(untied_head(tied, wrong))
    heads = [lf for lf in heads if lf not in unused]
    if not embeds and not heads:
        raise ValueError(f"label_params: tied={tied!r} but no embedding table was found")
    if tied == "embedding" or heads:  # a head labelled by a user rule is the tied table
        return None, unused
    # Of several tables, the one V and d were read from (a token table's name first, position
    # tables never).
    paths = [lf.path for lf in embeds]
    if len(paths) > 1 and layout.source not in paths:
        raise ValueError(several_tied_tables(embeds))
    return (paths[0] if len(paths) == 1 else layout.source), unused


@dataclasses.dataclass(frozen=True)
class Labeler:
    """The labelling rules of `label_params`, as one frozen, reusable object.

    Calling it labels a tree: ``Labeler(...)(params)`` is ``label_params(params, ...)``, so it
    serves as ``optax.partition``'s label function (called with the params at init and the
    updates at update) and as `lm_optimizer`'s ``labels``. Arguments are checked once, on
    creation; the ``extra_*`` names are merged into their base set (``labeler.hidden_names``
    holds both), so two labelers that label alike compare equal.

    Attributes:
      head_names: path component names that mean ``"head"`` (default `DEFAULT_HEAD_NAMES`).
      embedding_names: names that mean ``"embedding"`` (default `DEFAULT_EMBEDDING_NAMES`).
      hidden_names: names that mean ``"hidden"`` (default `DEFAULT_HIDDEN_NAMES`).
      vector_names: leaf names that mean ``"vector"`` (default `DEFAULT_VECTOR_NAMES`).
      extra_head_names: names added to `head_names`.
      extra_embedding_names: names added to `embedding_names`.
      extra_hidden_names: names added to `hidden_names`.
      extra_vector_names: names added to `vector_names`.
      router_names: names that mean ``"router"`` when the shapes agree (default
        `DEFAULT_ROUTER_NAMES`: a ``(d, E)`` matrix whose ``E`` is the expert count beside it).
      extra_router_names: names added to `router_names`.
      rules: ``(regex, label)`` pairs tried first, in order, on matrices.
      tied: None, ``"embedding"`` or ``"head"``: policy for a head tied to the embedding.
      default: label for matrices nothing names (e.g. ``"hidden"``); None raises instead.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> labeler = rowgeom.Labeler(extra_hidden_names={"router"})
      >>> params = {"embed": {"embedding": jnp.zeros((100, 16))},
      ...           "router": {"kernel": jnp.zeros((16, 4))},
      ...           "lm_head": {"kernel": jnp.zeros((16, 100))}}
      >>> labeler(params)["router"]["kernel"]
      'hidden'
    """

    head_names: Collection[str] = DEFAULT_HEAD_NAMES
    embedding_names: Collection[str] = DEFAULT_EMBEDDING_NAMES
    hidden_names: Collection[str] = DEFAULT_HIDDEN_NAMES
    vector_names: Collection[str] = DEFAULT_VECTOR_NAMES
    extra_head_names: Collection[str] = ()
    extra_embedding_names: Collection[str] = ()
    extra_hidden_names: Collection[str] = ()
    extra_vector_names: Collection[str] = ()
    rules: Sequence[tuple[str, str]] = ()
    tied: str | None = None
    default: str | None = None
    router_names: Collection[str] = DEFAULT_ROUTER_NAMES
    extra_router_names: Collection[str] = ()
    _compiled: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        one_of(self.tied, TIED_POLICIES, "tied")
        if self.default is not None and not isinstance(self.default, str):
            raise TypeError(f"default must be a label string or None, got {self.default!r}")
        for kind in ("head", "embedding", "hidden", "vector", "router"):
            merged = _check_names(getattr(self, f"{kind}_names"), f"{kind}_names") | _check_names(
                getattr(self, f"extra_{kind}_names"), f"extra_{kind}_names")
            object.__setattr__(self, f"{kind}_names", merged)
            object.__setattr__(self, f"extra_{kind}_names", frozenset())
        compiled = _compile_rules(self.rules)
        object.__setattr__(self, "rules", tuple((p.pattern, lab) for p, lab in compiled))
        object.__setattr__(self, "_compiled", compiled)

    def __call__(self, params: Any) -> Any:
        """The labels tree of `params` (same structure, Flax boxes replaced by labels)."""
        table = {lf.path: lf.label for lf in self.label_leaves(params)}
        return map_with_paths(lambda p, _: table[p], params)

    def label_leaves(self, params: Any) -> list[_Leaf]:
        """Every leaf's label with the reason it got it (``source``)."""
        first = [_first_pass(p, leaf_shape(x), self) for p, x in tree_paths(params)]
        leaves, structure = _resolve(first, self)
        retie, unused = _tied_table(leaves, structure, self.tied)
        unused_paths = {lf.path for lf in unused}
        return [lf._replace(label="head", source="tied") if lf.path == retie
                else lf._replace(label="embedding", source="unused head")
                if lf.path in unused_paths else lf for lf in leaves]


def label_params(params: Any, **options: Any) -> Any:
    """Labels every leaf of `params` with one of `LABELS` (or a custom label from `rules`).

    Names first (the first `rules` entry whose regex ``re.search``-es the ``"/"``-joined path;
    rank < 2 leaves and vector names; the first path component, from the root, in
    `head_names`, `embedding_names` or `hidden_names`), then the structure (routers the expert
    stacks confirm, matrices inside the repeated blocks, a ``(d, V)`` head), with the shapes
    as a cross-check: never by shape alone. A model with an embedding table but no head needs
    `tied`. Every problem of a tree is one ValueError naming the leaves and the fixes. The
    rules step by step, the cross-checks and tied embeddings: the guide "Labels and
    partitioning" (docs/guides/labels.md).

    Matching is on whole, case-insensitive path components. Flax boxes are labelled as a
    whole, so the labels tree is a prefix of both the Variable tree NNX passes to ``tx.init``
    and the plain-array tree it passes to ``tx.update``.

    Args:
      params: any pytree of arrays, ``jax.ShapeDtypeStruct`` or Flax boxes (shapes only).
      **options: the rules, as `Labeler`'s attributes (``rules=``, ``tied=``, ``default=``,
        ``extra_hidden_names=``, ...).

    Returns:
      A tree of label strings with the structure of `params` (boxes replaced by labels).
      For an ``optax.partition`` label function use `Labeler`.

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
      >>> params["adapter"] = {"kernel": jnp.zeros((16, 4))}   # no known name: an error
      >>> rowgeom.label_params(params)
      Traceback (most recent call last):
      ...
      ValueError: label_params: no label for these matrices: adapter/kernel (16, 4). ...
      >>> rowgeom.label_params(params, rules=[(r"^adapter/", "hidden")])["adapter"]["kernel"]
      'hidden'
    """
    return Labeler(**options)(params)


class GivenLabels(tuple):
    """A labels tree as ``(("/"-joined path, label), ...)``: nested and flat trees that mean the
    same share a plan, and a later change to the caller's dict changes none."""

    def __new__(cls, labels: Any):
        return super().__new__(cls, sorted((path_str(p), label)
                                           for p, label in prefix_entries(labels).items()))


def labels_option(labels: Any, tied: str | None) -> tuple[Any, str | None]:
    """`lm_optimizer`'s ``labels`` and ``tied`` as the plan reads them: a `Labeler` holding the
    tied policy (said once: here or in the `Labeler` given), a `GivenLabels` or a callable."""
    one_of(tied, TIED_POLICIES, "tied")
    if isinstance(labels, (str, jax.Array)):
        # A callable `labels` passed to inject_hyperparams arrives here evaluated as a schedule.
        raise TypeError(f"labels must be None, a tree of labels or a callable, got {labels!r}; "
                        "under optax.inject_hyperparams list it in static_args "
                        "(rowgeom.STATIC_ARGS)")
    if labels is None:
        labels = Labeler(tied=tied)
    elif isinstance(labels, Labeler):
        if labels.tied is not None and tied is not None:
            raise ValueError(f"lm_optimizer: tied={tied!r} and labels=Labeler(tied="
                             f"{labels.tied!r}) both set the tied policy; give it once")
        tied = labels.tied if tied is None else tied
        labels = dataclasses.replace(labels, tied=tied)
    elif not callable(labels):  # a tree of labels
        labels = GivenLabels(labels)
    return labels, tied


def labelled_leaves(labels: Any, tree: Any) -> tuple[list[_Leaf], frozenset[str]]:
    """Every leaf's label with its reason, and the router names: by a `Labeler`, or by labels
    given as a tree (matched by path: `rowgeom._tree.resolve_per_leaf`), a `GivenLabels` or a
    callable ``tree -> labels`` (reason ``"given"``; a leaf no label covers is an error)."""
    if isinstance(labels, Labeler):
        return labels.label_leaves(tree), frozenset(labels.router_names)
    entries = tree_paths(tree)
    given = labels(tree) if callable(labels) else labels
    given = dict(given) if isinstance(given, GivenLabels) else given
    per_leaf = resolve_per_leaf(given, [p for p, _ in entries],
                                is_value=lambda v: isinstance(v, str), argname="labels")
    missing = [path_str(p) for (p, _), (found, _) in zip(entries, per_leaf, strict=True)
               if not found]
    if missing:
        raise ValueError(f"lm_optimizer: no label for parameter(s) {', '.join(missing)}")
    return [_Leaf(p, leaf_shape(x), str(label), "given")
            for (p, x), (_, label) in zip(entries, per_leaf, strict=True)], DEFAULT_ROUTER_NAMES
