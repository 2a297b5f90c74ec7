"""rowgeom: per-block update geometry for JAX/Optax language models.

Muon (spectral geometry) for hidden matrices, projected RowNorm (row-diameter
geometry, the softmax's Hilbert metric) for the LM head, and diagnostics that
measure a head step the way the softmax sees it.
"""

from rowgeom._clip import clip_row_diameter
from rowgeom._describe import describe, make_plan
from rowgeom._diagnostics import RowDiameterStats, read_row_diameter, track_row_diameter
from rowgeom._geometry import row_diameter, row_diameter_bounds
from rowgeom._hilbert import hilbert_distance, hilbert_perturbation
from rowgeom._labels import Labeler, label_params
from rowgeom._muon import (
    MuonDimensionNumbers,
    MuonOptions,
    muon_orthogonalize,
    newton_schulz,
    ns_coefficients,
)
from rowgeom._names import (
    DEFAULT_EMBEDDING_NAMES,
    DEFAULT_HEAD_NAMES,
    DEFAULT_HIDDEN_NAMES,
    DEFAULT_ROUTER_NAMES,
    DEFAULT_VECTOR_NAMES,
    LABELS,
    TOKEN_EMBEDDING_NAMES,
)
from rowgeom._partition import partition_by_label
from rowgeom._recipe import (
    HEAD_LR_MULTIPLIERS,
    STATIC_ARGS,
    AdamOptions,
    GroupOptions,
    HeadOptions,
    Plan,
    PlanRow,
    RouterOptions,
    group_options,
    lm_optimizer,
)
from rowgeom._rownorm import projected_rownorm, rownorm_direction

__version__ = "0.1.0"

__all__ = (
    "LABELS",
    "MuonDimensionNumbers",
    "RowDiameterStats",
    "clip_row_diameter",
    "hilbert_distance",
    "hilbert_perturbation",
    "label_params",
    "lm_optimizer",
    "muon_orthogonalize",
    "newton_schulz",
    "ns_coefficients",
    "partition_by_label",
    "projected_rownorm",
    "read_row_diameter",
    "row_diameter",
    "row_diameter_bounds",
    "rownorm_direction",
    "track_row_diameter",
    # Routing and composition (labels, options, the plan, each group's resolved options).
    "AdamOptions",
    "DEFAULT_EMBEDDING_NAMES",
    "DEFAULT_HEAD_NAMES",
    "DEFAULT_HIDDEN_NAMES",
    "DEFAULT_ROUTER_NAMES",
    "DEFAULT_VECTOR_NAMES",
    "GroupOptions",
    "HEAD_LR_MULTIPLIERS",
    "HeadOptions",
    "Labeler",
    "MuonOptions",
    "Plan",
    "PlanRow",
    "RouterOptions",
    "STATIC_ARGS",
    "TOKEN_EMBEDDING_NAMES",
    "describe",
    "group_options",
    "make_plan",
)

