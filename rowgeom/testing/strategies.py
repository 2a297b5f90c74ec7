"""Hypothesis strategies for head-geometry property tests (needs ``rowgeom[testing]``).

Properties of a head optimizer (``D(step) <= 2 lr``, ``1^T step = 0``, no NaN, the padded rows
untouched) should be tested on what a head actually sees and on what breaks naive code:

- `lm_head_gradients`: softmax cross-entropy gradients of a linear head, with Zipf-distributed
  targets (a few frequent tokens, a long tail of rare ones) and random hidden states that share
  a common mean direction, as final hidden states of trained LMs do.
- `token_row_patterns`: adversarial token rows (`PATTERNS`): outliers, two scales, near-identical
  rows, a large common offset, sign-like rows, mostly-zero rows.
- `zipf_token_batches`: integer token batches with Zipf frequencies, to drive a whole model.

Each head strategy draws both layouts -- ``(V, d)`` with ``vocab_axis=0`` (an embedding table,
a PyTorch-layout head) and Flax's ``(d, V)`` kernel with ``vocab_axis=1`` -- float32 and
bfloat16, and padded vocabularies (``num_valid < V``), and yields a `HeadExample` carrying
everything a property needs. Values are generated with numpy from a drawn seed, so examples are
reproducible and cheap; shapes come from small fixed menus because every new shape is a new
XLA compile. Pass your own menus (a sequence, or any hypothesis strategy) to widen them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

try:
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "rowgeom.testing.strategies needs hypothesis: pip install 'rowgeom[testing]' "
        "(the assertions in rowgeom.testing work without it)") from err

import jax
import jax.numpy as jnp
import numpy as np

__all__ = (
    "PATTERNS",
    "HeadExample",
    "lm_head_gradients",
    "token_row_patterns",
    "zipf_token_batches",
)

PATTERNS = ("outliers", "two_scales", "near_identical", "large_offset", "sign_like",
            "sparse_rows")
"""Names of the adversarial token-row patterns drawn by `token_row_patterns`.

- ``"outliers"``: Gaussian rows, a few of them 10^2-10^6 times longer (a frequent token).
- ``"two_scales"``: half the rows 10^3-10^6 times shorter than the others.
- ``"near_identical"``: one vector plus a relative spread of 10^-7-10^-3, some rows exactly equal.
- ``"large_offset"``: a common vector 10^2-10^6 times the rows' spread (the softmax's gauge).
- ``"sign_like"``: entries in ``{-c, +c}`` (a signSGD-like update; many rows coincide).
- ``"sparse_rows"``: all but a few rows exactly zero (tokens absent from the batch).

Examples:
    >>> from rowgeom.testing import strategies
    >>> "outliers" in strategies.PATTERNS
    True
