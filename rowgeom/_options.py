"""`lm_optimizer`'s options as frozen objects: each field of each transform it builds, one home.

Contract: `HeadOptions` (the head's optimizer, momentum, vocabulary axis, RowNorm's eps, padding,
rescaling, formulation and tracker), `MuonOptions` (in `rowgeom._muon`, beside the transform
whose defaults it owns), `RouterOptions` (the router group's optimizer), `AdamOptions` (every
AdamW group) and `GroupOptions` (one group's rate, decay and momentum). Each checks its fields
on creation, naming the field. A field that only one optimizer reads (a RowNorm head's ``eps``,
an AdamW head has no ``momentum``) is None by default and an error when given to another.
`group_options` resolves every group's `GroupOptions`: the one home of the derived defaults.

Why the defaults follow from one learning rate (RMS-matched Muon, the head rate as a radius, the
head study's multipliers): docs/guides/learning-rates.md.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from rowgeom._cpu import IMPLS
from rowgeom._muon import MuonOptions
from rowgeom._names import HEAD_OPTIMIZERS, LABELS, ROUTER_OPTIMIZERS
from rowgeom._rownorm import _RESCALE_MODES, _check_eps
from rowgeom._validation import (
    check_bool,
    check_int,
    check_momentum,
    check_real,
    one_of,
    prefixed,
)

Rate = Any  # a float, a traced scalar (optax.inject_hyperparams) or a schedule count -> rate

HEAD_LR_MULTIPLIERS = types.MappingProxyType({"rownorm": 5.0, "adamw": 3.0, "muon": 3.0})
"""Default head learning rate per head optimizer, as a multiple of the base rate.

From the head study's sweep (docs/results/head_study.md): at base rate 0.006 the lowest final
validation loss was at head rate 0.03 for projected RowNorm and 0.018 for AdamW and Muon heads.

Examples:
    >>> import rowgeom
    >>> dict(rowgeom.HEAD_LR_MULTIPLIERS)   # read-only
    {'rownorm': 5.0, 'adamw': 3.0, 'muon': 3.0}
