"""Exact conic oracles: feasibility, Theorem 2 (closed form) and Theorem 3 (ratio bracket)."""

import sys

import numpy as np
import pytest

from rowgeom.testing import common_ball_oracle, diameter_oracle

pytest.importorskip("clarabel")


def np_diameter(s):
    s = np.asarray(s, np.float64)
    return float(np.sqrt(np.sum((s[:, None, :] - s[None, :, :]) ** 2, axis=-1)).max())


def centred(g):
    return g - g.mean(axis=0)


def jung_factor(k):
    return np.sqrt((k + 1) / (2 * k))


@pytest.mark.parametrize("shape,rank", [((6, 3), 3), ((8, 2), 2), ((9, 4), 1), ((7, 5), 3)])
def test_diameter_oracle_theorem_3(rng, shape, rank):
    v, d = shape
    g = rng.normal(size=(v, rank)) @ rng.normal(size=(rank, d)) + rng.normal(size=(1, d))
    rho = 1.7
    s, value = diameter_oracle(g, rho)
    assert s.shape == g.shape and s.dtype == np.float64
    assert np_diameter(s) <= rho * (1 + 1e-6)
    np.testing.assert_allclose(s.sum(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(value, -np.sum(g * s), rtol=1e-9)
    k = np.linalg.matrix_rank(centred(g))
    _, ball_value = common_ball_oracle(g, rho / 2)
    assert ball_value <= value * (1 + 1e-6)
    assert value <= ball_value / jung_factor(k) * (1 + 1e-6)


def test_diameter_oracle_beats_random_feasible_points(rng):
    g = rng.normal(size=(6, 3))
    rho = 1.0
    _, value = diameter_oracle(g, rho)
    for _ in range(200):
        s = rng.normal(size=g.shape)
        s = centred(s) * rho / np_diameter(s)  # feasible: D(s) = rho, 1^T s = 0
        assert -np.sum(g * s) <= value * (1 + 1e-7)


def test_antipodal_pair_has_ratio_one():
    g = np.array([[1.5], [-1.5]])  # V = 2, d = 1, rank 1, antipodal rows
    _, value = diameter_oracle(g, 2.0)
    _, ball_value = common_ball_oracle(g, 1.0)
    np.testing.assert_allclose(value, 3.0, rtol=1e-7)  # s = (-1, 1): D = 2
    np.testing.assert_allclose(ball_value / value, 1.0, rtol=1e-7)


@pytest.mark.parametrize("k", [2, 3])
def test_regular_simplex_attains_jung_factor(k):
    g = centred(np.eye(k + 1))  # k + 1 rows forming a regular simplex of rank k
    rho = 1.0
    _, value = diameter_oracle(g, rho)
    _, ball_value = common_ball_oracle(g, rho / 2)
    np.testing.assert_allclose(ball_value / value, jung_factor(k), rtol=1e-4)


@pytest.mark.parametrize("shape", [(7, 3), (10, 2)])
def test_common_ball_oracle_matches_theorem_2(rng, shape):
    g = rng.normal(size=shape) + 0.5  # not zero-sum: the gauge must remove 1^T G
    r = 0.8
    s, value = common_ball_oracle(g, r)
    pg = centred(g)
    norms = np.linalg.norm(pg, axis=1)
    np.testing.assert_allclose(value, r * norms.sum(), rtol=1e-5)
    u = pg / norms[:, None]
    np.testing.assert_allclose(s, -r * centred(u), atol=1e-6)  # unique: no zero rows of PG
    assert np_diameter(s) <= 2 * r * (1 + 1e-6)
    np.testing.assert_allclose(s.sum(axis=0), 0.0, atol=1e-9)


def test_gauge_makes_value_depend_on_pg_only(rng):
    g = rng.normal(size=(5, 2))
    shifted = g + np.array([[3.0, -2.0]])  # G + 1 c^T
    np.testing.assert_allclose(diameter_oracle(shifted, 1.0)[1], diameter_oracle(g, 1.0)[1],
                               rtol=1e-6)


def test_degenerate_and_bad_input():
    s, value = diameter_oracle(np.ones((1, 3)), 1.0)
    assert value == 0.0 and not s.any()
    s, value = common_ball_oracle(np.ones((4, 2)), 1.0)  # G = 1 c^T: PG = 0
    np.testing.assert_allclose(value, 0.0, atol=1e-8)
    with pytest.raises(ValueError, match=r"g must be a \(V, d\) matrix"):
        diameter_oracle(np.ones(3), 1.0)
    with pytest.raises(ValueError, match="rho must be a finite positive number"):
        diameter_oracle(np.ones((3, 2)), 0.0)
    with pytest.raises(ValueError, match="r must be a finite positive number"):
        common_ball_oracle(np.ones((3, 2)), float("nan"))
    with pytest.raises(ValueError, match="g must be finite"):
        common_ball_oracle(np.full((3, 2), np.inf), 1.0)


def test_missing_solver_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "clarabel", None)
    with pytest.raises(ImportError, match=r"pip install rowgeom\[oracle\]"):
        diameter_oracle(np.eye(3), 1.0)