"""


class HeadExample(NamedTuple):
    """One drawn head input.

    Attributes:
      update: the token-row array, ``(V, d)`` if ``vocab_axis == 0`` else ``(d, V)``, in the
        drawn dtype (float32 or bfloat16).
      vocab_axis: 0 or 1: where the token rows are.
      num_valid: None, or the number of real tokens of a padded vocabulary (rows at index
        ``>= num_valid`` are padding, never a target).
      hidden: ``(n, d)`` float32 hidden states (for `lm_head_gradients`, the ones the gradient
        was computed at).
      kind: ``"cross_entropy"`` or the name of the pattern in `PATTERNS`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from rowgeom.testing.strategies import HeadExample
      >>> ex = HeadExample(jnp.zeros((4, 3)), 0, None, jnp.ones((2, 4)), "sparse_rows")
      >>> ex.vocab_axis, ex.update.shape
      (0, (4, 3))
    """

    update: jax.Array
    vocab_axis: int
    num_valid: int | None
    hidden: jax.Array
    kind: str


def _menu(values, argname: str):
    """A strategy from a strategy, one value, or a non-empty sequence of values."""
    if isinstance(values, st.SearchStrategy):
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        return st.just(values)
    if not values:
        raise ValueError(f"{argname} must not be empty")
    return st.sampled_from(tuple(values))


def _dtypes(dtypes):
    if isinstance(dtypes, st.SearchStrategy):
        return dtypes.map(jnp.dtype)
    dtypes = [dtypes] if isinstance(dtypes, str) or not isinstance(dtypes, Sequence) else dtypes
    out = tuple(jnp.dtype(d) for d in dtypes)
    bad = [d for d in out if not jnp.issubdtype(d, jnp.floating)]
    if bad:
        raise ValueError(f"dtypes must be floating, got {bad}")
    return _menu(out, "dtypes")


@st.composite
def _layout(draw, vocab_sizes, feature_sizes, vocab_axes, dtypes, batch_sizes, padded):
    vocab = draw(_menu(vocab_sizes, "vocab_sizes"))
    features = draw(_menu(feature_sizes, "feature_sizes"))
    if vocab < 2 or features < 1:
        raise ValueError(f"need vocab_size >= 2 and feature_size >= 1, got {vocab}, {features}")
    axis = draw(_menu(vocab_axes, "vocab_axes"))
    if axis not in (0, 1):
        raise ValueError(f"vocab_axes must be 0 ((V, d)) or 1 ((d, V)), got {axis!r}")
    dtype = draw(_dtypes(dtypes))
    batch = draw(_menu(batch_sizes, "batch_sizes"))
    num_valid = None
    if isinstance(padded, bool):
        if padded and draw(st.booleans()):
            num_valid = draw(st.integers(max(1, vocab // 2), vocab - 1))
    else:
        pad = draw(_menu(padded, "padded"))
        if not isinstance(pad, int) or not 0 <= pad < vocab:
            raise ValueError(f"padded sizes must be ints in [0, V), got {pad!r} for V={vocab}")
        num_valid = vocab - pad if pad else None
    seed = draw(st.integers(0, 2**32 - 1))
    return vocab, features, axis, dtype, batch, num_valid, np.random.default_rng(seed)


def _example(rows64, axis, dtype, num_valid, hidden64, kind) -> HeadExample:
    rows = np.asarray(rows64, np.float32)
    update = jnp.asarray(rows if axis == 0 else np.ascontiguousarray(rows.T)).astype(dtype)
    return HeadExample(update, axis, num_valid, jnp.asarray(hidden64, jnp.float32), kind)


def _zipf(rng, vocab: int, exponent: float) -> np.ndarray:
    """Token probabilities ``~ 1 / rank^exponent`` over a random assignment of ranks."""
    weights = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    return rng.permutation(weights / weights.sum())


def lm_head_gradients(*, vocab_sizes=(5, 64), feature_sizes=(3, 16), vocab_axes=(0, 1),
                      dtypes=("float32", "bfloat16"), batch_sizes=(1, 8, 32),
                      padded=True):
    """Softmax cross-entropy gradients of a linear LM head, as `HeadExample` s.

    For hidden states ``h_n`` (Gaussian plus a shared mean direction of drawn length), targets
    ``y_n`` drawn from a Zipf distribution (exponent 0.6-1.6) over the real tokens, and a
    random head ``W`` (scale 0.02-2), the gradient of the mean loss is
    ``G = sum_n (softmax(W h_n) - e_{y_n}) h_n^T / N``: the row of a token is its expected
    minus observed count, weighted by the hidden states. Computed in float64, then cast. Over all
    ``V`` rows ``G`` sums to zero; padded tokens (``>= num_valid``) are never targets but keep
    their softmax share, as in an unmasked padded vocabulary.

    Args:
      vocab_sizes: vocabulary sizes ``V >= 2`` (a sequence, one int or a strategy).
      feature_sizes: hidden sizes ``d``.
      vocab_axes: layouts to draw: 0 for ``(V, d)``, 1 for ``(d, V)``.
      dtypes: dtypes of ``update`` (names or dtypes).
      batch_sizes: numbers ``N`` of hidden states / targets.
      padded: ``True``: half the examples padded, ``num_valid`` drawn from ``[V // 2, V - 1]``;
        ``False``: never; or a menu of padding sizes (``num_valid = V - pad``, 0: unpadded),
        since every distinct ``num_valid`` is a new compile of a transform taking it statically.

    Returns:
      A strategy of `HeadExample` with ``kind == "cross_entropy"``.

    Examples:
      >>> import numpy as np
      >>> from hypothesis import given, settings
      >>> from rowgeom.testing import strategies
      >>> @settings(max_examples=5, deadline=None, database=None)
      ... @given(strategies.lm_head_gradients(dtypes=["float32"], padded=False))
      ... def test_cross_entropy_gradient_rows_sum_to_zero(ex):
      ...     rows = np.moveaxis(np.asarray(ex.update, np.float64), ex.vocab_axis, 0)
      ...     assert np.abs(rows.sum(0)).max() <= 1e-5 * np.abs(rows).sum(0).max() + 1e-12
      >>> test_cross_entropy_gradient_rows_sum_to_zero()
    """
    layout = _layout(vocab_sizes, feature_sizes, vocab_axes, dtypes, batch_sizes, padded)

    @st.composite
    def draw_gradient(draw):
        vocab, d, axis, dtype, n, num_valid, rng = draw(layout)
        valid = vocab if num_valid is None else num_valid
        freq = _zipf(rng, valid, rng.uniform(0.6, 1.6))
        targets = rng.choice(valid, size=n, p=freq)
        mean = rng.standard_normal(d) * rng.uniform(0.0, 3.0) / np.sqrt(d)
        hidden = rng.standard_normal((n, d)) + mean
        weights = rng.standard_normal((vocab, d)) * 10.0 ** rng.uniform(-1.7, 0.3) / np.sqrt(d)
        logits = hidden @ weights.T
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        probs[np.arange(n), targets] -= 1.0
        return _example(probs.T @ hidden / n, axis, dtype, num_valid, hidden, "cross_entropy")

    return draw_gradient()


def _pattern_rows(rng, pattern: str, vocab: int, d: int) -> np.ndarray:
    rows = rng.standard_normal((vocab, d))
    if pattern == "outliers":
        k = rng.integers(1, max(2, vocab // 8) + 1)
        which = rng.choice(vocab, size=min(k, vocab), replace=False)
        rows[which] *= 10.0 ** rng.uniform(2, 6, size=(len(which), 1))
    elif pattern == "two_scales":
        small = rng.permutation(vocab) < vocab // 2
        rows[small] *= 10.0 ** -rng.uniform(3, 6)
    elif pattern == "near_identical":
        rows = rng.standard_normal(d) + rows * 10.0 ** -rng.uniform(3, 7)
        rows[rng.random(vocab) < 0.3] = rows[0]
    elif pattern == "large_offset":
        rows = rows + rng.standard_normal(d) * 10.0 ** rng.uniform(2, 6)
    elif pattern == "sign_like":
        rows = np.sign(rows) * 10.0 ** rng.uniform(-4, 1)
    elif pattern == "sparse_rows":
        keep = rng.permutation(vocab) < rng.integers(1, max(2, vocab // 4) + 1)
        rows[~keep] = 0.0
    else:
        raise ValueError(f"unknown pattern {pattern!r}; expected one of {PATTERNS}")
    return rows * 10.0 ** rng.uniform(-3, 3)  # and an overall scale


def token_row_patterns(*, patterns=PATTERNS, vocab_sizes=(5, 64), feature_sizes=(3, 16),
                       vocab_axes=(0, 1), dtypes=("float32", "bfloat16"), batch_sizes=(8,),
                       padded=True):
    """Adversarial token-row arrays (`PATTERNS`), as `HeadExample` s.

    Each example is one pattern at an overall scale of 10^-3-10^3; the rows are drawn in
    float64 and then cast, so in bfloat16 a large offset can swallow the spread (rows become
    equal): exactly the inputs where a step must stay finite and inside its budget. ``hidden``
    holds standard normal hidden states. Padded rows (``>= num_valid``) hold pattern values too:
    a transform given ``num_valid`` must ignore them.

    Args:
      patterns: names from `PATTERNS` (a sequence, one name or a strategy).
      vocab_sizes: vocabulary sizes ``V >= 2``.
      feature_sizes: hidden sizes ``d``.
      vocab_axes: layouts to draw: 0 for ``(V, d)``, 1 for ``(d, V)``.
      dtypes: dtypes of ``update``.
      batch_sizes: numbers of hidden states in ``hidden``.
      padded: ``True``: half the examples padded, ``num_valid`` drawn from ``[V // 2, V - 1]``;
        ``False``: never; or a menu of padding sizes (``num_valid = V - pad``, 0: unpadded),
        since every distinct ``num_valid`` is a new compile of a transform taking it statically.

    Returns:
      A strategy of `HeadExample` whose ``kind`` is the pattern's name.

    Examples:
      >>> from hypothesis import find
      >>> from rowgeom.testing import strategies
      >>> ex = find(strategies.token_row_patterns(patterns=["sign_like"], vocab_axes=[1]),
      ...           lambda ex: ex.update.shape[1] == 64)
      >>> ex.kind, ex.vocab_axis, ex.update.shape[1]
      ('sign_like', 1, 64)
    """
    layout = _layout(vocab_sizes, feature_sizes, vocab_axes, dtypes, batch_sizes, padded)
    menu = _menu(patterns, "patterns")

    @st.composite
    def draw_pattern(draw):
        pattern = draw(menu)
        if pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {pattern!r}; expected one of {PATTERNS}")
        vocab, d, axis, dtype, n, num_valid, rng = draw(layout)
        rows = _pattern_rows(rng, pattern, vocab, d)
        return _example(rows, axis, dtype, num_valid, rng.standard_normal((n, d)), pattern)

    return draw_pattern()


def zipf_token_batches(*, vocab_size: int, shape: tuple[int, ...], exponents=(0.8, 1.4)):
    """int32 token arrays of `shape` with Zipf-distributed token ids in ``[0, vocab_size)``.

    A random assignment of ranks to tokens, probability ``~ 1 / rank^s`` for an exponent ``s``
    drawn uniformly from ``exponents = (low, high)``: a few tokens dominate, most are rare or
    absent, so most head-gradient rows are small -- as in real batches.

    Args:
      vocab_size: number of tokens (>= 1).
      shape: shape of each batch, e.g. ``(batch, seq_len + 1)``.
      exponents: ``(low, high)`` range of the Zipf exponent.

    Returns:
      A strategy of int32 ``jax.Array`` s.

    Examples:
      >>> from hypothesis import find
      >>> from rowgeom.testing import strategies
      >>> batch = find(strategies.zipf_token_batches(vocab_size=50, shape=(2, 9)),
      ...              lambda tokens: True)
      >>> batch.shape, str(batch.dtype), bool((batch >= 0).all() & (batch < 50).all())
      ((2, 9), 'int32', True)
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    low, high = (float(e) for e in exponents)
    if not 0 < low <= high:
        raise ValueError(f"exponents must be (low, high) with 0 < low <= high, got {exponents}")
    shape = tuple(int(s) for s in shape)

    def make(args):
        seed, exponent = args
        rng = np.random.default_rng(seed)
        tokens = rng.choice(vocab_size, size=shape, p=_zipf(rng, vocab_size, exponent))
        return jnp.asarray(tokens, jnp.int32)

    return st.tuples(st.integers(0, 2**32 - 1), st.floats(low, high)).map(make)
