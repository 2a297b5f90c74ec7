"""Logical axis names and the one table that maps them onto the mesh.

The model names the axes of every parameter and activation by what they mean (`"embed"`,
`"mlp"`, `"activation_batch"`, ...), never by mesh axis; `RULES` says which mesh axes each name
is split over, in the style of MaxText's `logical_axis_rules` and flax's logical partitioning.
Parameters and activations read the same table, so changing a row moves both.

- Parameters (`param_spec`): FSDP splits each matrix along its model-width axis (`"embed"`) over
  `"fsdp"`; tensor parallelism splits heads, MLP width and vocabulary over `"tensor"` (Megatron
  layout); a scanned stack's layer axis and norm scales are not split.
- Activations (`constrain`): the batch over `("data", "fsdp")`, heads / MLP width / vocabulary
  over `"tensor"`, the residual stream's model axis unsplit. Without these constraints the
  partitioner follows the parameters' FSDP sharding into the activations and then all-reduces
  and all-gathers whole global-batch activations.

A mesh axis that does not divide a dimension is dropped for that dimension (`mesh.fit_spec`), so
a small model or an odd vocabulary still runs on a large mesh (that dimension is then replicated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from examples.lm import mesh as mesh_lib

# logical name -> mesh axes (None: not split). Every name the model uses must be here.
RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "embed": "fsdp",        # a matrix's model-width axis: FSDP shards weights along it
    "heads": "tensor",      # attention projections' head axis (heads x head width, flattened)
    "mlp": "tensor",        # MLP width
    "vocab": "tensor",      # the head's and the embedding's vocabulary axis
    "norm": None,           # norm scales (tiny: replicated)
    "layers": None,         # the layer axis of a scanned stack
    # activations
    "activation_batch": ("data", "fsdp"),
    "activation_length": None,
    "activation_embed": None,  # the residual stream: whole on every device
    "activation_heads": "tensor",
    "activation_head_dim": None,
    "activation_mlp": "tensor",
    "activation_vocab": "tensor",
}


def mesh_axes(names: Sequence[str | None]) -> P:
    """The PartitionSpec of logical `names` by `RULES` (None stays None)."""
    unknown = [n for n in names if n is not None and n not in RULES]
    if unknown:
        raise KeyError(f"logical axis names {unknown} are not in examples.lm.sharding.RULES "
                       f"(known: {sorted(RULES)})")
    return P(*(None if n is None else RULES[n] for n in names))


def param_spec(shape: Sequence[int], names: Sequence[str | None], mesh) -> P:
    """A parameter's PartitionSpec on `mesh` from its logical axis names."""
    return mesh_lib.fit_spec(tuple(shape), mesh_axes(names), mesh)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`x` constrained to the sharding its logical axis `names` map to on the current mesh.

    Inside `jax.set_mesh` (where the trainer traces) this is `with_sharding_constraint`;
    without a mesh (one device, unit tests) it returns `x` unchanged.
    """
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} axis names {names} for an array of shape "
                         f"{x.shape}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, mesh_lib.fit_spec(x.shape, mesh_axes(names), mesh))


def num_shards(dim: int, name: str) -> int:
    """Into how many pieces an axis of size `dim` with logical `name` is split on the current
    mesh (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    entry = mesh_lib.fit_spec((dim,), mesh_axes((name,)), mesh)[0]
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return math.prod(mesh.shape[a] for a in axes)
