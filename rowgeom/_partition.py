"""`partition_by_label`: ``optax.partition`` with labels checked and matched to the tree by path.

Labels are looked up by normalised key path (`rowgeom._tree`), not by tree structure, so one
labels tree serves plain dicts, Flax Linen (boxed ``nn.Partitioned``), Flax NNX (``tx.init``'s
Variables and ``tx.update``'s arrays) and abstract trees.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import optax

from rowgeom._tree import Path, lookup_prefix, map_with_paths, path_str, prefix_entries, tree_paths


def label_table(labels: Any, params: Any) -> dict[Path, Any]:
    """``{path: label}`` of a labels tree (or of ``labels(params)`` for a callable).

    Labels boxed in Variables (a ``jax.tree.map`` over an ``nnx.State`` without ``is_leaf``) are
    unboxed to their strings. Look a parameter up with ``lookup_prefix``: a labels tree may be a
    prefix of the parameters.
    """
    return prefix_entries(labels(params) if callable(labels) else labels)


def partition_by_label(
    transforms: Mapping[str, optax.GradientTransformation], labels: Any,
) -> optax.GradientTransformationExtraArgs:
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

    return optax.partition(dict(transforms),
                           functools.partial(_checked_labels, labels, transforms))


def _checked_labels(labels: Any, transforms: Mapping, params: Any) -> Any:
    """The labels tree of `params` (`label_table`), or a ValueError listing the parameters
    without a label and the labels without a transform."""
    table = label_table(labels, params)
    found = [(path, lookup_prefix(table, path)) for path, _ in tree_paths(params)]
    missing = [path_str(path) for path, (ok, _) in found if not ok]
    if missing:
        raise ValueError("partition_by_label: no label for parameter(s) " + ", ".join(missing))
    no_tx: dict[str, list[str]] = {}
    for path, (_, label) in found:
        if label not in transforms:
            no_tx.setdefault(label, []).append(path_str(path))
    if no_tx:
        detail = "; ".join(f"{lab!r} (used by {', '.join(paths)})" for lab, paths in no_tx.items())
        raise ValueError(f"partition_by_label: no transform for label(s) {detail}. "
                         f"transforms has {sorted(map(str, transforms))}")
    by_path = {path: label for path, (_, label) in found}
    return map_with_paths(lambda path, _: by_path[path], params)