"""

EMA_MOMENTUM = 0.95
"""The EMA momentum of a RowNorm head or router and the trace momentum of a Muon head when
their options leave it None."""


def _only_for(owner: str, optimizer: str, needs: str, **fields) -> None:
    """Raises when a field that only the `needs` optimizer reads is given to another."""
    given = [name for name, value in fields.items() if value is not None]
    if given and optimizer != needs:
        raise ValueError(f"{owner}.{given[0]} applies to optimizer={needs!r} only, got "
                         f"optimizer={optimizer!r} with {given[0]}={fields[given[0]]!r}")


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """How `lm_optimizer` trains the LM head.

    Attributes:
      optimizer: ``"rownorm"`` (projected RowNorm, arXiv 2608.22253), ``"adamw"`` or ``"muon"``.
      momentum: EMA momentum of a RowNorm head (no Nesterov, float32, before the normalisation)
        and the trace momentum of a Muon head; None: 0.95. An AdamW head uses `AdamOptions.b1`
        (giving it here is an error).
      vocab_axis: the vocabulary axis of every head leaf; None: the one axis of size ``V``, else
        by name (``kernel`` -> 1, ``embedding``/``weight`` -> 0).
      eps: RowNorm only: rows shorter than it are divided by it (`rownorm_direction`); None:
        `rownorm_direction`'s default (``1e-8``).
      bias_correction: RowNorm only: divide the EMA ``B_t = m·B_{t-1} + (1 - m)·G_t`` by
        ``1 - m^t`` before the normalisation (``optax.ema(debias=True)``), as the paper's recipe
        does. It changes only how the rows compare with ``eps`` in the first updates.
      rescale: RowNorm only: None, ``"exact"`` (multiply the direction by ``2/D(S*)``, the whole
        diameter budget, ``O(V²d)`` per step) or ``"bound"`` (divide by the ``O(Vd)`` upper
        bound instead).
      num_valid: the number of real tokens of a padded vocabulary: token rows ``>= num_valid``
        are left out of RowNorm's means and get no RowNorm step (their weight decay still
        applies: ``-lr·wd·W_pad``, zero while those rows are zero). The other heads need no
        mask: a padding row's gradient is zero, and so is its AdamW or Muon step.
      track: record `rowgeom.RowDiameterStats` of the full head step (`read_row_diameter`).
      track_every_k_steps: measure them on the first step and every k-th (1: every step).
      impl: the formulation of RowNorm and of the tracker's bracket (`rownorm_direction`'s
        ``impl``): ``"auto"`` (decided per head leaf when traced: the XLA:CPU formulation for
        an array on one CPU device, the masked one elsewhere), ``"xla"`` or ``"cpu"``.

    Examples:
      >>> import rowgeom
      >>> rowgeom.HeadOptions(optimizer="adamw").optimizer
      'adamw'
      >>> rowgeom.HeadOptions(track_every_k_steps=0)
      Traceback (most recent call last):
      ...
      ValueError: HeadOptions.track_every_k_steps must be >= 1, got 0
    """

    optimizer: str = "rownorm"
    momentum: float | None = None
    vocab_axis: int | None = None
    eps: float | None = None
    bias_correction: bool = False
    rescale: str | None = None
    num_valid: int | None = None
    track: bool = True
    track_every_k_steps: int = 10
    impl: str = "auto"

    def __post_init__(self):
        one_of(self.optimizer, HEAD_OPTIMIZERS, "HeadOptions.optimizer")
        one_of(self.rescale, _RESCALE_MODES, "HeadOptions.rescale")
        one_of(self.impl, IMPLS, "HeadOptions.impl")
        _only_for("HeadOptions", self.optimizer, "rownorm", rescale=self.rescale, eps=self.eps,
                  bias_correction=self.bias_correction or None)
        check_bool(self.bias_correction, "HeadOptions.bias_correction")
        if self.optimizer == "adamw" and self.momentum is not None:
            raise ValueError("HeadOptions.momentum: an AdamW head's momentum is AdamOptions.b1, "
                             f"got momentum={self.momentum!r}")
        check_momentum(self.momentum, "HeadOptions.momentum")
        if self.eps is not None:
            prefixed("HeadOptions", _check_eps, self.eps)
        if self.vocab_axis is not None:
            check_int(self.vocab_axis, argname="HeadOptions.vocab_axis", minimum=-(2**31))
        if self.num_valid is not None:
            check_int(self.num_valid, argname="HeadOptions.num_valid", minimum=1)
        check_bool(self.track, "HeadOptions.track")
        check_int(self.track_every_k_steps, argname="HeadOptions.track_every_k_steps",
                  minimum=1)


@dataclasses.dataclass(frozen=True)
class RouterOptions:
    """How `lm_optimizer` trains mixture-of-experts routers (the ``"router"`` group).

    A router ``W`` (``(d, E)``, a scanned layer axis aside) maps a token's features to one logit
    per expert. Its rows along the expert axis play the part of the head's token rows: a
    softmax router (softmax then top-k, or top-k then softmax) is invariant to adding one
    constant to all ``E`` logits, so its gradient's expert rows sum to zero and the
    row-diameter geometry of the head applies over ``E``; a sigmoid router (DeepSeek-V3,
    Llama 4) is not shift-invariant. The tree cannot tell which score function a model uses.

    Attributes:
      optimizer: ``"muon"`` (default: the hidden group's Muon chain, `MuonOptions`, per layer,
        right for every score function), ``"rownorm"`` (projected RowNorm over the expert axis,
        per layer: centred expert rows, each of norm ``<= 1``, so ``D(step) <= 2·lr``; for
        softmax routers only, since the centring drops a shift a sigmoid router does see) or
        ``"adamw"`` (`AdamOptions`).
      momentum: RowNorm only: the EMA momentum before the normalisation (no Nesterov,
        float32); None: 0.95.
      eps: RowNorm only: rows shorter than it are divided by it; None: `rownorm_direction`'s
        default (``1e-8``).

    Examples:
      >>> import rowgeom
      >>> rowgeom.RouterOptions(optimizer="rownorm").optimizer
      'rownorm'
      >>> rowgeom.group_options(1e-3, router="rownorm")["router"].momentum
      0.95
    """

    optimizer: str = "muon"
    momentum: float | None = None
    eps: float | None = None

    def __post_init__(self):
        one_of(self.optimizer, ROUTER_OPTIMIZERS, "RouterOptions.optimizer")
        _only_for("RouterOptions", self.optimizer, "rownorm", momentum=self.momentum,
                  eps=self.eps)
        check_momentum(self.momentum, "RouterOptions.momentum")
        if self.eps is not None:
            prefixed("RouterOptions", _check_eps, self.eps)


@dataclasses.dataclass(frozen=True)
class AdamOptions:
    """``optax.adamw``'s options for the embedding and vector groups, an AdamW head and an
    AdamW router (the rate and decay are the group's).

    Examples:
      >>> import rowgeom
      >>> rowgeom.AdamOptions()
      AdamOptions(b1=0.9, b2=0.95, eps=1e-08, eps_root=0.0, mu_dtype=None, nesterov=False)
    """

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    eps_root: float = 0.0
    mu_dtype: Any = None
    nesterov: bool = False

    def __post_init__(self):
        check_real(self.b1, "AdamOptions.b1", low=0.0, high=1.0, high_open=True)
        check_real(self.b2, "AdamOptions.b2", low=0.0, high=1.0, high_open=True)
        check_real(self.eps, "AdamOptions.eps", low=0.0)
        check_real(self.eps_root, "AdamOptions.eps_root", low=0.0)
        check_bool(self.nesterov, "AdamOptions.nesterov")


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    """One group's learning rate, weight decay and momentum: what `lm_optimizer` trains the
    group with, and what ``groups={group: GroupOptions(...)}`` overrides (None: derived, see
    `group_options`).

    ``learning_rate``: float or schedule ``count -> rate``; ``weight_decay``: decoupled, per
    step times the rate; ``momentum``: Muon's ``optax.trace`` decay, RowNorm's EMA decay or
    AdamW's ``b1``.

    Examples:
      >>> import rowgeom
      >>> groups = rowgeom.group_options(
      ...     1e-3, groups={"vector": rowgeom.GroupOptions(learning_rate=3e-4)})
      >>> groups["vector"].learning_rate, groups["hidden"].learning_rate
      (0.0003, 0.001)
    """

    learning_rate: Rate = None
    weight_decay: Rate = None
    momentum: float | None = None

    def __post_init__(self):
        check_momentum(self.momentum, "GroupOptions.momentum")


def as_options(value, kind: type, names: tuple[str, ...], argname: str):
    """An options object from its keyword: None -> the defaults, a name -> its optimizer."""
    if value is None:
        return kind()
    if names and isinstance(value, str):
        return kind(optimizer=one_of(value, names, argname))
    if not isinstance(value, kind):
        allowed = f"one of {names} or " if names else ""
        raise TypeError(f"{argname} must be {allowed}a rowgeom.{kind.__name__}, got {value!r}")
    return value


def _scaled(rate: Rate, factor: float) -> Rate:
    """`factor` times a learning rate; a schedule stays a schedule, None stays None."""
    if rate is None or factor == 1:
        return rate
    if callable(rate):
        return lambda count: factor * rate(count)
    return factor * rate


def group_options(
    learning_rate: Rate,
    *,
    head: str | HeadOptions = "rownorm",
    muon: MuonOptions | None = None,
    adam: AdamOptions | None = None,
    router: str | RouterOptions = "muon",
    weight_decay: Rate = 0.1,
    groups: Mapping[str, GroupOptions] | None = None,
) -> Mapping[str, GroupOptions]:
    """Every group's `GroupOptions`, resolved: the rates, decays and momenta `lm_optimizer`
    (with the same keywords) trains with, and `describe` prints.

    Defaults (the guide "Learning rates and radii"): hidden, embedding and vector use
    `learning_rate` as is, the head ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (a schedule
    stays a schedule), the router the hidden group's rate and decay; `weight_decay` for the
    matrix groups, 0 for vectors; momentum `MuonOptions.momentum` (Muon), `HeadOptions.momentum`
    or `RouterOptions.momentum` (RowNorm, None: 0.95) or `AdamOptions.b1` (AdamW). A field of
    ``groups[group]`` that is not None replaces the derived one.

    Examples:
      >>> import rowgeom
      >>> no_decay = {"head": rowgeom.GroupOptions(weight_decay=0.0)}
      >>> rowgeom.group_options(1e-3, groups=no_decay)["head"]
      GroupOptions(learning_rate=0.005, weight_decay=0.0, momentum=0.95)
      >>> warm = lambda count: 1e-3 * count / 100
      >>> round(float(rowgeom.group_options(warm, head="adamw")["head"].learning_rate(50)), 6)
      0.0015
    """
    head_: HeadOptions = as_options(head, HeadOptions, HEAD_OPTIMIZERS, "head")
    router_: RouterOptions = as_options(router, RouterOptions, ROUTER_OPTIMIZERS, "router")
    muon_: MuonOptions = as_options(muon, MuonOptions, (), "muon")
    adam_: AdamOptions = as_options(adam, AdamOptions, (), "adam")
    overrides = dict(groups or {})
    unknown = sorted(set(overrides) - set(LABELS))
    if unknown:
        raise ValueError(f"groups: unknown group(s) {unknown}; groups are {LABELS}")
    for name, value in overrides.items():
        if not isinstance(value, GroupOptions):
            raise TypeError(f"groups[{name!r}] must be a rowgeom.GroupOptions, got {value!r}")

    def group(name: str, rate: Rate, decay: Rate, mom: float) -> GroupOptions:
        given = overrides.get(name, GroupOptions())
        pick = lambda field, derived: derived if getattr(given, field) is None else getattr(
            given, field)
        return GroupOptions(pick("learning_rate", rate), pick("weight_decay", decay),
                            pick("momentum", mom))

    hidden = group("hidden", learning_rate, weight_decay, muon_.momentum)
    head_momentum = (adam_.b1 if head_.optimizer == "adamw" else
                     EMA_MOMENTUM if head_.momentum is None else head_.momentum)
    router_momentum = {"muon": muon_.momentum, "adamw": adam_.b1,
                       "rownorm": EMA_MOMENTUM if router_.momentum is None else router_.momentum}
    return types.MappingProxyType({
        "hidden": hidden,
        "head": group("head", _scaled(learning_rate, HEAD_LR_MULTIPLIERS[head_.optimizer]),
                      weight_decay, head_momentum),
        "embedding": group("embedding", learning_rate, weight_decay, adam_.b1),
        "vector": group("vector", learning_rate, 0.0, adam_.b1),
        "router": group("router", hidden.learning_rate, hidden.weight_decay,
                        router_momentum[router_.optimizer]),
    })
