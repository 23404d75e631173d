"""Rank rules: a whitened spectrum -> (rank, threshold, effective rank) (theory §5).

A rule is a callable ``rule(ws, noise_variance=None) -> RuleResult`` where
``ws`` is an :class:`rstar.inversions.WhitenedStatistic`. New rules plug in
by subclassing :class:`RankRule`; the estimators never look inside.

Every rule reports ``effective_rank`` on the *noise-corrected* spectrum:
detected spikes are de-biased through the inverse BBP map (their population
strengths ``theta_i`` in units of the noise variance) and everything inside
the bulk counts as zero. The operator's singular values are proportional to
``sqrt(theta_i)``, so the entropy effective rank R_eff uses ``sqrt(theta)``
and the energy effective rank R̃_eff uses ``theta`` as energies — the paper's
"MP-corrected" effective ranks.
"""

from dataclasses import dataclass, field

import numpy as np

from .marchenko_pastur import debias_spike, estimate_noise_variance, fit_mp_bulk, largest_eigenvalue_quantile
from .spectral import (
    energy_effective_rank_from_singular_values,
    entropy_effective_rank_from_singular_values,
)
from .exceptions import UnidentifiableRankWarning

__all__ = ["RuleResult", "RankRule", "NumericalRule", "MarchenkoPasturRule", "EnergyRule", "sequential_spike_test"]


@dataclass
class RuleResult:
    """What a rank rule returns.

    Attributes
    ----------
    rank : int
    threshold : float
        The cut applied to the spectrum (same units as the eigenvalues).
    effective_rank : float
    noise_variance : float
        Noise variance used or estimated (nan if it could not be estimated).
    spike_strengths : ndarray of shape (rank,)
        BBP-debiased population spikes ``theta_i`` (units of noise variance).
    p_values : ndarray of shape (n_tested,)
        Approximate Tracy–Widom p-value of each sequential test
        (``k``-th entry: is eigenvalue ``k+1`` above the noise edge?).
    warnings : list of (Warning subclass, str)
    """

    rank: int
    threshold: float
    effective_rank: float
    noise_variance: float
    spike_strengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    p_values: np.ndarray = field(default_factory=lambda: np.zeros(0))
    warnings: list = field(default_factory=list)


def _roundoff_floor(lam):
    top = lam[0] if lam.size and lam[0] > 0 else 0.0
    return top * max(lam.size, 1) * np.finfo(np.float64).eps * 10


def _tw_p_value(lam_k, p_k, m, sigma2):
    """Approximate P(largest noise eigenvalue > lam_k) via Johnstone + Chiani."""
    from scipy import stats

    sp, sm = np.sqrt(max(p_k - 0.5, 0.5)), np.sqrt(max(m - 0.5, 0.5))
    mu = (sm + sp) ** 2 / m
    scale = (sm + sp) * (1 / sm + 1 / sp) ** (1 / 3) / m
    s = (lam_k / sigma2 - mu) / scale
    return float(stats.gamma.sf(s + 9.84801, a=46.446, scale=0.186054))


def sequential_spike_test(eigenvalues, n_columns, alpha=0.01, noise_variance=None, max_rank=None,
                          fit_bulk_width=False):
    """Count spikes above the noise edge by sequential Tracy–Widom tests.

    For ``k = 0, 1, ...``: estimate the noise variance from the ``p - k``
    smallest eigenvalues (MP-median matching, unless ``noise_variance`` is
    known), and accept eigenvalue ``k + 1`` as signal iff it exceeds the
    ``1 - alpha`` quantile of the largest eigenvalue of a ``(p - k) x m``
    white Wishart matrix (in the spirit of Kritchman & Nadler 2008). Stop at
    the first failure. Under pure noise the false-alarm rate is about
    ``alpha``.

    Parameters
    ----------
    eigenvalues : ndarray of shape (p,)
        Descending whitened eigenvalues.
    n_columns : float
        Effective number of columns ``m``.
    alpha : float in (0, 1), default=0.01
    noise_variance : float or None
    max_rank : int or None
    fit_bulk_width : bool, default=False
        Also fit the bulk's effective number of columns to the lower half of
        the remaining spectrum (:func:`rstar.marchenko_pastur.fit_mp_bulk`),
        for statistics whose bulk is wider than white noise; with a given
        ``noise_variance`` only the width is fitted (from the lower quartile).

    Returns
    -------
    RuleResult

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.rules import sequential_spike_test
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((30, 3000))
    >>> W[:2] *= 3.0                      # two population spikes, theta = 8
    >>> lam = np.linalg.eigvalsh(W @ W.T / 3000)[::-1]
    >>> res = sequential_spike_test(lam, 3000)
    >>> res.rank, round(res.noise_variance, 1)
    (2, 1.0)
    """
    lam = np.asarray(eigenvalues, dtype=np.float64)
    p = lam.size
    m = float(n_columns)
    k_max = p if max_rank is None else min(p, int(max_rank))
    floor = _roundoff_floor(lam)
    known = noise_variance is not None and not fit_bulk_width
    given_noise = noise_variance if fit_bulk_width else None
    m_k = m
    warnings = []
    p_values = []
    k = 0
    sigma2 = noise_variance
    threshold = np.inf
    while True:
        if not known:
            if p - k < 2:
                warnings.append((UnidentifiableRankWarning,
                                 f"only {p - k} eigenvalue(s) left in the bulk after {k} spike(s): the noise level "
                                 "cannot be estimated from the spectrum. Fallback: the remaining eigenvalues are "
                                 "not counted (pass noise_variance=... to decide them)."))
                break
            if fit_bulk_width:
                sigma2, m_k = fit_mp_bulk(lam, m, n_spikes=k, sigma2=given_noise)
            else:
                sigma2 = estimate_noise_variance(lam, m, n_spikes=k)
        if k >= k_max:
            break
        if sigma2 <= 0 or not np.isfinite(sigma2):
            threshold = floor
            if lam[k] > threshold:
                k += 1
                continue
            break
        threshold = max(largest_eigenvalue_quantile(p - k, m_k, 1 - alpha, sigma2), floor)
        p_values.append(_tw_p_value(lam[k], p - k, m_k, sigma2))
        if lam[k] > threshold:
            k += 1
            continue
        break
    if not known and k > p / 2 and p > 1:
        warnings.append((UnidentifiableRankWarning,
                         f"{k} of {p} eigenvalues are spikes: the noise level, estimated from the remaining "
                         "bulk, is unreliable when most of the spectrum is signal. Pass noise_variance=... if known."))
    sigma2 = float("nan") if sigma2 is None else float(sigma2)
    if np.isfinite(sigma2) and sigma2 > 0:
        theta = debias_spike(lam[:k] / sigma2, p / m_k)
    else:
        theta = np.maximum(lam[:k], 0.0)
    if not np.isfinite(threshold):
        threshold = float(lam[0]) if p else 0.0
    return RuleResult(k, float(threshold), entropy_effective_rank_from_singular_values(np.sqrt(theta)),
                      sigma2, theta, np.asarray(p_values), warnings)


