"""`describe`: one row per parameter with the geometry, rate and decay `lm_optimizer` gives it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from rowgeom._recipe import LeafPlan, lm_optimizer, lm_optimizer_hparams, plan_leaves
from rowgeom._tree import path_str

_PLAN_OPTIONS = ("labels", "tied", "head", "head_vocab_axis", "muon_dimension_numbers")
_HPARAM_OPTIONS = tuple(p for p in inspect.signature(lm_optimizer_hparams).parameters
                        if p != "learning_rate")
_ALL_OPTIONS = tuple(p for p in inspect.signature(lm_optimizer).parameters
                     if p != "learning_rate")


class ParamRow(NamedTuple):
    """One parameter as `lm_optimizer` will train it (a row of `describe`).

    ``path``: ``"/"``-joined key path; ``label``: its group; ``geometry``: the update rule with
    its axes (Muon's fan-in/fan-out axes, the head's vocabulary axis); ``learning_rate`` and
    ``weight_decay``: the group's resolved values (None without a learning rate); a schedule
    is kept as the callable.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> row = rowgeom.describe({"embed": {"embedding": jnp.zeros((8, 4))},
      ...                         "lm_head": {"kernel": jnp.zeros((4, 8))}}, 1e-3)[1]
      >>> row.path, row.label, row.geometry, row.learning_rate
      ('lm_head/kernel', 'head', 'RowNorm, vocab axis 1', 0.005)
    """

    path: str
    shape: tuple[int, ...]
    label: str
    geometry: str
    learning_rate: Any
    weight_decay: Any


class Description(tuple):
    """The rows of `describe` (a tuple of `ParamRow`); ``str()`` is an aligned table.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> rows = rowgeom.describe({"wte": {"embedding": jnp.zeros((8, 4))}}, tied="embedding")
      >>> print(rows)
      path           shape   label      geometry  lr  wd
      -------------  ------  ---------  --------  --  --
      wte/embedding  (8, 4)  embedding  AdamW     -   -
    """

    def __str__(self) -> str:
        def fmt(x):
            if x is None:
                return "-"
            if callable(x):
                return "schedule"
            return f"{x:.4g}" if isinstance(x, float) else str(x)

        header = ("path", "shape", "label", "geometry", "lr", "wd")
        cells = [header] + [(r.path, str(r.shape), r.label, r.geometry, fmt(r.learning_rate),
                             fmt(r.weight_decay)) for r in self]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _axes(axes) -> str:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return ",".join(map(str, axes))


def _geometry(plan: LeafPlan, head: str, tied: str | None) -> str:
    if plan.label == "hidden":
        if plan.muon_dims is None:
            return "Muon, given dimension_numbers"
        dims = plan.muon_dims
        used = set((dims.reduction_axis,) if isinstance(dims.reduction_axis, int)
                   else dims.reduction_axis)
        used |= set((dims.output_axis,) if isinstance(dims.output_axis, int)
                    else dims.output_axis)
        batch = [a for a in range(len(plan.shape)) if a not in used]
        text = f"Muon, in {_axes(dims.reduction_axis)} out {_axes(dims.output_axis)}"
        return text + (f" batch {_axes(batch)}" if batch else "")
    if plan.label == "head":
        name = {"rownorm": "RowNorm", "adamw": "AdamW", "muon": "Muon"}[head]
        if head == "rownorm" and tied == "head":
            name = "RowNorm uncentred"
        return f"{name}, vocab axis {plan.vocab_axis}"
    if plan.label in ("embedding", "vector"):
        return "AdamW"
    return "custom label"


def describe(params: Any, learning_rate: float | Callable[[Any], Any] | None = None,
             **options: Any) -> Description:
    """What `lm_optimizer(learning_rate, **options)` does to each leaf of `params`.

    The same analysis `lm_optimizer` runs at ``init`` (labels with their shape cross-checks,
    Muon's matrix axes, the head's vocabulary axis) and the same resolved hyperparameters
    (`lm_optimizer_hparams`), so what is printed is what will run. Errors are those
    `lm_optimizer` would raise, naming the leaf.

    Args:
      params: the parameter tree (arrays, ``jax.ShapeDtypeStruct`` or Flax boxes).
      learning_rate: `lm_optimizer`'s base rate; None leaves the rate columns empty.
      **options: any `lm_optimizer` keyword (``head``, ``labels``, ``tied``, rates, decays,
        ``head_vocab_axis``, ``muon_dimension_numbers``, ...).

    Returns:
      A `Description`: a tuple of `ParamRow` (path, shape, label, geometry, learning rate,
      weight decay) whose ``str()`` is an aligned table.

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
      >>> params = {"embed": {"embedding": S(100, 16)},
      ...           "layers": {"attn": {"query": {"kernel": S(16, 2, 4, 4)}},  # (d, L, H, Dh)
      ...                      "norm": {"scale": S(16, 2)}},
      ...           "lm_head": {"kernel": S(16, 100)}}
      >>> print(rowgeom.describe(params, 1e-3))
      path                      shape          label      geometry                    lr     wd
      ------------------------  -------------  ---------  --------------------------  -----  ---
      embed/embedding           (100, 16)      embedding  AdamW                       0.001  0.1
      layers/attn/query/kernel  (16, 2, 4, 4)  hidden     Muon, in 0 out 2,3 batch 1  0.001  0.1
      layers/norm/scale         (16, 2)        vector     AdamW                       0.001  0
      lm_head/kernel            (16, 100)      head       RowNorm, vocab axis 1       0.005  0.1
    """
    unknown = sorted(set(options) - set(_ALL_OPTIONS))
    if unknown:
        raise TypeError(f"describe: unknown lm_optimizer option(s) {unknown}")
    head = options.get("head", "rownorm")
    tied = options.get("tied")
    plans = plan_leaves(params, **{k: options[k] for k in _PLAN_OPTIONS if k in options})
    hp = None
    if learning_rate is not None:
        hp = lm_optimizer_hparams(learning_rate,
                                  **{k: options[k] for k in _HPARAM_OPTIONS if k in options})
    rows = []
    for plan in plans:
        group = hp.get(plan.label) if hp is not None else None
        rows.append(ParamRow(path_str(plan.path), tuple(plan.shape), str(plan.label),
                             _geometry(plan, head, tied),
                             None if group is None else group.learning_rate,
                             None if group is None else group.weight_decay))
    return Description(rows)
