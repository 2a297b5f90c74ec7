"""Which rowgeom modules `lm_optimizer(1e-3)`, `tx.init` and one jitted `tx.update` execute.

A small language-model tree (an embedding, one block, a norm, the head) goes through the three
calls under `sys.setprofile`; every rowgeom module a function of which runs is counted, with its
line count, split into the transforms' own modules and the recipe's (labels, structure, options,
plan, recipe: what builds the transforms). `tests/rowgeom/test_eager_build.py` asserts the bound.

A module none of whose functions runs is not counted, though the path may read it: `_names`
(the name sets, data only), and `_messages` and `_describe` (they run only when a tree is wrong
or a plan is printed).

Run: `python benchmarks/path_modules.py` (from the repository root).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's rowgeom

# The modules of the transforms themselves (and the array code they share); the rest of the
# path is the recipe's.
TRANSFORMS = frozenset({"_cpu", "_diagnostics", "_geometry", "_numerics", "_rownorm", "_router",
                        "_muon"})
RECIPE_TIER = frozenset({"_recipe"})  # options, plan and recipe


def small_lm() -> dict:
    """An embedding, one block (attention, MLP, norm), a final norm and the head."""
    z = lambda *shape: np.zeros(shape, np.float32)  # host arrays: nothing compiled to make them
    block = {"attn": {"query": {"kernel": z(16, 16)}, "out": {"kernel": z(16, 16)}},
             "mlp": {"up": {"kernel": z(16, 32)}, "down": {"kernel": z(32, 16)}},
             "norm": {"scale": z(16)}}
    return {"embed": {"embedding": z(64, 16)}, "layers": {"0": block},
            "final_norm": {"scale": z(16)}, "lm_head": {"kernel": z(16, 64)}}


def measure() -> dict[str, int]:
    """``{module name: its line count}`` of the rowgeom modules the three calls execute."""
    import rowgeom
    from rowgeom import _recipe

    _recipe._MEMO.clear()  # planned from scratch: the memo would skip the labels and structure
    root = pathlib.Path(rowgeom.__file__).parent
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            path = pathlib.Path(frame.f_code.co_filename)
            if path.is_relative_to(root):
                ran.add(path.relative_to(root).with_suffix("").as_posix())

    params = small_lm()
    sys.setprofile(profile)
    try:
        tx = rowgeom.lm_optimizer(1e-3)
        state = tx.init(params)
        # Lowered, not compiled: the library's Python all runs while tracing, none of it in
        # XLA's compile (about 2 s that would measure nothing more).
        jax.jit(tx.update).lower(params, state, params)
    finally:
        sys.setprofile(None)
    return {name: len((root / f"{name}.py").read_text().splitlines()) for name in sorted(ran)}


def main() -> None:
    modules = measure()
    for name, lines in modules.items():
        tier = "transform" if name in TRANSFORMS else "recipe tier" if name in RECIPE_TIER \
            else "labels, structure, tree"
        print(f"{name:18s} {lines:5d}  {tier}")
    outside = sum(n for m, n in modules.items() if m not in TRANSFORMS)
    recipe = sum(n for m, n in modules.items() if m in RECIPE_TIER)
    print(f"{len(modules)} modules; {outside} lines outside the transforms; "
          f"{recipe} in the recipe tier")


if __name__ == "__main__":
    main()
