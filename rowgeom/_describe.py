"""The public views of the plan: `make_plan`, `describe`, the table ``str(Plan)`` prints and
each row's `PlanRow.geometry` text.

None of this runs when `lm_optimizer` builds or steps: it reads the same memoised plan
(`rowgeom._recipe.plan_of`) the chains read, so what it prints is what runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rowgeom._muon import MuonOptions
from rowgeom._recipe import (
    HeadOptions,
    Plan,
    PlanRow,
    RouterOptions,
    group_options,
    plan_of,
    plan_options,
)


def _axes_text(axes) -> str:
    return ",".join(map(str, (axes,) if isinstance(axes, int) else tuple(axes)))


def geometry(row: PlanRow) -> str:
    """`PlanRow.geometry`: a leaf's update rule with its axes, as `describe` prints it."""
    with_batch = f" batch {_axes_text(row.batch_axes)}" if row.batch_axes else ""
    if row.label == "head":
        name = {"rownorm": "RowNorm", "adamw": "AdamW", "muon": "Muon"}[row.optimizer]
        return (f"{name}{'' if row.centred in (None, True) else ' uncentred'}, vocab axis "
                f"{row.vocab_axis}")
    if row.optimizer == "rownorm":
        return f"RowNorm over experts, expert axis {row.vocab_axis}{with_batch}"
    if row.optimizer == "adamw":
        return "AdamW"
    dims = row.muon_dims
    if dims is None:
        return "momentum only (dimension_numbers None)"
    return (f"Muon, in {_axes_text(dims.reduction_axis)} out {_axes_text(dims.output_axis)}"
            + with_batch)


def _cell(x) -> str:
    """A rate or decay as the table shows it: a schedule by name, None as ``-``."""
    if x is None:
        return "-"
    if callable(x):
        return "schedule"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def table(plan: Plan) -> str:
    """`Plan`'s ``str()``: an aligned table of its rows, with the groups' rates and decays."""
    rate = lambda r, field: _cell(getattr(plan.groups.get(r.label), field, None))
    header: tuple[str, ...] = ("path", "shape", "label", "geometry", "lr", "wd")
    cells = [header] + [(r.path, str(r.shape), r.label, r.geometry, rate(r, "learning_rate"),
                         rate(r, "weight_decay")) for r in plan]
    if any(r.note for r in plan):  # the column only where a leaf has something to check
        header += ("note",)
        cells = [header] + [row + (r.note,) for row, r in zip(cells[1:], plan, strict=True)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def make_plan(params: Any, *, head: str | HeadOptions = "rownorm",
              muon: MuonOptions | None = None, router: str | RouterOptions = "muon",
              labels: Any = None, tied: str | None = None) -> Plan:
    """The `Plan` `lm_optimizer` with these options builds its chains from on `params`: a pure
    function of the tree's paths, shapes and dtypes and the options, memoised on them.

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
      >>> params = {"embed": {"embedding": S(100, 16)}, "lm_head": {"kernel": S(16, 100)}}
      >>> rowgeom.make_plan(params).by_label("head")["lm_head/kernel"].vocab_axis
      1
      >>> rowgeom.make_plan(params) is rowgeom.make_plan(params)     # memoised
      True
    """
    return plan_of(params, plan_options(head=head, muon=muon, router=router, labels=labels,
                                        tied=tied))


def describe(params: Any, learning_rate: Any = None, *, head: str | HeadOptions = "rownorm",
             muon: MuonOptions | None = None, adam: Any = None,
             router: str | RouterOptions = "muon",
             labels: Any = None, tied: str | None = None, weight_decay: Any = 0.1,
             groups: Mapping[str, Any] | None = None) -> Plan:
    """What `lm_optimizer` with the same arguments does to each leaf of `params`.

    The same `make_plan` result `lm_optimizer`'s chains read at ``init`` and ``update``
    (labels with their shape cross-checks, Muon's matrix axes, the head's vocabulary
    axis), with every group's `GroupOptions` (`group_options`), so what is printed is what
    will run. Errors are those `lm_optimizer` would raise, naming the leaf.

    Args:
      params: the parameter tree (arrays, ``jax.ShapeDtypeStruct`` or Flax boxes).
      learning_rate: `lm_optimizer`'s base rate; None leaves the rate columns empty.
      head: as in `lm_optimizer`.
      muon: as in `lm_optimizer`.
      adam: as in `lm_optimizer`.
      router: as in `lm_optimizer`.
      labels: as in `lm_optimizer`.
      tied: as in `lm_optimizer`.
      weight_decay: as in `lm_optimizer`.
      groups: as in `lm_optimizer`.

    Returns:
      A `Plan`: a tuple of `PlanRow` whose ``str()`` is an aligned table.

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
    options = plan_options(head=head, muon=muon, router=router, labels=labels, tied=tied)
    plan = plan_of(params, options)  # the same rows, printed with the groups' rates and decays
    return Plan(plan, plan.structure, group_options(
        learning_rate, head=options.head, muon=options.muon, adam=adam, router=options.router,
        weight_decay=weight_decay, groups=groups))
