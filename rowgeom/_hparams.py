"""`lm_optimizer_hparams`: the options resolved into every group's rate, decay and momentum.

Contract: `lm_optimizer_hparams` is the one signature of `lm_optimizer`'s options and the one
home of their defaults: the base rate and decay, each group's override (`GroupOptions`), the
head multipliers (`HEAD_LR_MULTIPLIERS`), each group's momentum, the tied policy. It returns an
`LMHyperparams`, what `lm_optimizer` builds from, `describe` prints and a training script reads
rates from. Each field is said once: a field given twice, by two spellings, is a ValueError
naming both (a flat keyword of `rowgeom._deprecated` and its object, ``tied`` and a `Labeler`'s,
an `LMHyperparams` and any option beside it).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax

from rowgeom._deprecated import apply_flat_keywords
from rowgeom._labels import Labeler
from rowgeom._names import HEAD_OPTIMIZERS, LABELS, ROUTER_OPTIMIZERS, TIED_POLICIES
from rowgeom._options import (
    EMA_MOMENTUM,
    HEAD_LR_MULTIPLIERS,
    AdamOptions,
    GroupOptions,
    HeadOptions,
    MuonOptions,
    Rate,
    RouterOptions,
    one_of,
)


class GroupHyperparams(NamedTuple):
    """One optimizer group's resolved settings, as `lm_optimizer` uses them.

    ``optimizer``: ``"muon"``, ``"rownorm"`` or ``"adamw"`` (whether a RowNorm head is centred
    is the plan's, `LeafPlan.centred`); ``learning_rate``: float or schedule; ``weight_decay``:
    decoupled, per step times the learning rate; ``momentum``: Muon/RowNorm momentum or
    AdamW's ``b1``.

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

    Pass it to `lm_optimizer` or `describe` in place of the learning rate (with no option
    beside it: it holds them all); `with_rates` maps every group's rate (e.g. into a schedule)
    and keeps everything else. ``labels`` is the labelling with the tied policy applied (a
    `Labeler`, unless a tree or callable of labels was given).

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
    router: RouterOptions = RouterOptions()

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


def lm_optimizer_hparams(
    learning_rate: Rate,
    *,
    head: str | HeadOptions = "rownorm",
    labels: Any = None,
    tied: str | None = None,
    weight_decay: Rate = 0.1,
    groups: Mapping[str, GroupOptions] | None = None,
    muon: MuonOptions | None = None,
    adam: AdamOptions | None = None,
    router: str | RouterOptions = "muon",
    **deprecated: Any,
) -> LMHyperparams:
    """Every group's resolved learning rate, weight decay and momentum, and the options.

    The keywords of `lm_optimizer` and `describe`, and the one source of truth for their
    defaults: a training script that needs a group's rate reads it here.

    Args:
      learning_rate: base rate (float or schedule; None leaves every rate None, for
        `describe`). Hidden, embedding and vector groups use it as is, the head
        ``HEAD_LR_MULTIPLIERS[optimizer]`` times it (a schedule stays a schedule), the router
        group the hidden group's rate.
      head: a head optimizer name (``"rownorm"``, ``"adamw"``, ``"muon"``) or `HeadOptions`.
      labels: None (`rowgeom.label_params`' defaults), a tree of labels, a callable ``params ->
        labels`` or a `Labeler`; labels must be in ``rowgeom.LABELS``.
      tied: None, ``"embedding"`` or ``"head"``: how a head tied to the embedding is trained
        (``"head"``: with the head optimizer, RowNorm uncentred). Said here or in the
        `Labeler` given as `labels`, not both.
      weight_decay: decoupled weight decay of the matrix groups (hidden, head, embedding; the
        router group takes the hidden group's); the vector group's default is 0.
      groups: per-group overrides, ``{"hidden" | "head" | "embedding" | "vector" | "router":
        GroupOptions(learning_rate=..., weight_decay=...)}`` (the head's rate: ``groups={"head":
        GroupOptions(learning_rate=...)}``).
      muon: `MuonOptions` (None: the defaults).
      adam: `AdamOptions` (None: the defaults).
      router: a router optimizer name (``"muon"``, ``"rownorm"``, ``"adamw"``) or
        `RouterOptions`.
      **deprecated: the flat keywords of 0.1.0 (`rowgeom.FLAT_KEYWORDS`), each moved into the
        field above it names, with a DeprecationWarning.

    Returns:
      An `LMHyperparams`: ``hp["head"]`` is the head's `GroupHyperparams`.

    Examples:
      >>> import rowgeom
      >>> hp = rowgeom.lm_optimizer_hparams(
      ...     1e-3, groups={"head": rowgeom.GroupOptions(weight_decay=0.0)})
      >>> hp["head"]
      GroupHyperparams(optimizer='rownorm', learning_rate=0.005, weight_decay=0.0, momentum=0.95)
      >>> rowgeom.lm_optimizer_hparams(1e-3, labels=rowgeom.Labeler(tied="head"),
      ...                              tied="embedding")
      Traceback (most recent call last):
      ...
      ValueError: lm_optimizer_hparams: tied='embedding' and labels=Labeler(tied='head') ...
    """
    options = dict(head=head, labels=labels, tied=tied, weight_decay=weight_decay,
                   groups=groups, muon=muon, adam=adam, router=router)
    return resolve_hparams(learning_rate, options, deprecated, caller="lm_optimizer_hparams",
                           stacklevel=2)


def hparams_of(learning_rate: Any, options: Mapping[str, Any], *, caller: str,
               stacklevel: int) -> LMHyperparams:
    """`lm_optimizer`'s and `describe`'s hyperparameters: an `LMHyperparams` as given (a
    ValueError names any option given beside it), else `learning_rate` and the options
    (`lm_optimizer_hparams`' keywords) resolved."""
    if isinstance(learning_rate, LMHyperparams):
        given = sorted(k for k, v in options.items() if not (k == "deprecated" and v == {}))
        if given:
            raise ValueError(f"{caller}: an LMHyperparams holds every option, and "
                             f"{', '.join(f'{k}=' for k in given)} set some again; pass "
                             "them to lm_optimizer_hparams instead")
        return learning_rate
    keywords = {k: v for k, v in options.items() if k in _KEYWORDS}
    flat = {k: v for k, v in options.items() if k not in _KEYWORDS}
    return resolve_hparams(learning_rate, {**_KEYWORDS, **keywords}, flat, caller=caller,
                           stacklevel=stacklevel + 1)


def resolve_hparams(learning_rate: Rate, options: dict[str, Any], flat: Mapping[str, Any], *,
                    caller: str, stacklevel: int) -> LMHyperparams:
    """The `LMHyperparams` of `lm_optimizer_hparams`' keywords (`options`) and the deprecated
    flat keywords (`flat`)."""
    options = apply_flat_keywords(options, flat, caller=caller, stacklevel=stacklevel + 1)
    head = _object(options["head"], HeadOptions, HEAD_OPTIMIZERS, "head")
    router = _object(options["router"], RouterOptions, ROUTER_OPTIMIZERS, "router")
    muon = _object(options["muon"], MuonOptions, (), "muon")
    adam = _object(options["adam"], AdamOptions, (), "adam")
    tied, labels = _tied_labels(options["tied"], options["labels"], caller)
    overrides = dict(options["groups"] or {})
    unknown = sorted(set(overrides) - set(LABELS))
    if unknown:
        raise ValueError(f"groups: unknown group(s) {unknown}; groups are {LABELS}")
    for group, value in overrides.items():
        if not isinstance(value, GroupOptions):
            raise TypeError(f"groups[{group!r}] must be a rowgeom.GroupOptions, got {value!r}")
    resolved = _group_hparams(learning_rate, options["weight_decay"], overrides, head=head,
                              muon=muon, adam=adam, router=router)
    return LMHyperparams(types.MappingProxyType(resolved), head, muon, adam, labels, tied,
                         router)


# The keywords of lm_optimizer_hparams (and lm_optimizer, describe) and their defaults.
_KEYWORDS = {name: p.default
             for name, p in inspect.signature(lm_optimizer_hparams).parameters.items()
             if p.kind == p.KEYWORD_ONLY}


def _object(value, kind: type, names: tuple[str, ...], argname: str):
    """An options object from its keyword: None -> the defaults, a name -> its optimizer."""
    if value is None:
        return kind()
    if names and isinstance(value, str):
        return kind(optimizer=one_of(value, names, argname))
    if not isinstance(value, kind):
        allowed = f"one of {names} or " if names else ""
        raise TypeError(f"{argname} must be {allowed}a rowgeom.{kind.__name__}, got {value!r}")
    return value


def _tied_labels(tied, labels, caller: str) -> tuple[str | None, Any]:
    """The tied policy, said once (here or in the `Labeler`), and the labelling with it."""
    one_of(tied, TIED_POLICIES, "tied")
    if isinstance(labels, (str, jax.Array)):
        # A callable `labels` passed to inject_hyperparams arrives here evaluated as a schedule.
        raise TypeError(f"labels must be None, a tree of labels or a callable, got {labels!r}; "
                        "under optax.inject_hyperparams list it in static_args "
                        "(rowgeom.STATIC_ARGS)")
    if labels is None:
        return tied, Labeler(tied=tied)
    if not isinstance(labels, Labeler):
        return tied, labels
    if labels.tied is not None and tied is not None:
        raise ValueError(f"{caller}: tied={tied!r} and labels=Labeler(tied={labels.tied!r}) "
                         "both set the tied policy; give it once")
    if tied is None:
        return labels.tied, labels
    return tied, dataclasses.replace(labels, tied=tied)


def _scaled(rate: Rate, factor: float) -> Rate:
    """`factor` times a learning rate; a schedule stays a schedule, None stays None."""
    if rate is None or factor == 1:
        return rate
    if callable(rate):
        return lambda count: factor * rate(count)
    return factor * rate


def _override(groups: Mapping[str, GroupOptions], group: str, field: str, derived: Rate) -> Rate:
    """A group's rate or decay: its `GroupOptions` override, else the derived value."""
    given = getattr(groups.get(group, GroupOptions()), field)
    return derived if given is None else given


def _group(groups: Mapping[str, GroupOptions], name: str, optimizer: str, rate: Rate,
           decay: Rate, momentum: Any) -> GroupHyperparams:
    """Group `name`'s settings: its `GroupOptions` overrides, else the derived rate and decay."""
    return GroupHyperparams(optimizer, _override(groups, name, "learning_rate", rate),
                            _override(groups, name, "weight_decay", decay), momentum)


def _group_hparams(lr: Rate, wd: Rate, groups: Mapping[str, GroupOptions], *, head: HeadOptions,
                   muon: MuonOptions, adam: AdamOptions, router: RouterOptions) -> dict:
    """Every group's rate, decay and momentum: the defaults' one home."""
    hidden = _group(groups, "hidden", "muon", lr, wd, muon.momentum)
    head_momentum = adam.b1 if head.optimizer == "adamw" else _or(head.momentum, EMA_MOMENTUM)
    router_momentum = {"muon": muon.momentum, "adamw": adam.b1,
                       "rownorm": _or(router.momentum, EMA_MOMENTUM)}[router.optimizer]
    head_rate = _scaled(lr, HEAD_LR_MULTIPLIERS[head.optimizer])
    return {
        "hidden": hidden,
        "head": _group(groups, "head", head.optimizer, head_rate, wd, head_momentum),
        "embedding": _group(groups, "embedding", "adamw", lr, wd, adam.b1),
        "vector": _group(groups, "vector", "adamw", lr, 0.0, adam.b1),
        "router": _group(groups, "router", router.optimizer, hidden.learning_rate,
                         hidden.weight_decay, router_momentum),
    }


def _or(value, fallback):
    return fallback if value is None else value
