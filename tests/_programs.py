"""Compile once per distinct lowered program, for the 8-device tests that trace one function in
several sharding modes: each mode still traces (runs the library's code) in its own context,
and modes whose lowering is the same StableHLO run one executable, each on its own arrays."""

import re

_PROGRAMS: dict = {}


def program_text(lowered) -> str:
    """The lowered StableHLO, its sharding-group ids numbered from 0 in order of appearance
    (jax numbers the groups across the process: labels, not part of the program)."""
    ids: dict[str, int] = {}
    return re.sub(r"group_id=(\d+)",
                  lambda m: f"group_id={ids.setdefault(m.group(1), len(ids))}",
                  lowered.as_text())


def compile_once(lowered, mesh):
    """`lowered.compile()`, compiled once per distinct program text on `mesh`'s devices."""
    key = (program_text(lowered), tuple(d.id for d in mesh.devices.flat))
    if key not in _PROGRAMS:
        _PROGRAMS[key] = lowered.compile()
    return _PROGRAMS[key]