class RankRule:
    """Base class of rank rules. Subclasses implement ``__call__``."""

    def __call__(self, ws, noise_variance=None, max_rank=None):  # pragma: no cover - abstract
        raise NotImplementedError


class MarchenkoPasturRule(RankRule):
    """Eigenvalues above the MP bulk edge (with a Tracy–Widom margin at level ``alpha``).

    The noise variance is, in order of preference: the user's, the
    inversion's residual estimate, or the MP-median match of the bulk. When
    the inversion flags a structured bulk (first-order softmax), the bulk's
    variance *and* width are fitted to the lower half of the spectrum.
    """

    def __init__(self, alpha=0.01):
        self.alpha = alpha

    def __call__(self, ws, noise_variance=None, max_rank=None):
        if noise_variance is None:
            noise_variance = ws.noise_variance
        return sequential_spike_test(ws.eigenvalues, ws.n_columns, self.alpha, noise_variance, max_rank,
                                     fit_bulk_width=ws.structured_bulk)


class EnergyRule(MarchenkoPasturRule):
    """Energy effective rank R̃_eff of the de-biased spikes, rounded half up.

    Spikes are detected as by :class:`MarchenkoPasturRule`; the rank is
    ``floor(R̃_eff + 1/2)`` of their strengths, which discounts weak spikes
    (the paper's choice for softmax kernels).
    """

    def __call__(self, ws, noise_variance=None, max_rank=None):
        res = super().__call__(ws, noise_variance, max_rank)
        energy = energy_effective_rank_from_singular_values(np.sqrt(res.spike_strengths))
        res.effective_rank = energy
        res.rank = int(np.floor(energy + 0.5))
        return res


class NumericalRule(RankRule):
    """Eigenvalues above a fixed tolerance (the paper's numerical rank).

    Parameters
    ----------
    tol : float or None
        Absolute tolerance in the units of the whitened spectrum.
    rtol : float, default=1e-2
        Relative tolerance: the cut is ``rtol * lambda_1`` when ``tol`` is None.
        Not noise-aware: pure noise gives full rank.
    """

    def __init__(self, tol=None, rtol=1e-2):
        self.tol, self.rtol = tol, rtol

    def __call__(self, ws, noise_variance=None, max_rank=None):
        lam = ws.eigenvalues
        p = lam.size
        floor = _roundoff_floor(lam)
        top = lam[0] if p else 0.0
        threshold = self.tol if self.tol is not None else max(self.rtol * top, floor)
        threshold = max(threshold, floor)
        k = int(np.sum(lam > threshold))
        if max_rank is not None:
            k = min(k, int(max_rank))
        if noise_variance is None:
            noise_variance = ws.noise_variance
        if noise_variance is None:
            noise_variance = estimate_noise_variance(lam, ws.n_columns, n_spikes=k) if p - k >= 1 else float("nan")
        return RuleResult(k, float(threshold), entropy_effective_rank_from_singular_values(np.sqrt(np.maximum(
            lam[:k], 0))), float(noise_variance), np.maximum(lam[:k], 0.0))
