"""Asserting that parameters are routed to the intended geometry, with a readable diff."""

from __future__ import annotations

from rowgeom.testing._tree import components, leaves_with_paths, prefix_lookup


def assert_labels_equal(labels, expected) -> None:
    """Asserts that a labels tree routes every leaf as `expected` says.

    `labels` is what `rowgeom.label_params` (or a custom label function) returns for a model:
    a tree of label strings shaped like the parameters -- a dict, an ``nnx.State`` (also one
    whose leaves are still ``nnx.Variable`` boxes), a Linen ``{"params": ...}`` tree.

    `expected` is a mapping from paths to labels, nested like the parameters or flat with
    ``"/"``-joined keys, where a path also covers every leaf under it (the longest matching
    entry wins). So ``{"layers": "hidden", "lm_head": "head", "layers/0/norm": "vector"}``
    states a whole routing in three lines. Every leaf must be covered and every entry must
    have some leaf under it (a misspelt path is reported, not ignored).

    Args:
      labels: the labels tree under test.
      expected: the intended routing (see above).

    Raises:
      AssertionError: listing each mislabelled leaf as ``path: got 'x', expected 'y'``, the
        leaves no entry covers and the entries that cover no leaf.

    Examples:
      >>> import jax.numpy as jnp, rowgeom, rowgeom.testing
      >>> params = {"embed": {"embedding": jnp.zeros((10, 4))},
      ...           "layers": {"0": {"mlp": {"kernel": jnp.zeros((4, 4))},
      ...                            "norm": {"scale": jnp.ones(4)}}},
      ...           "lm_head": {"kernel": jnp.zeros((4, 10))}}
      >>> labels = rowgeom.label_params(params)
      >>> rowgeom.testing.assert_labels_equal(labels, {
      ...     "embed": "embedding", "layers": "hidden", "layers/0/norm": "vector",
      ...     "lm_head": "head"})
      >>> rowgeom.testing.assert_labels_equal(labels, {
      ...     "embed": "embedding", "layers": "hidden", "lm_head": "hidden"})
      Traceback (most recent call last):
      ...
      AssertionError: labels differ from the expected routing (2 of 4 leaves):
        layers/0/norm/scale: got 'vector', expected 'hidden' (from 'layers')
        lm_head/kernel: got 'head', expected 'hidden' (from 'lm_head')
    """
    actual = leaves_with_paths(labels)
    table = dict(leaves_with_paths(expected))
    if not actual:
        raise AssertionError("the labels tree has no leaves")
    if not table:
        raise ValueError("expected routing is empty")
    wrong, uncovered, used = [], [], set()
    for path, label in actual:
        key, want = prefix_lookup(table, path)
        if key is None:
            uncovered.append(f"  {path}: got {label!r}, no expected label covers it")
            continue
        used.add(key)
        if label != want:
            source = "" if key == path else f" (from {key!r})"
            wrong.append(f"  {path}: got {label!r}, expected {want!r}{source}")
    paths = [components(path) for path, _ in actual]
    unused = [f"  {key}: expected {table[key]!r}, but no leaf has this path"
              for key in table if key not in used
              and not any(p[:len(components(key))] == components(key) for p in paths)]
    if not (wrong or uncovered or unused):
        return
    lines = []
    if wrong:
        lines.append(f"labels differ from the expected routing ({len(wrong)} of {len(actual)} "
                     "leaves):")
        lines += wrong
    if uncovered:
        lines.append(f"{len(uncovered)} leaves not covered by the expected routing:")
        lines += uncovered
    if unused:
        lines.append(f"{len(unused)} expected paths match no leaf:")
        lines += unused
    raise AssertionError("\n".join(lines))
