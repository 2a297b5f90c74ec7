"""`lm_optimizer`'s options as frozen objects, and their resolution into every group's settings.

Contract: each option lives in exactly one place — `HeadOptions` (the head's optimizer, momentum,
vocabulary axis, padding, rescaling and tracker), `MuonOptions` (the hidden group's Muon),
`RouterOptions` (the router group's optimizer), `AdamOptions` (every AdamW group) and
`GroupOptions` (one group's rate and decay override) — and
`lm_optimizer_hparams` resolves them, with the base learning rate, into an `LMHyperparams`: the
object `lm_optimizer` builds from, `describe` prints and a training script reads rates from.

Why the defaults follow from one learning rate (RMS-matched Muon, the head rate as a radius, the
head study's multipliers): docs/guides/learning-rates.md.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import jax

from rowgeom._names import HEAD_OPTIMIZERS, LABELS, ROUTER_OPTIMIZERS, TIED_POLICIES
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

_RESCALE_MODES = (None, "exact", "bound")
_MUON_SCALES = ("rms", "spectral", "keller", "none", None)


def _one_of(value, allowed, argname: str):
    if value not in allowed:
        raise ValueError(f"{argname} must be one of {allowed}, got {value!r}")
    return value


def _not_array(value, argname: str):
    if isinstance(value, jax.Array):
        raise TypeError(f"{argname} must be a Python value, not a jax array: options objects are "
                        "static (only lm_optimizer's float rates are injectable)")
    return value


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """How `lm_optimizer` trains the LM head.

    Attributes:
      optimizer: ``"rownorm"`` (projected RowNorm, arXiv 2608.22253), ``"adamw"`` or ``"muon"``.
      momentum: EMA momentum of a RowNorm head (no Nesterov, float32, before the normalisation)
        and the trace momentum of a Muon head; an AdamW head uses `AdamOptions.b1`.
      vocab_axis: the vocabulary axis of every head leaf; None: the one axis of size ``V``, else
        by name (``kernel`` -> 1, ``embedding``/``weight`` -> 0).
      rescale: RowNorm only: None, ``"exact"`` (multiply the direction by ``2/D(S*)``, the whole
        diameter budget, ``O(V²d)`` per step) or ``"bound"`` (divide by the ``O(Vd)`` upper
        bound instead).
      num_valid: the number of real tokens of a padded vocabulary: token rows ``>= num_valid``
        are left out of RowNorm's means and get no RowNorm step (their weight decay still
        applies: ``-lr·wd·W_pad``, zero while those rows are zero).
      track: record `rowgeom.RowDiameterStats` of the full head step (`read_row_diameter`).
      track_every_k_steps: measure them on the first step and every k-th (1: every step).

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
    momentum: float = 0.95
    vocab_axis: int | None = None
    rescale: str | None = None
    num_valid: int | None = None
    track: bool = True
    track_every_k_steps: int = 10

    def __post_init__(self):
        _one_of(self.optimizer, HEAD_OPTIMIZERS, "HeadOptions.optimizer")
        _one_of(self.rescale, _RESCALE_MODES, "HeadOptions.rescale")
        if self.rescale is not None and self.optimizer != "rownorm":
            raise ValueError(f"HeadOptions.rescale applies to optimizer='rownorm' only, got "
                             f"optimizer={self.optimizer!r} with rescale={self.rescale!r}")
        if self.vocab_axis is not None:
            check_int(self.vocab_axis, argname="HeadOptions.vocab_axis", minimum=-(2**31))
        if self.num_valid is not None:
            check_int(self.num_valid, argname="HeadOptions.num_valid", minimum=1)
        check_int(self.track_every_k_steps, argname="HeadOptions.track_every_k_steps",
                  minimum=1)
        _not_array(self.momentum, "HeadOptions.momentum")


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """The Muon chain of the hidden group (and of a Muon head, with `HeadOptions.momentum`).

    Attributes:
      momentum: ``optax.trace`` decay before the orthogonalization.
      nesterov: Nesterov momentum.
      ns_steps: Newton–Schulz steps.
      ns_coeffs: preset name, triple or table (`rowgeom.ns_coefficients`).
      scale: `rowgeom.muon_orthogonalize`'s ``scale`` (``"rms"``: step RMS 0.2).
      shard_matrices: when the updates live on a multi-device mesh, orthogonalize whole
        matrices, each on one device (`rowgeom.muon_orthogonalize`'s option of that name);
        False leaves Newton–Schulz to the partitioner.
      dimension_numbers: None (each hidden leaf's matrix axes inferred from the model
        structure; an undecidable leaf raises, naming it); a mapping ``{"/"-joined path:
        MuonDimensionNumbers}`` overriding the inference for those leaves or subtrees; or, as in
        `rowgeom.muon_orthogonalize`, one ``MuonDimensionNumbers`` for every hidden leaf, a tree
        or a callable (nothing inferred).

    Examples:
      >>> import rowgeom
      >>> rowgeom.MuonOptions(ns_steps=6).ns_steps
      6
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coeffs: Any = "keller"
    scale: str | None = "rms"
    shard_matrices: bool = True
    dimension_numbers: Any = None

    def __post_init__(self):
        if not isinstance(self.shard_matrices, bool):
            raise TypeError(f"MuonOptions.shard_matrices must be a bool, got "
                            f"{self.shard_matrices!r}")
        check_int(self.ns_steps, argname="MuonOptions.ns_steps", minimum=1)
        _one_of(self.scale, _MUON_SCALES, "MuonOptions.scale")
        _not_array(self.ns_coeffs, "MuonOptions.ns_coeffs")
        _not_array(self.dimension_numbers, "MuonOptions.dimension_numbers")
        _not_array(self.momentum, "MuonOptions.momentum")


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
      optimizer: ``"muon"`` (default: the hidden group's Muon chain, per layer, right for every
        score function), ``"rownorm"`` (projected RowNorm over the expert axis, per layer:
        centred expert rows, each of norm ``<= 1``, so ``D(step) <= 2·lr``; for softmax
        routers only, since the centring drops a shift a sigmoid router does see) or
        ``"adamw"``.
      momentum: EMA momentum before the RowNorm (no Nesterov, float32); the Muon router uses
        `MuonOptions.momentum`, the AdamW one `AdamOptions.b1`.

    Examples:
      >>> import rowgeom
      >>> rowgeom.RouterOptions(optimizer="rownorm").optimizer
      'rownorm'
      >>> rowgeom.lm_optimizer_hparams(1e-3, router="rownorm")["router"].optimizer
      'rownorm'
    """

    optimizer: str = "muon"
    momentum: float = 0.95

    def __post_init__(self):
        _one_of(self.optimizer, ROUTER_OPTIMIZERS, "RouterOptions.optimizer")
        _not_array(self.momentum, "RouterOptions.momentum")


