"""Shared argument checks: every public function reports bad input the same way.

Errors name the argument and say what was expected, so a user never gets a silent
NaN or a silently wrong axis.

    >>> from rowgeom._validation import canonical_axis, check_int
    >>> canonical_axis(-1, 2), check_int(3, argname="every_k_steps", minimum=1)
    (1, 3)
    >>> check_int(0, argname="every_k_steps", minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: every_k_steps must be >= 1, got 0
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike


def check_int(value: Any, *, argname: str, minimum: int) -> int:
    """Returns `value` as an int ``>= minimum`` (a bool is no int here), or raises naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{argname} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{argname} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{argname} must be >= {minimum}, got {value}")
    return value


def canonical_axis(axis: Any, ndim: int, *, argname: str = "vocab_axis") -> int:
    """Returns `axis` as a non-negative int, or raises naming `argname`."""
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{argname} must be an int, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(
                f"{argname}={axis} is out of range for an array of rank {ndim} "
                f"(expected {-ndim} <= {argname} < {ndim})")
    return axis % ndim


def check_floating(x: ArrayLike, *, argname: str) -> None:
    """Raises TypeError unless `x` has a real floating dtype."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
                f"{argname} must have a real floating dtype (float32, bfloat16, ...), got {dtype}")


def check_min_rank(x: ArrayLike, min_rank: int, *, argname: str, what: str = "") -> None:
    """Raises ValueError if `x` has fewer than `min_rank` dimensions."""
    ndim = jnp.ndim(x)
    if ndim < min_rank:
        extra = f" ({what})" if what else ""
        raise ValueError(
                f"{argname} must have rank >= {min_rank}{extra}, got shape {jnp.shape(x)}")


def check_matrix_like(x: ArrayLike, *, argname: str, vocab_axis: Any,
                      argname_axis: str = "vocab_axis") -> int:
    """Validates a head-like array (rank >= 2, float) and returns its vocab axis."""
    check_min_rank(x, 2, argname=argname, what="token rows along vocab_axis, features elsewhere")
    check_floating(x, argname=argname)
    return canonical_axis(vocab_axis, jnp.ndim(x), argname=argname_axis)


def static_args_hint(*names: str) -> str:
    """The advice for an option that arrived as a traced array (injected under jit): list the
    transform's non-float options under `optax.inject_hyperparams`."""
    return f"under optax.inject_hyperparams list it in static_args, e.g. static_args={names!r}"


# --- options objects: each field checked on creation, its error naming ``Owner.field`` ---------


def one_of(value, allowed, argname: str):
    """`value` if it is in `allowed`; a ValueError naming `argname` otherwise."""
    if value not in allowed:
        raise ValueError(f"{argname} must be one of {allowed}, got {value!r}")
    return value


def not_array(value, argname: str):
    """`value` unless it is a jax array (options objects are static Python values)."""
    import jax

    if isinstance(value, jax.Array):
        raise TypeError(f"{argname} must be a Python value, not a jax array: options objects are "
                        "static (only lm_optimizer's float rates are injectable)")
    return value


def check_real(value, argname: str, *, low: float, high: float = math.inf,
               low_open: bool = False, high_open: bool = False) -> None:
    """Raises unless `value` is a real number in the interval (bounds open where said)."""
    not_array(value, argname)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{argname} must be a finite real number, got {value!r}")
    value = float(value)
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{argname} must be in {bounds}, got {value!r}")


def check_momentum(value, argname: str) -> None:
    """None or a decay in [0, 1)."""
    if value is not None:
        check_real(value, argname, low=0.0, high=1.0, high_open=True)


def check_bool(value, argname: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{argname} must be a bool, got {value!r}")


def prefixed(owner: str, check, *args, **kwargs):
    """Runs a transform's own argument check, its error naming the options field."""
    try:
        return check(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}.{err}") from None
