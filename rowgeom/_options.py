"""`lm_optimizer`'s options as frozen objects: each field of each transform it builds, one home.

Contract: `HeadOptions` (the head's optimizer, momentum, vocabulary axis, RowNorm's eps, padding,
rescaling and tracker), `MuonOptions` (every option of the hidden group's Muon chain: momentum,
Newton–Schulz, eps, compute dtype, scale, sharding, matrix axes), `RouterOptions` (the router
group's optimizer), `AdamOptions` (every AdamW group) and `GroupOptions` (one group's rate and
decay override). Each checks its fields on creation, naming the field. A field that only one
optimizer reads (a RowNorm head's ``eps``, an AdamW head has no ``momentum``) is None by default
and an error when given to another. `rowgeom._hparams.lm_optimizer_hparams` resolves them.

Why the defaults follow from one learning rate (RMS-matched Muon, the head rate as a radius, the
head study's multipliers): docs/guides/learning-rates.md.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from typing import Any

import jax

from rowgeom._cpu import IMPLS
from rowgeom._muon import check_muon_options
from rowgeom._names import HEAD_OPTIMIZERS, ROUTER_OPTIMIZERS
from rowgeom._newton_schulz import resolve_coefficients
from rowgeom._rownorm import _RESCALE_MODES, _check_eps
from rowgeom._validation import check_int

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


def one_of(value, allowed, argname: str):
    """`value` if it is in `allowed`; a ValueError naming `argname` otherwise."""
    if value not in allowed:
        raise ValueError(f"{argname} must be one of {allowed}, got {value!r}")
    return value


def _not_array(value, argname: str):
    if isinstance(value, jax.Array):
        raise TypeError(f"{argname} must be a Python value, not a jax array: options objects are "
                        "static (only lm_optimizer's float rates are injectable)")
    return value


def _real(value, argname: str, *, low: float, high: float = math.inf,
          low_open: bool = False, high_open: bool = False) -> None:
    """Raises unless `value` is a real number in the interval (bounds open where said)."""
    _not_array(value, argname)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{argname} must be a finite real number, got {value!r}")
    value = float(value)
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{argname} must be in {bounds}, got {value!r}")


def _momentum(value, argname: str) -> None:
    if value is not None:
        _real(value, argname, low=0.0, high=1.0, high_open=True)


def _only_for(owner: str, optimizer: str, needs: str, **fields) -> None:
    """Raises when a field that only the `needs` optimizer reads is given to another."""
    given = [name for name, value in fields.items() if value is not None]
    if given and optimizer != needs:
        raise ValueError(f"{owner}.{given[0]} applies to optimizer={needs!r} only, got "
                         f"optimizer={optimizer!r} with {given[0]}={fields[given[0]]!r}")


def _prefixed(owner: str, check, *args, **kwargs):
    """Runs a transform's own argument check, its error naming the options field."""
    try:
        return check(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}.{err}") from None


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
        ``1e-8``.
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
        if not isinstance(self.bias_correction, bool):
            raise TypeError("HeadOptions.bias_correction must be a bool, got "
                            f"{self.bias_correction!r}")
        if self.optimizer == "adamw" and self.momentum is not None:
            raise ValueError("HeadOptions.momentum: an AdamW head's momentum is AdamOptions.b1, "
                             f"got momentum={self.momentum!r}")
        _momentum(self.momentum, "HeadOptions.momentum")
        if self.eps is not None:
            _prefixed("HeadOptions", _check_eps, self.eps)
        if self.vocab_axis is not None:
            check_int(self.vocab_axis, argname="HeadOptions.vocab_axis", minimum=-(2**31))
        if self.num_valid is not None:
            check_int(self.num_valid, argname="HeadOptions.num_valid", minimum=1)
        if not isinstance(self.track, bool):
            raise TypeError(f"HeadOptions.track must be a bool, got {self.track!r}")
        check_int(self.track_every_k_steps, argname="HeadOptions.track_every_k_steps",
                  minimum=1)


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """The Muon chain of the hidden group (and of a Muon head and router): every option of
    ``optax.trace`` and `rowgeom.muon_orthogonalize` that `lm_optimizer` does not derive.

    Attributes:
      momentum: ``optax.trace`` decay before the orthogonalization (a Muon head uses
        `HeadOptions.momentum` instead).
      nesterov: Nesterov momentum.
      mu_dtype: dtype of the momentum buffer (``optax.trace``'s ``accumulator_dtype``); None:
        the parameters'.
      ns_steps: Newton–Schulz steps.
      ns_coeffs: preset name, triple or table (`rowgeom.ns_coefficients`).
      eps: added to each matrix's Frobenius norm before normalising.
      compute_dtype: dtype of the Newton–Schulz iteration (e.g. ``jnp.bfloat16``; products
        accumulate in float32); None: each update's own.
      scale: `rowgeom.muon_orthogonalize`'s ``scale`` (``"rms"``: step RMS `rms_scale`).
      rms_scale: the step RMS of ``scale="rms"``.
      shard_matrices: when the updates live on a multi-device mesh, orthogonalize whole
        matrices, each on one device (`rowgeom.muon_orthogonalize`'s option of that name);
        False leaves Newton–Schulz to the partitioner.
      dimension_numbers: None (each hidden leaf's matrix axes inferred from the model
        structure; an undecidable leaf raises, naming it); a mapping ``{"/"-joined path:
        MuonDimensionNumbers}`` overriding the inference for those leaves or subtrees; or, as in
        `rowgeom.muon_orthogonalize`, one ``MuonDimensionNumbers`` for every hidden leaf, a tree
        or a callable of the parameter tree (nothing inferred).

    Examples:
      >>> import rowgeom
      >>> rowgeom.MuonOptions(ns_steps=6).ns_steps
      6
      >>> rowgeom.MuonOptions(rms_scale=0)
      Traceback (most recent call last):
      ...
      ValueError: MuonOptions.rms_scale must be a finite number > 0, got 0
    """

    momentum: float = 0.95
    nesterov: bool = True
    mu_dtype: Any = None
    ns_steps: int = 5
    ns_coeffs: Any = "keller"
    eps: float = 1e-7
    compute_dtype: Any = None
    scale: str | None = "rms"
    rms_scale: float = 0.2
    shard_matrices: bool = True
    dimension_numbers: Any = None

    def __post_init__(self):
        for name in ("nesterov", "shard_matrices"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MuonOptions.{name} must be a bool, got {getattr(self, name)!r}")
        _momentum(self.momentum, "MuonOptions.momentum")
        _not_array(self.ns_coeffs, "MuonOptions.ns_coeffs")
        _not_array(self.dimension_numbers, "MuonOptions.dimension_numbers")
        for name in ("eps", "rms_scale"):
            _not_array(getattr(self, name), f"MuonOptions.{name}")
        _prefixed("MuonOptions", resolve_coefficients, self.ns_coeffs, self.ns_steps)
        _prefixed("MuonOptions", check_muon_options, scale=self.scale, eps=self.eps,
                  rms_scale=self.rms_scale, compute_dtype=self.compute_dtype)


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
      eps: RowNorm only: rows shorter than it are divided by it; None: ``1e-8``.

    Examples:
      >>> import rowgeom
      >>> rowgeom.RouterOptions(optimizer="rownorm").optimizer
      'rownorm'
      >>> rowgeom.lm_optimizer_hparams(1e-3, router="rownorm")["router"].optimizer
      'rownorm'
    """

    optimizer: str = "muon"
    momentum: float | None = None
    eps: float | None = None

    def __post_init__(self):
        one_of(self.optimizer, ROUTER_OPTIMIZERS, "RouterOptions.optimizer")
        _only_for("RouterOptions", self.optimizer, "rownorm", momentum=self.momentum,
                  eps=self.eps)
        _momentum(self.momentum, "RouterOptions.momentum")
        if self.eps is not None:
            _prefixed("RouterOptions", _check_eps, self.eps)


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
        _real(self.b1, "AdamOptions.b1", low=0.0, high=1.0, high_open=True)
        _real(self.b2, "AdamOptions.b2", low=0.0, high=1.0, high_open=True)
        _real(self.eps, "AdamOptions.eps", low=0.0)
        _real(self.eps_root, "AdamOptions.eps_root", low=0.0)
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"AdamOptions.nesterov must be a bool, got {self.nesterov!r}")


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    """One group's learning rate and weight decay (None: derived from `lm_optimizer`'s
    ``learning_rate`` and ``weight_decay``, see `lm_optimizer_hparams`).

    Examples:
      >>> import rowgeom
      >>> hp = rowgeom.lm_optimizer_hparams(
      ...     1e-3, groups={"vector": rowgeom.GroupOptions(learning_rate=3e-4)})
      >>> hp["vector"].learning_rate, hp["hidden"].learning_rate
      (0.0003, 0.001)
    """

    learning_rate: Rate = None
    weight_decay: Rate = None
