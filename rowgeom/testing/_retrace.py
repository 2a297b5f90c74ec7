"""Asserting that an optimizer's jitted step is traced (and compiled) once, not every step."""

from __future__ import annotations

import itertools

import chex
import jax
import optax

from rowgeom.testing._tree import ROOT, leaves_with_paths

_ids = itertools.count()


def _signature(tree) -> tuple[object, dict[str, str]]:
    """(tree structure, {path: abstract value}) of what ``jax.jit`` keys its cache on."""
    def describe(x):
        aval = jax.typeof(x)
        text = f"{aval.dtype}{list(aval.shape)}"
        if getattr(aval, "weak_type", False):
            text += " (weak type)"
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(getattr(sharding, "device_set", ())) > 1:
            text += f" sharding={sharding}"
        return text

    structure = jax.tree.structure(tree)
    return structure, {path: describe(leaf) for path, leaf in leaves_with_paths(tree)}


def _diff(before, after) -> list[str]:
    (structure0, avals0), (structure1, avals1) = before, after
    lines = []
    for path in sorted(set(avals0) | set(avals1)):
        old, new = avals0.get(path, "absent"), avals1.get(path, "absent")
        if old != new:
            lines.append(f"  {path}: {old} -> {new}")
    if not lines and structure0 != structure1:
        lines.append(f"  tree structure changed:\n    {structure0}\n    -> {structure1}")
    return lines


def assert_optimizer_does_not_retrace(tx: optax.GradientTransformation, params, grads, *,
                                      steps: int = 3) -> None:
    """Asserts that ``tx``'s jitted update step is traced once over `steps` steps.

    Runs ``updates, state = tx.update(grads, state, params); params = apply_updates(...)``
    under one ``jax.jit``, wrapped in ``chex.assert_max_traces(n=1)``, feeding each step's
    state and parameters into the next. A retrace (and recompile) happens when the step's
    output does not have the abstract type of its input -- a state leaf that changes dtype
    (a bfloat16 moment updated in float32), weak type (a Python-number counter) or structure
    -- and silently costs a compile per step, or per step until the types settle.

    Args:
      tx: the optimizer (any ``optax.GradientTransformation``, e.g. `rowgeom.lm_optimizer`).
      params: the parameters (a dict, an ``nnx.State`` such as ``nnx.state(model, nnx.Param)``,
        a Linen tree).
      grads: the gradients: a tree like `params` used at every step, or a callable
        ``step -> grads`` (step counts from 0).
      steps: number of steps to run (>= 2).

    Raises:
      AssertionError: naming the step that retraced and each input leaf (``opt_state/...``,
        ``params/...``, ``grads/...``) whose abstract value changed since the first step.

    Examples:
      >>> import jax.numpy as jnp, optax, rowgeom, rowgeom.testing
      >>> params = {"lm_head": {"kernel": jnp.ones((4, 10))}}
      >>> grads = {"lm_head": {"kernel": jnp.arange(40.0).reshape(4, 10)}}
      >>> tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=1), optax.sgd(0.1))
      >>> rowgeom.testing.assert_optimizer_does_not_retrace(tx, params, grads)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an int >= 2 (one step cannot retrace), got {steps!r}")
    grads_at = grads if callable(grads) else (lambda step: grads)

    def optimizer_step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # chex counts traces per function footprint (source, name, call stack): a fresh name per
    # call keeps two calls of this assertion (or two tests) from sharing one counter.
    optimizer_step.__name__ = f"optimizer_step_{next(_ids)}"
    step_fn = jax.jit(chex.assert_max_traces(optimizer_step, n=1))

    opt_state = tx.init(params)
    first = None
    for step in range(steps):
        inputs = {"grads": grads_at(step), "opt_state": opt_state, "params": params}
        signature = _signature(inputs)
        first = signature if first is None else first
        try:
            params, opt_state = step_fn(inputs["grads"], opt_state, params)
        except AssertionError as err:
            if "is traced >" not in str(err):
                raise
            changed = _diff(first, signature) or [
                "  (no input changed its abstract value: the step itself is re-jitted)"]
            changed = [line.replace(f"{ROOT}/", "") for line in changed]
            raise AssertionError(
                f"optimizer step {step} retraced (chex.assert_max_traces(n=1) tripped): these "
                f"inputs changed their abstract value since step 0:\n" + "\n".join(changed)
            ) from None
