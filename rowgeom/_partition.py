"""`partition_by_label`: ``optax.partition`` with its labels checked and matched to the tree by
path, for an optimizer composed by hand (`rowgeom.lm_optimizer` partitions by its plan's labels).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import optax

from rowgeom._messages import no_label_or_transform
from rowgeom._tree import lookup_prefix, map_with_paths, prefix_entries, tree_paths


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
    """The labels tree of `params` (labels unboxed, matched by path prefix), or a ValueError
    listing the parameters without a label and the labels without a transform."""
    table = prefix_entries(labels(params) if callable(labels) else labels)
    found = [(path, lookup_prefix(table, path)) for path, _ in tree_paths(params)]
    if not all(ok and label in transforms for _, (ok, label) in found):
        raise ValueError(no_label_or_transform(found, transforms))
    by_path = {path: label for path, (_, label) in found}
    return map_with_paths(lambda path, _: by_path[path], params)
