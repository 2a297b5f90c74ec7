"""The deprecated spellings of rowgeom 0.1.0, each a thin alias of one canonical one.

CHANGELOG.md promises that a deprecated name keeps working, with one ``DeprecationWarning`` per
call, for at least one minor release. They all live here:

- `FLAT_KEYWORDS`: `lm_optimizer`'s flat keywords (``ns_steps=6``, ``head_num_valid=...``,
  ``head_learning_rate=...``), each one field of one options object, moved into it by
  `apply_flat_keywords` (the one table they map through);
- `make_labeler` (`Labeler` itself);
- `RENAMED`: the 0.1.0 names of the plan's types (``rowgeom.Description``, ``rowgeom.ParamRow``).
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Mapping
from typing import Any

from rowgeom._labels import Labeler
from rowgeom._options import AdamOptions, GroupOptions, HeadOptions, MuonOptions

FLAT_KEYWORDS = types.MappingProxyType({
    "hidden_learning_rate": ("groups", "hidden", "learning_rate"),
    "head_learning_rate": ("groups", "head", "learning_rate"),
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
"""Deprecated: `lm_optimizer`'s flat keywords and the options field each one sets.

``ns_steps=6`` is ``muon=MuonOptions(ns_steps=6)``, ``head_weight_decay=0`` is
``groups={"head": GroupOptions(weight_decay=0)}``, ``head_learning_rate=r`` is
``groups={"head": GroupOptions(learning_rate=r)}``. Each still works, with one
``DeprecationWarning`` per call naming the spelling to use. Setting a field twice is a
ValueError naming both spellings: a flat keyword of a `MuonOptions`, `HeadOptions` or
`AdamOptions` field next to that object (the object sets all its fields), or of a group's rate
or decay next to a ``groups`` entry that sets it.

Examples:
    >>> import warnings, rowgeom
    >>> rowgeom.FLAT_KEYWORDS["head_num_valid"]
    ('head', 'num_valid')
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     hp = rowgeom.lm_optimizer_hparams(1e-3, head_num_valid=50257)
    >>> hp.head.num_valid, caught[0].category.__name__
    (50257, 'DeprecationWarning')
"""

RENAMED = types.MappingProxyType({"Description": "OptimizerPlan", "ParamRow": "LeafPlan"})
"""Deprecated module attributes of ``rowgeom`` and the names that replace them."""

_OBJECTS = {"head": HeadOptions, "muon": MuonOptions, "adam": AdamOptions}


def _field(where: tuple[str, ...]) -> str:
    """The field a flat keyword sets: ``MuonOptions.ns_steps``, ``groups['head'].weight_decay``."""
    if where[0] == "groups":
        return f"groups[{where[1]!r}].{where[2]}"
    return f"{_OBJECTS[where[0]].__name__}.{where[1]}"


def _canonical(where: tuple[str, ...]) -> str:
    """The spelling that replaces a flat keyword: ``muon=rowgeom.MuonOptions(ns_steps=...)``."""
    if where[0] == "groups":
        return f"groups={{{where[1]!r}: rowgeom.GroupOptions({where[2]}=...)}}"
    return f"{where[0]}=rowgeom.{_OBJECTS[where[0]].__name__}({where[1]}=...)"


def _unpacked(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`flat` with optax.inject_hyperparams' var-keyword dict unpacked (it binds the extra
    keywords to the parameter's name and passes them back as one keyword holding a dict)."""
    flat = dict(flat)
    if isinstance(flat.get("deprecated"), dict):
        flat = {**flat.pop("deprecated"), **flat}
    return flat


def _conflict(where: tuple[str, ...], options: Mapping[str, Any]) -> str | None:
    """The other spelling of the field a flat keyword sets, when that one was given too."""
    if where[0] == "groups":
        group = (options.get("groups") or {}).get(where[1])
        if group is not None and getattr(group, where[2]) is not None:
            return f"groups={{{where[1]!r}: GroupOptions({where[2]}=...)}}"
        return None
    kind = _OBJECTS[where[0]]
    return f"{where[0]}={kind.__name__}(...)" if isinstance(options.get(where[0]), kind) else None


def _moved(options: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """`options` with each flat keyword's value moved into its object (a string `head` keeps
    its optimizer); an invalid value's error names the keywords that set it."""
    fields: dict[str, dict[str, Any]] = {"head": {}, "muon": {}, "adam": {}}
    groups = dict(options.get("groups") or {})
    for name, value in flat.items():
        where = FLAT_KEYWORDS[name]
        if where[0] == "groups":
            old = groups.get(where[1], GroupOptions())
            groups[where[1]] = dataclasses.replace(old, **{where[2]: value})
        else:
            fields[where[0]][where[1]] = value
    out = {**options, "groups": groups or options.get("groups")}
    for kind, values in fields.items():
        if not values:
            continue
        base = {"optimizer": options["head"]} if kind == "head" and options.get("head") else {}
        try:
            out[kind] = _OBJECTS[kind](**base, **values)
        except (TypeError, ValueError) as err:
            given = [k for k in flat if FLAT_KEYWORDS[k][0] == kind]
            raise type(err)(f"{err} (set by {', '.join(f'{k}=' for k in given)})") from None
    return out


def apply_flat_keywords(options: dict[str, Any], flat: Mapping[str, Any], *, caller: str,
                        stacklevel: int) -> dict[str, Any]:
    """`options` (the canonical keywords as given) with the deprecated flat keywords moved
    into their objects: one DeprecationWarning for the call, a TypeError for an unknown
    keyword, a ValueError naming both spellings for a field set twice."""
    flat = _unpacked(flat)
    if not flat:
        return options
    unknown = sorted(set(flat) - set(FLAT_KEYWORDS))
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {unknown}; the options are "
                        f"{sorted(options)} (and the deprecated {sorted(FLAT_KEYWORDS)})")
    for name in flat:
        where = FLAT_KEYWORDS[name]
        other = _conflict(where, options)
        if other is not None:
            raise ValueError(f"{caller}: {name}= and {other} both set {_field(where)}; give "
                             f"it once: {_canonical(where)}")
    spelled = "; ".join(f"{name}= -> {_canonical(FLAT_KEYWORDS[name])}" for name in flat)
    warnings.warn(f"{caller}: flat keywords are deprecated (rowgeom.FLAT_KEYWORDS): {spelled}",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return _moved(options, flat)


def make_labeler(**options: Any) -> Labeler:
    """Deprecated: ``Labeler(**options)`` (`Labeler` is the label function itself).

    Examples:
      >>> import warnings, rowgeom
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     labeler = rowgeom.make_labeler(extra_hidden_names={"router"})
      >>> labeler == rowgeom.Labeler(extra_hidden_names={"router"}), str(caught[0].message)
      (True, 'rowgeom.make_labeler is deprecated: use rowgeom.Labeler(...)')
    """
    warnings.warn("rowgeom.make_labeler is deprecated: use rowgeom.Labeler(...)",
                  DeprecationWarning, stacklevel=2)
    return Labeler(**options)


def renamed(name: str) -> str:
    """The replacement of a deprecated ``rowgeom`` attribute (with its warning), or
    AttributeError."""
    if name not in RENAMED:
        raise AttributeError(f"module 'rowgeom' has no attribute {name!r}")
    warnings.warn(f"rowgeom.{name} is deprecated; use rowgeom.{RENAMED[name]}",
                  DeprecationWarning, stacklevel=3)
    return RENAMED[name]
