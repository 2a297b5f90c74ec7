"""Exact float64 reference solvers for the head-step problems (arXiv 2608.22253).

Both problems maximise the first-order decrease ``<-G, S>`` over updates in the canonical gauge
``1^T S = 0`` (no common-mode token row). On that subspace ``<-G, S> = <-PG, S>`` with
``P = I - 11^T/V``, so the objective uses ``PG`` and is finite for every ``G``.

- ``diameter_oracle``: ``OPT(rho) = max <-G, S>  s.t.  ||s_i - s_j|| <= rho  for all i < j``.
  Its dual is a vector min-cost flow with one ``d``-vector per token pair, impractical at
  ``V ~ 50k``; for small ``V`` it is a second-order cone program with ``V(V-1)/2`` cones.
- ``common_ball_oracle``: ``max <-G, S>  s.t.  exists c: ||s_i - c|| <= r``. Theorem 2 gives the
  closed form ``S* = -r P rownorm(PG)`` with value ``r sum_i ||(PG)_i||``; this solves the SOCP
  instead, so tests can check the closed form against an independent reference.

Theorem 3 links them: with ``r = rho/2`` and ``k = rank(PG)``,
``sqrt((k+1)/(2k)) OPT(rho) <= (rho/2) sum_i ||(PG)_i|| <= OPT(rho)`` (Jung's theorem).

These are test and analysis tools for ``V`` up to about 40; they need the ``oracle`` extra
(``pip install rowgeom[oracle]``: clarabel and scipy), imported only when called.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

_SOLVER_TOL = 1e-9  # tight: tests compare values at rel 1e-5 and feasibility at 1e-6


def _import_solver():
    try:
        import clarabel
        from scipy import sparse
    except ImportError as err:
        raise ImportError(
                "rowgeom's exact oracles need clarabel and scipy: "
                "pip install rowgeom[oracle]") from err
    return clarabel, sparse


def _check_problem(g: ArrayLike, radius: float, *, radius_name: str) -> np.ndarray:
    g = np.asarray(g)
    if g.ndim != 2:
        raise ValueError(f"g must be a (V, d) matrix, got shape {g.shape}")
    if not np.issubdtype(g.dtype, np.floating) and not np.issubdtype(g.dtype, np.integer):
        raise TypeError(f"g must be a real numeric array, got dtype {g.dtype}")
    g = g.astype(np.float64)
    if not np.all(np.isfinite(g)):
        raise ValueError("g must be finite")
    if not (isinstance(radius, (int, float, np.floating, np.integer))
            and math.isfinite(radius) and radius > 0):
        raise ValueError(f"{radius_name} must be a finite positive number, got {radius!r}")
    return g


def _solve(clarabel, sparse, cost, a_rows, b, cones, num_vars):
    """min cost^T x  s.t.  b - A x in cones; returns x (raises unless Solved)."""
    rows, cols, vals = (np.concatenate(part) for part in zip(*a_rows, strict=True))
    a = sparse.csc_matrix((vals, (rows, cols)), shape=(len(b), num_vars))
    p = sparse.csc_matrix((num_vars, num_vars))
    settings = clarabel.DefaultSettings()
    settings.verbose = False
    settings.tol_gap_abs = settings.tol_gap_rel = settings.tol_feas = _SOLVER_TOL
    settings.max_iter = 500
    solution = clarabel.DefaultSolver(p, cost, a, np.asarray(b, np.float64), cones,
                                      settings).solve()
    if solution.status != clarabel.SolverStatus.Solved:
        raise RuntimeError(f"clarabel did not solve the problem: status {solution.status}")
    return np.asarray(solution.x)


def _triplets(row_offset, var_index, coeff):
    """COO triplets placing ``coeff`` at rows ``row_offset + k``, columns ``var_index[k]``."""
    k = np.arange(len(var_index))
    return row_offset + k, np.asarray(var_index), np.full(len(var_index), float(coeff))


def _gauge_rows(num_rows, dim):
    """Zero cone rows: sum_i S[i, k] = 0 for every feature k (the gauge 1^T S = 0)."""
    var = np.arange(num_rows * dim).reshape(num_rows, dim)
    rows = np.tile(np.arange(dim), num_rows)
    return (rows, var.ravel(), np.ones(num_rows * dim)), dim


def _finish(g: np.ndarray, x: np.ndarray, num_rows: int, dim: int) -> tuple[np.ndarray, float]:
    """Exact gauge (removes solver-tolerance drift; D and feasibility unchanged) and value."""
    s = x[: num_rows * dim].reshape(num_rows, dim)
    s = s - s.mean(axis=0)
    return s, float(-np.sum(g * s))


def diameter_oracle(g: ArrayLike, rho: float) -> tuple[np.ndarray, float]:
    """Exact steepest descent under the row diameter, as a second-order cone program.

    Solves ``max_S <-G, S>  s.t.  ||s_i - s_j||_2 <= rho (all i < j),  1^T S = 0`` in float64.

    Args:
      g: ``(V, d)`` gradient (token rows first).
      rho: diameter budget, positive.

    Returns:
      ``(s, value)``: the optimal ``(V, d)`` float64 update and ``<-G, s>``.

    Raises:
      ImportError: without the ``oracle`` extra.
      RuntimeError: if the solver does not report an optimal solution.

    Examples:
      Gradient rows forming a regular simplex are the tight case of Theorem 3: the common-ball
      step (radius ``rho / 2``) reaches exactly ``sqrt((k+1)/(2k))`` of the optimum, ``k = 2``:

      >>> import numpy as np, rowgeom.testing
      >>> angles = 2 * np.pi * np.arange(3) / 3
      >>> g = np.stack([np.cos(angles), np.sin(angles)], axis=1)
      >>> s, opt = rowgeom.testing.diameter_oracle(g, rho=2.0)
      >>> _, ball = rowgeom.testing.common_ball_oracle(g, r=1.0)
      >>> round(opt, 4), round(ball / opt, 4), round(float(np.sqrt(3 / 4)), 4)
      (3.4641, 0.866, 0.866)
    """
    g = _check_problem(g, rho, radius_name="rho")
    num_rows, dim = g.shape
    if num_rows == 1 or dim == 0:
        return np.zeros_like(g), 0.0  # the gauge forces S = 0
    clarabel, sparse = _import_solver()
    pg = g - g.mean(axis=0)
    var = np.arange(num_rows * dim).reshape(num_rows, dim)
    gauge, offset = _gauge_rows(num_rows, dim)
    a_rows, b = [gauge], [0.0] * dim
    cones = [clarabel.ZeroConeT(dim)]
    for i in range(num_rows - 1):
        for j in range(i + 1, num_rows):
            # cone (rho, s_i - s_j): first slack row is b = rho, then b - A x = s_i - s_j.
            a_rows.append(_triplets(offset + 1, var[i], -1.0))
            a_rows.append(_triplets(offset + 1, var[j], 1.0))
            b += [float(rho)] + [0.0] * dim
            cones.append(clarabel.SecondOrderConeT(dim + 1))
            offset += dim + 1
    x = _solve(clarabel, sparse, pg.ravel(), a_rows, b, cones, num_rows * dim)
    return _finish(g, x, num_rows, dim)


def common_ball_oracle(g: ArrayLike, r: float) -> tuple[np.ndarray, float]:
    """Exact optimum of the common-ball relaxation, as a second-order cone program.

    Solves ``max_{S, c} <-G, S>  s.t.  ||s_i - c||_2 <= r (all i),  1^T S = 0`` in float64,
    independently of Theorem 2's closed form ``-r P rownorm(PG)`` (value ``r sum ||(PG)_i||``).

    Args:
      g: ``(V, d)`` gradient (token rows first).
      r: ball radius, positive (``D(S) <= 2r``).

    Returns:
      ``(s, value)`` as `diameter_oracle` returns them, with the same errors (no ``oracle``
      extra, or a solver that reports no optimal solution).

    Examples:
      The value matches Theorem 2's closed form ``r sum_i ||(PG)_i||``:

      >>> import numpy as np, rowgeom.testing
      >>> g = np.array([[2.0, 0.0], [0.0, 1.0], [-2.0, -1.0]])
      >>> s, value = rowgeom.testing.common_ball_oracle(g, r=0.5)
      >>> pg = g - g.mean(axis=0)
      >>> round(value, 5) == round(0.5 * float(np.linalg.norm(pg, axis=1).sum()), 5)
      True
    """
    g = _check_problem(g, r, radius_name="r")
    num_rows, dim = g.shape
    if num_rows == 1 or dim == 0:
        return np.zeros_like(g), 0.0
    clarabel, sparse = _import_solver()
    pg = g - g.mean(axis=0)
    var = np.arange(num_rows * dim).reshape(num_rows, dim)
    centre = num_rows * dim + np.arange(dim)  # c is appended after vec(S)
    gauge, offset = _gauge_rows(num_rows, dim)
    a_rows, b = [gauge], [0.0] * dim
    cones = [clarabel.ZeroConeT(dim)]
    for i in range(num_rows):
        a_rows.append(_triplets(offset + 1, var[i], -1.0))
        a_rows.append(_triplets(offset + 1, centre, 1.0))
        b += [float(r)] + [0.0] * dim
        cones.append(clarabel.SecondOrderConeT(dim + 1))
        offset += dim + 1
    cost = np.concatenate([pg.ravel(), np.zeros(dim)])
    x = _solve(clarabel, sparse, cost, a_rows, b, cones, num_rows * dim + dim)
    return _finish(g, x, num_rows, dim)
