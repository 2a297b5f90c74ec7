"""Asserting that parameters are routed to the intended geometry, with a readable diff."""

from __future__ import annotations

from rowgeom.testing._tree import leaves_with_paths, per_path


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
    expected_table = dict(leaves_with_paths(expected))
    if not actual:
        raise AssertionError("the labels tree has no leaves")
    if not expected_table:
        raise ValueError("expected routing is empty")
    paths = [path for path, _ in actual]
    unused = [f"  {key}: expected {want!r}, but no leaf has this path"
              for key, want in expected_table.items() if not _covers(key, paths)]
    # Each leaf's covering entry (the longest prefix), by rowgeom's one per-leaf resolver.
    keys = {key: key for key in expected_table if _covers(key, paths)}
    covering = per_path(keys, paths, argname="expected") if keys else [(False, None)] * len(paths)
    wrong, uncovered = [], []
    for (path, label), (found, key) in zip(actual, covering, strict=True):
        key = str(key)
        if not found:
            uncovered.append(f"  {path}: got {label!r}, no expected label covers it")
        elif label != expected_table[key]:
            source = "" if key == path else f" (from {key!r})"
            wrong.append(f"  {path}: got {label!r}, expected {expected_table[key]!r}{source}")
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



def _covers(key: str, paths: list[str]) -> bool:
    parts = tuple(key.split("/"))
    return any(tuple(path.split("/"))[:len(parts)] == parts for path in paths)
