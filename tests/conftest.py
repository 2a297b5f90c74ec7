"""Strict test configuration shared by every test module.

- Rank promotion raises, so a silently broadcast axis is a test failure.
- Hypothesis: a `ci` profile (few examples, few shapes: JIT compiles dominate the suite's time)
  and a `thorough` profile (>= 1000 examples per property), chosen with HYPOTHESIS_PROFILE.
"""

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng():
    """A fresh, seeded numpy Generator per test (independent of test order)."""
    import numpy as np

    return np.random.default_rng(0)