@dataclasses.dataclass(frozen=True)
class AdamOptions:
    """``optax.adamw``'s moments for the embedding and vector groups and an AdamW head.

    Examples:
      >>> import rowgeom
      >>> rowgeom.AdamOptions()
      AdamOptions(b1=0.9, b2=0.95, eps=1e-08)
    """

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    """One group's override of the derived learning rate and weight decay (None: derived).

    Examples:
      >>> import rowgeom
      >>> hp = rowgeom.lm_optimizer_hparams(
      ...     1e-3, groups={"vector": rowgeom.GroupOptions(learning_rate=3e-4)})
      >>> hp["vector"].learning_rate, hp["hidden"].learning_rate
      (0.0003, 0.001)
    """

    learning_rate: Rate = None
    weight_decay: Rate = None


DEFAULT_MUON = MuonOptions()
DEFAULT_ADAM = AdamOptions()
DEFAULT_ROUTER = RouterOptions()


class GroupHyperparams(NamedTuple):
    """One optimizer group's resolved settings, as `lm_optimizer` uses them.

    ``optimizer``: ``"muon"``, ``"rownorm"``, ``"rownorm (uncentred)"`` (a tied table) or
    ``"adamw"``; ``learning_rate``: float or schedule; ``weight_decay``: decoupled, per step
    times the learning rate; ``momentum``: Muon/RowNorm momentum or AdamW's ``b1``.

    Examples:
      >>> import rowgeom
      >>> rowgeom.lm_optimizer_hparams(1e-3)["head"]
      GroupHyperparams(optimizer='rownorm', learning_rate=0.005, weight_decay=0.1, momentum=0.95)
    """

    optimizer: str
    learning_rate: Any
    weight_decay: Any
    momentum: Any


