"""Assertions for property tests of a training setup that uses rowgeom.

chex-style checks that raise ``AssertionError`` naming the leaf path and the measured value:

- `assert_row_diameter_at_most`: the head step's row diameter ``D`` (exact, or the certified
  ``O(Vd)`` bracket at large vocabularies) is within a budget.
- `assert_rows_zero_sum`: the step lies in the softmax-invisible gauge ``1^T S = 0``.
- `assert_hilbert_perturbation_at_most`: the step's exact effect on the prediction at given
  hidden states is at most ``||h|| * bound``.
- `assert_labels_equal`: a labels tree (`rowgeom.label_params`) routes each parameter as
  intended, with a readable diff.
- `assert_optimizer_does_not_retrace`: the optimizer's jitted step compiles once
  (``chex.assert_max_traces``).

The exact float64 references of those properties, `diameter_oracle` and `common_ball_oracle`
(second-order cone programs for small vocabularies), need the ``oracle`` extra
(``pip install rowgeom[oracle]``), imported only when called.

Hypothesis strategies for the inputs these properties should hold on live in
``rowgeom.testing.strategies``, which needs the ``testing`` extra
(``pip install rowgeom[testing]``); this module does not import hypothesis.
"""

from rowgeom.testing._geometry import (
    assert_hilbert_perturbation_at_most,
    assert_row_diameter_at_most,
    assert_rows_zero_sum,
)
from rowgeom.testing._oracle import common_ball_oracle, diameter_oracle
from rowgeom.testing._retrace import assert_optimizer_does_not_retrace
from rowgeom.testing._routing import assert_labels_equal

__all__ = (
    "common_ball_oracle",
    "diameter_oracle",
    "assert_hilbert_perturbation_at_most",
    "assert_labels_equal",
    "assert_optimizer_does_not_retrace",
    "assert_row_diameter_at_most",
    "assert_rows_zero_sum",
)