@dataclasses.dataclass(frozen=True)
class LMHyperparams(Mapping):
    """Everything `lm_optimizer` builds from, resolved: a read-only mapping from the five groups
    to their `GroupHyperparams`, plus the option objects and the labelling.

    Pass it to `lm_optimizer` or `describe` in place of the learning rate; `with_rates` maps
    every group's rate (e.g. into a schedule) and keeps everything else.

    Examples:
      >>> import rowgeom
      >>> hp = rowgeom.lm_optimizer_hparams(6e-3, head="adamw")
      >>> round(hp["head"].learning_rate, 6), hp["hidden"].learning_rate, hp["vector"].weight_decay
      (0.018, 0.006, 0.0)
      >>> warm = hp.with_rates(lambda group, lr: (lambda count: lr * count / 100))
      >>> round(float(warm["head"].learning_rate(50)), 6)
      0.009
    """

    groups: Mapping[str, GroupHyperparams]
    head: HeadOptions
    muon: MuonOptions
    adam: AdamOptions
    labels: Any
    tied: str | None
    router: RouterOptions = DEFAULT_ROUTER

    def __getitem__(self, group: str) -> GroupHyperparams:
        return self.groups[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def with_rates(self, fn: Callable[[str, Rate], Rate]) -> LMHyperparams:
        """A copy whose group ``g`` has learning rate ``fn(g, rate)``."""
        groups = {g: hp._replace(learning_rate=fn(g, hp.learning_rate))
                  for g, hp in self.groups.items()}
        return dataclasses.replace(self, groups=types.MappingProxyType(groups))


def _scaled(rate: Rate, factor: float) -> Rate:
    """`factor` times a learning rate; a schedule stays a schedule, None stays None."""
    if rate is None or factor == 1:
        return rate
    if callable(rate):
        return lambda count: factor * rate(count)
    return factor * rate


def _or(value, fallback):
    return fallback if value is None else value


# The flat keywords of earlier releases, each one field of one options object. They stay
# accepted: a one-line call reads well, and every field keeps a single home.
FLAT_KEYWORDS = types.MappingProxyType({
    "hidden_learning_rate": ("groups", "hidden", "learning_rate"),
    "embedding_learning_rate": ("groups", "embedding", "learning_rate"),
    "vector_learning_rate": ("groups", "vector", "learning_rate"),
    "router_learning_rate": ("groups", "router", "learning_rate"),
    "hidden_weight_decay": ("groups", "hidden", "weight_decay"),
    "head_weight_decay": ("groups", "head", "weight_decay"),
    "embedding_weight_decay": ("groups", "embedding", "weight_decay"),
    "vector_weight_decay": ("groups", "vector", "weight_decay"),
    "router_weight_decay": ("groups", "router", "weight_decay"),
    "momentum": ("muon", "momentum"),
    "nesterov": ("muon", "nesterov"),
    "ns_steps": ("muon", "ns_steps"),
    "ns_coeffs": ("muon", "ns_coeffs"),
    "muon_scale": ("muon", "scale"),
    "shard_matrices": ("muon", "shard_matrices"),
    "muon_dimension_numbers": ("muon", "dimension_numbers"),
    "head_momentum": ("head", "momentum"),
    "head_vocab_axis": ("head", "vocab_axis"),
    "head_rescale": ("head", "rescale"),
    "head_num_valid": ("head", "num_valid"),
    "track_head": ("head", "track"),
    "track_every_k_steps": ("head", "track_every_k_steps"),
    "adam_b1": ("adam", "b1"),
    "adam_b2": ("adam", "b2"),
    "adam_eps": ("adam", "eps"),
})
"""``lm_optimizer``'s flat keywords and the options field each one sets: ``ns_steps=6`` is
``muon=MuonOptions(ns_steps=6)``, ``head_weight_decay=0`` is
``groups={"head": GroupOptions(weight_decay=0)}``.

Examples:
    >>> import rowgeom
    >>> rowgeom.FLAT_KEYWORDS["head_num_valid"]
    ('head', 'num_valid')
    >>> rowgeom.lm_optimizer_hparams(1e-3, head_num_valid=50257).head.num_valid
    50257
"""


_Options = TypeVar("_Options", "HeadOptions", "MuonOptions", "AdamOptions", "RouterOptions")


def _apply_flat(flat: dict, *, head: HeadOptions, muon: MuonOptions, adam: AdamOptions,
                router: RouterOptions, groups: dict,
                ) -> tuple[HeadOptions, MuonOptions, AdamOptions, RouterOptions, dict]:
    # optax.inject_hyperparams binds the var-keyword arguments to their parameter's name and
    # passes them back as one keyword holding a dict: unpack it.
    if isinstance(flat.get("flat"), dict):
        flat = {**flat.pop("flat"), **flat}
    unknown = sorted(set(flat) - set(FLAT_KEYWORDS))
    if unknown:
        raise TypeError(f"lm_optimizer: unknown option(s) {unknown}; options are the keywords "
                        f"of lm_optimizer and {sorted(FLAT_KEYWORDS)}")
    objects: dict[str, Any] = {"head": {}, "muon": {}, "adam": {}, "router": {}}
    for name, value in flat.items():
        where = FLAT_KEYWORDS[name]
        if where[0] == "groups":
            old = groups.get(where[1], GroupOptions())
            groups[where[1]] = dataclasses.replace(old, **{where[2]: value})
        else:
            objects[where[0]][where[1]] = value
    def replaced(obj: _Options, name: str) -> _Options:
        try:
            return dataclasses.replace(obj, **objects[name])
        except (TypeError, ValueError) as err:  # name the keywords the user wrote
            given = [k for k in flat if FLAT_KEYWORDS[k][0] == name]
            raise type(err)(f"{err} (set by {', '.join(f'{k}=' for k in given)})") from None

    return (replaced(head, "head"), replaced(muon, "muon"), replaced(adam, "adam"),
            replaced(router, "router"), groups)


def lm_optimizer_hparams(
    learning_rate: Rate,
    *,
    head: str | HeadOptions = "rownorm",
    labels: Any = None,
    tied: str | None = None,
    head_learning_rate: Rate = None,
    weight_decay: Rate = 0.1,
    groups: Mapping[str, GroupOptions] | None = None,
    muon: MuonOptions = DEFAULT_MUON,
    adam: AdamOptions = DEFAULT_ADAM,
    router: str | RouterOptions = DEFAULT_ROUTER,
    **flat: Any,
) -> LMHyperparams:
    """Every group's resolved learning rate, weight decay and momentum, and the options.

    The one source of truth for the defaults: `lm_optimizer` calls it (or takes its result),
    so a training script that needs a group's rate reads it here instead of re-deriving it.

    Args:
      learning_rate: base rate (float or schedule; None leaves every rate None, for
        `describe`). Hidden, embedding and vector groups use it as is, the head
        ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (a schedule stays a schedule).
      head: a head optimizer name or `HeadOptions`.
      labels: None (`rowgeom.label_params`' defaults with `tied`), a tree of labels, a
        callable ``params -> labels`` or a `Labeler`.
      tied: None, ``"embedding"`` or ``"head"``: how a head tied to the embedding is trained.
        ``"head"`` also turns off RowNorm's centring.
      head_learning_rate: the head's rate instead of the multiple of `learning_rate`.
      weight_decay: decoupled weight decay of the matrix groups (hidden, head, embedding); the
        vector group's default is 0.
      groups: per-group overrides, ``{"hidden" | "head" | "embedding" | "vector" | "router":
        GroupOptions(...)}``.
      muon: `MuonOptions`.
      adam: `AdamOptions`.
      router: a router optimizer name (``"muon"``, ``"rownorm"``, ``"adamw"``) or
        `RouterOptions`; the router group's rate and decay default to the hidden group's.
      **flat: the flat keywords of `FLAT_KEYWORDS` (e.g. ``ns_steps=6``), each setting one
        field of the objects above.

    Returns:
      An `LMHyperparams`: ``hp["head"]`` is the head's `GroupHyperparams`.

    Examples:
      >>> import rowgeom
      >>> hp = rowgeom.lm_optimizer_hparams(1e-3, head_weight_decay=0.0)
      >>> hp["head"]
      GroupHyperparams(optimizer='rownorm', learning_rate=0.005, weight_decay=0.0, momentum=0.95)
    """
    if isinstance(head, str):
        head = HeadOptions(optimizer=_one_of(head, HEAD_OPTIMIZERS, "head"))
    if not isinstance(head, HeadOptions):
        raise TypeError(f"head must be one of {HEAD_OPTIMIZERS} or a rowgeom.HeadOptions, got "
                        f"{head!r}")
    if isinstance(router, str):
        router = RouterOptions(optimizer=_one_of(router, ROUTER_OPTIMIZERS, "router"))
    for name, value, kind in (("muon", muon, MuonOptions), ("adam", adam, AdamOptions),
                              ("router", router, RouterOptions)):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a rowgeom.{kind.__name__}, got {value!r}")
    _one_of(tied, TIED_POLICIES, "tied")
    if isinstance(labels, (str, jax.Array)):
        # A callable `labels` passed to inject_hyperparams arrives here evaluated as a schedule.
        raise TypeError(f"labels must be None, a tree of labels or a callable, got {labels!r}; "
                        "under optax.inject_hyperparams list it in static_args "
                        "(rowgeom.STATIC_ARGS)")
    overrides = dict(groups or {})
    unknown = sorted(set(overrides) - set(LABELS))
    if unknown:
        raise ValueError(f"groups: unknown group(s) {unknown}; groups are {LABELS}")
    head, muon, adam, router, overrides = _apply_flat(flat, head=head, muon=muon, adam=adam,
                                                      router=router, groups=overrides)
    given = {g: overrides.get(g, GroupOptions()) for g in LABELS}
    if head_learning_rate is not None and given["head"].learning_rate is not None:
        raise ValueError("the head's rate is given twice: head_learning_rate and "
                         "groups['head'].learning_rate")
    name = head.optimizer
    head_lr = _or(_or(head_learning_rate, given["head"].learning_rate),
                  _scaled(learning_rate, HEAD_LR_MULTIPLIERS[name]))
    head_name = "rownorm (uncentred)" if name == "rownorm" and tied == "head" else name
    resolved = {
        "hidden": GroupHyperparams("muon", _or(given["hidden"].learning_rate, learning_rate),
                                   _or(given["hidden"].weight_decay, weight_decay),
                                   muon.momentum),
        "head": GroupHyperparams(head_name, head_lr,
                                 _or(given["head"].weight_decay, weight_decay),
                                 adam.b1 if name == "adamw" else head.momentum),
        "embedding": GroupHyperparams(
            "adamw", _or(given["embedding"].learning_rate, learning_rate),
            _or(given["embedding"].weight_decay, weight_decay), adam.b1),
        "vector": GroupHyperparams("adamw", _or(given["vector"].learning_rate, learning_rate),
                                   _or(given["vector"].weight_decay, 0.0), adam.b1),
        "router": GroupHyperparams(
            router.optimizer, _or(given["router"].learning_rate, learning_rate),
            _or(given["router"].weight_decay, weight_decay),
            {"muon": muon.momentum, "rownorm": router.momentum, "adamw": adam.b1}[
                router.optimizer]),
    }
    return LMHyperparams(types.MappingProxyType(resolved), head, muon, adam, labels, tied,
                         router)
