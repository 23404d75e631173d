"""Marchenko–Pastur law, the BBP phase transition and Tracy–Widom edge (theory §5).

Conventions: a ``p x m`` noise matrix ``W`` with i.i.d. entries of variance
``sigma2``; the eigenvalues of ``W W^T / m`` follow the Marchenko–Pastur (MP)
law with ratio ``gamma = p / m``. A population spike ``1 + theta`` (in units of
``sigma2``) separates from the bulk iff ``theta > sqrt(gamma)`` (the BBP
threshold) and then sits at ``(1 + theta)(1 + gamma / theta)``.

References
----------
Marchenko, V. A. and Pastur, L. A. (1967). Distribution of eigenvalues for
some sets of random matrices. Math. USSR-Sbornik 1(4).
Baik, J., Ben Arous, G. and Péché, S. (2005). Phase transition of the largest
eigenvalue for nonnull complex sample covariance matrices. Ann. Probab. 33(5).
Baik, J. and Silverstein, J. W. (2006). Eigenvalues of large sample covariance
matrices of spiked population models. J. Multivariate Anal. 97(6).
Johnstone, I. M. (2001). On the distribution of the largest eigenvalue in
principal components analysis. Ann. Statist. 29(2).
Chiani, M. (2014). Distribution of the largest eigenvalue for real Wishart and
Gaussian random matrices and a simple approximation for the Tracy–Widom
distribution. J. Multivariate Anal. 129.
Gavish, M. and Donoho, D. L. (2014). The optimal hard threshold for singular
values is 4/sqrt(3). IEEE Trans. Inf. Theory 60(8).
"""

import functools
import math

import numpy as np
from scipy import optimize, stats

__all__ = [
    "mp_edges",
    "mp_pdf",
    "mp_cdf",
    "mp_quantile",
    "mp_median",
    "bbp_threshold",
    "spike_sample_eigenvalue",
    "debias_spike",
    "tracy_widom_quantile",
    "tracy_widom_sf",
    "johnstone_centring",
    "largest_eigenvalue_sf",
    "largest_eigenvalue_quantile",
    "estimate_noise_variance",
    "fit_mp_bulk",
]

_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(64)


def _check_ratio(ratio):
    ratio = float(ratio)
    if not np.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"ratio must be a finite positive number, got {ratio!r}.")
    return ratio


def _check_sigma2(sigma2):
    sigma2 = float(sigma2)
    if not np.isfinite(sigma2) or sigma2 <= 0:
        raise ValueError(f"sigma2 must be a finite positive number, got {sigma2!r}.")
    return sigma2


def mp_edges(ratio, sigma2=1.0):
    """Edges of the MP bulk, ``sigma2 * (1 -/+ sqrt(ratio))**2``.

    Parameters
    ----------
    ratio : float
        Aspect ratio ``gamma = p / m`` (> 0).
    sigma2 : float, default=1.0
        Noise variance of the entries.

    Returns
    -------
    lower, upper : float
        Support of the continuous part (for ``ratio > 1`` there is also an
        atom at 0 of mass ``1 - 1/ratio``).

    Examples
    --------
    >>> from rstar.marchenko_pastur import mp_edges
    >>> mp_edges(0.25)
    (0.25, 2.25)
    """
    ratio, sigma2 = _check_ratio(ratio), _check_sigma2(sigma2)
    root = np.sqrt(ratio)
    return float(sigma2 * (1 - root) ** 2), float(sigma2 * (1 + root) ** 2)


def mp_pdf(x, ratio, sigma2=1.0):
    """Density of the continuous part of the MP law.

    Parameters
    ----------
    x : array-like
    ratio : float
    sigma2 : float, default=1.0

    Returns
    -------
    ndarray, same shape as ``x``
        ``sqrt((b - x)(x - a)) / (2 pi sigma2 ratio x)`` on ``[a, b]``, else 0.
        For ``ratio > 1`` it integrates to ``1 / ratio`` (the atom at 0 is
        not included).

    Examples
    --------
    >>> from rstar.marchenko_pastur import mp_pdf
    >>> float(mp_pdf(5.0, 0.5))
    0.0
    """
    a, b = mp_edges(ratio, sigma2)
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    inside = (x > a) & (x < b)
    xi = x[inside]
    out[inside] = np.sqrt((b - xi) * (xi - a)) / (2 * np.pi * sigma2 * ratio * xi)
    return out


def mp_cdf(x, ratio, sigma2=1.0):
    """Cumulative distribution function of the MP law (atom at 0 included).

    Computed by Gauss–Legendre quadrature after the substitution
    ``x = mid - half * cos(phi)``, which removes the square-root singularities
    at both edges.

    Parameters
    ----------
    x : array-like
    ratio : float
    sigma2 : float, default=1.0

    Returns
    -------
    ndarray, same shape as ``x``

    Examples
    --------
    >>> from rstar.marchenko_pastur import mp_cdf
    >>> round(float(mp_cdf(10.0, 0.3)), 8)
    1.0
    """
    ratio, sigma2 = _check_ratio(ratio), _check_sigma2(sigma2)
    x = np.asarray(x, dtype=np.float64) / sigma2
    a, b = mp_edges(ratio)
    mid, half = (a + b) / 2, (b - a) / 2
    atom = max(0.0, 1.0 - 1.0 / ratio)
    xc = np.clip(x, a, b)
    phi_end = np.arccos(np.clip((mid - xc) / half, -1.0, 1.0))
    out = np.where(x < 0, 0.0, atom + _continuous_mass(phi_end, ratio, mid, half))
    out = np.where(x >= b, 1.0, out)
    return np.clip(out, 0.0, 1.0)


def mp_quantile(q, ratio, sigma2=1.0):
    """Quantile function of the MP law.

    Parameters
    ----------
    q : float in [0, 1]
    ratio : float
    sigma2 : float, default=1.0

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.marchenko_pastur import mp_quantile, mp_edges
    >>> bool(mp_quantile(1.0, 0.5) == mp_edges(0.5)[1])
    True
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q!r}.")
    return _check_sigma2(sigma2) * float(_unit_quantile(float(q), _check_ratio(ratio)))


def _continuous_mass(phi_end, ratio, mid, half):
    """The MP law's continuous mass below ``x = mid - half cos(phi_end)`` (``sigma2 = 1``), by Gauss–Legendre
    quadrature in ``phi`` on ``[0, phi_end]`` (``phi_end`` a float or an array: one set of nodes per entry)."""
    phi = (np.asarray(phi_end)[..., None] / 2) * (_GL_NODES + 1)
    xs = mid - half * np.cos(phi)
    with np.errstate(invalid="ignore", divide="ignore"):
        integrand = np.where(
            xs > 0, half**2 * np.sin(phi) ** 2 / (2 * np.pi * ratio * xs), 2 * half / (2 * np.pi * ratio)
        )
    return (np.asarray(phi_end) / 2) * (integrand @ _GL_WEIGHTS)


def _unit_cdf_inside(x, ratio, a, b, atom):
    """:func:`mp_cdf` (``sigma2 = 1``) at one point ``a <= x <= b``, without its array handling (the root finders
    below call it tens of thousands of times at large p, where that overhead dominated)."""
    mid, half = (a + b) / 2, (b - a) / 2
    phi_end = math.acos(min(1.0, max(-1.0, (mid - x) / half)))
    return min(1.0, max(0.0, atom + float(_continuous_mass(phi_end, ratio, mid, half))))


@functools.lru_cache(maxsize=4096)
def _unit_quantile(q, ratio):
    a, b = mp_edges(ratio)
    atom = max(0.0, 1.0 - 1.0 / ratio)
    if q <= atom:
        return 0.0
    if q >= 1.0:
        return b
    if q <= 0.0:
        return a
    return optimize.brentq(lambda x: _unit_cdf_inside(x, ratio, a, b, atom) - q, a, b, xtol=1e-13 * b, rtol=1e-12)


def mp_median(ratio, sigma2=1.0):
    """Median of the MP law (the Gavish–Donoho ``mu_beta`` for ``sigma2 = 1``).

    Parameters
    ----------
    ratio : float
    sigma2 : float, default=1.0

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.marchenko_pastur import mp_median
    >>> round(mp_median(1.0), 4)
    0.6528
    """
    return mp_quantile(0.5, ratio, sigma2)


def bbp_threshold(ratio):
    """BBP detectability threshold ``sqrt(ratio)`` for a population spike.

    A population eigenvalue ``1 + theta`` (units of the noise variance) gives
    a sample eigenvalue outside the bulk iff ``theta > sqrt(ratio)``; below it
    no spectral method can detect it.

    Parameters
    ----------
    ratio : float

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.marchenko_pastur import bbp_threshold
    >>> bbp_threshold(0.04)
    0.2
    """
    return float(np.sqrt(_check_ratio(ratio)))


def spike_sample_eigenvalue(theta, ratio):
    """Where a population spike ``1 + theta`` lands in the sample spectrum.

    ``(1 + theta)(1 + ratio / theta)`` above the BBP threshold, the bulk edge
    ``(1 + sqrt(ratio))**2`` below it (Baik & Silverstein 2006).

    Parameters
    ----------
    theta : array-like of non-negative floats
        Spike strengths in units of the noise variance.
    ratio : float

    Returns
    -------
    ndarray

    Examples
    --------
    >>> from rstar.marchenko_pastur import spike_sample_eigenvalue
    >>> float(spike_sample_eigenvalue(1.0, 0.25))
    2.5
    """
    ratio = _check_ratio(ratio)
    theta = np.asarray(theta, dtype=np.float64)
    edge = (1 + np.sqrt(ratio)) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        above = (1 + theta) * (1 + ratio / theta)
    return np.where(theta > np.sqrt(ratio), above, edge)


def debias_spike(eigenvalue, ratio):
    """Invert the BBP map: population spike ``theta`` from a sample eigenvalue.

    Solves ``(1 + theta)(1 + ratio/theta) = eigenvalue`` for the root above
    ``sqrt(ratio)``. Eigenvalues at or below the bulk edge give 0 (the spike is
    not identifiable).

    Parameters
    ----------
    eigenvalue : array-like
        Sample eigenvalues in units of the noise variance.
    ratio : float

    Returns
    -------
    ndarray
        ``theta >= 0``.

    Examples
    --------
    >>> from rstar.marchenko_pastur import debias_spike
    >>> float(debias_spike(2.5, 0.25))
    1.0
    """
    ratio = _check_ratio(ratio)
    lam = np.asarray(eigenvalue, dtype=np.float64)
    edge = (1 + np.sqrt(ratio)) ** 2
    b = lam - 1 - ratio
    disc = np.maximum(b**2 - 4 * ratio, 0.0)
    theta = (b + np.sqrt(disc)) / 2
    return np.where(lam > edge, theta, 0.0)


def tracy_widom_quantile(q):
    """Quantile of the Tracy–Widom law of order 1 (real case).

    Uses Chiani's (2014) shifted-gamma approximation
    ``TW1 ~ Gamma(k=46.446, scale=0.186054) - 9.84801``, accurate to about
    1e-2 in the quantiles used for testing.

    Parameters
    ----------
    q : float or array-like in (0, 1)

    Returns
    -------
    float or ndarray

    Examples
    --------
    >>> from rstar.marchenko_pastur import tracy_widom_quantile
    >>> round(float(tracy_widom_quantile(0.99)), 1)
    2.0
    """
    return stats.gamma.ppf(q, a=46.446, scale=0.186054) - 9.84801


def tracy_widom_sf(s):
    """Survival function ``P(TW1 > s)`` of the Tracy–Widom law of order 1.

    Same approximation as :func:`tracy_widom_quantile` (Chiani 2014).

    Parameters
    ----------
    s : float or array-like

    Returns
    -------
    float or ndarray

    Examples
    --------
    >>> from rstar.marchenko_pastur import tracy_widom_quantile, tracy_widom_sf
    >>> round(float(tracy_widom_sf(tracy_widom_quantile(0.95))), 3)
    0.05
    """
    return stats.gamma.sf(np.asarray(s, dtype=np.float64) + 9.84801, a=46.446, scale=0.186054)


def johnstone_centring(n_rows, n_columns):
    """Centre and scale of the largest eigenvalue of ``W W^T / m`` (unit noise).

    Johnstone (2001), real case, with the ``-1/2`` corrections:
    ``mu = (sqrt(m - 1/2) + sqrt(p - 1/2))^2 / m`` and
    ``s = (sqrt(m - 1/2) + sqrt(p - 1/2)) (1/sqrt(m - 1/2) + 1/sqrt(p - 1/2))^(1/3) / m``,
    so that ``(lambda_max - mu) / s`` is approximately TW1. ``m`` may be an
    effective (non-integer) number of columns.

    Parameters
    ----------
    n_rows : float
        ``p``, dimension of the statistic (>= 1).
    n_columns : float
        ``m``, number of independent columns (>= 1).

    Returns
    -------
    mu, scale : float

    Examples
    --------
    >>> from rstar.marchenko_pastur import johnstone_centring, mp_edges
    >>> mu, scale = johnstone_centring(100, 10000)
    >>> round(mu, 2), round(mp_edges(0.01)[1], 2), bool(scale < 0.01)
    (1.21, 1.21, True)
    """
    p, m = float(n_rows), float(n_columns)
    if not (p >= 1 and m >= 1):
        raise ValueError(f"n_rows and n_columns must be >= 1, got {n_rows!r}, {n_columns!r}.")
    sp, sm = np.sqrt(max(p - 0.5, 0.5)), np.sqrt(max(m - 0.5, 0.5))
    mu = (sm + sp) ** 2 / m
    scale = (sm + sp) * (1 / sm + 1 / sp) ** (1 / 3) / m
    return float(mu), float(scale)


# quantile midpoints of chi2_dof / dof, for averaging over an estimated noise variance
_N_NOISE_NODES = 129


@functools.lru_cache(maxsize=256)
def _noise_ratio_nodes(noise_dof):
    q = (np.arange(_N_NOISE_NODES) + 0.5) / _N_NOISE_NODES
    return stats.chi2.ppf(q, noise_dof) / noise_dof


def _check_noise_dof(noise_dof):
    if noise_dof is None:
        return None
    noise_dof = float(noise_dof)
    if not noise_dof > 0:
        raise ValueError(f"noise_dof must be > 0 or None, got {noise_dof!r}.")
    return None if not np.isfinite(noise_dof) or noise_dof > 1e8 else noise_dof


def largest_eigenvalue_sf(x, n_rows, n_columns, sigma2=1.0, noise_dof=None):
    """``P(lambda_max > x)`` for the largest eigenvalue of ``W W^T / m`` under pure noise.

    Johnstone's centring (:func:`johnstone_centring`) composed with the
    Tracy–Widom tail. When ``sigma2`` is itself an *estimate* with
    ``noise_dof`` degrees of freedom (``sigma2_hat / sigma2 ~ chi2(nu) / nu``,
    independent of the spectrum, as for a regression residual), the tail is
    averaged over that estimation error:
    ``P(lambda_max / sigma2_hat > x / sigma2_hat) = E_u[P(L > u x / sigma2_hat)]``
    with ``L`` the unit-noise largest eigenvalue and ``u ~ chi2(nu) / nu``,
    computed on 129 quantile midpoints of ``u``. Ignoring that error makes the
    test anti-conservative when ``nu`` is not much larger than
    ``((mu / s) * sqrt(2 / nu))^-2`` (e.g. the linear proxy at ``n ~ T d``).

    Parameters
    ----------
    x : float or array-like
        Eigenvalue(s), in the same units as ``sigma2``.
    n_rows, n_columns : float
        ``p`` and ``m``.
    sigma2 : float, default=1.0
        Noise variance (known, or estimated with ``noise_dof``).
    noise_dof : float or None, default=None
        Degrees of freedom of ``sigma2``; None or inf means known exactly.

    Returns
    -------
    float or ndarray

    Examples
    --------
    >>> from rstar.marchenko_pastur import largest_eigenvalue_sf
    >>> known = largest_eigenvalue_sf(1.25, 100, 10000)
    >>> estimated = largest_eigenvalue_sf(1.25, 100, 10000, noise_dof=200)
    >>> bool(known < 0.01 < estimated)
    True
    """
    mu, scale = johnstone_centring(n_rows, n_columns)
    sigma2 = _check_sigma2(sigma2)
    noise_dof = _check_noise_dof(noise_dof)
    t = np.asarray(x, dtype=np.float64) / sigma2
    if noise_dof is None:
        out = tracy_widom_sf((t - mu) / scale)
    else:
        u = _noise_ratio_nodes(noise_dof)
        out = np.mean(tracy_widom_sf((np.multiply.outer(t, u) - mu) / scale), axis=-1)
    return float(out) if np.ndim(out) == 0 else out


def largest_eigenvalue_quantile(n_rows, n_columns, q, sigma2=1.0, noise_dof=None):
    """Quantile of the largest eigenvalue of ``W W^T / m`` under pure noise.

    Johnstone's (2001) centring and scaling with the ``-1/2`` corrections,
    composed with the Tracy–Widom quantile; ``m = n_columns`` may be an
    effective (non-integer) number of columns. With ``noise_dof``, the
    quantile of ``sigma2 * lambda_max / sigma2_hat`` for an estimated
    variance (the inverse of :func:`largest_eigenvalue_sf`), i.e. the
    threshold to apply to an eigenvalue when ``sigma2`` is the estimate.

    Parameters
    ----------
    n_rows : float
        ``p``, dimension of the statistic.
    n_columns : float
        ``m``, number of independent columns.
    q : float in (0, 1)
        Probability level, e.g. ``1 - alpha``.
    sigma2 : float, default=1.0
    noise_dof : float or None, default=None
        Degrees of freedom of an estimated ``sigma2`` (None: known).

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.marchenko_pastur import largest_eigenvalue_quantile, mp_edges
    >>> bool(largest_eigenvalue_quantile(100, 10000, 0.99) > mp_edges(0.01)[1])
    True
    >>> bool(largest_eigenvalue_quantile(100, 10000, 0.99, noise_dof=200)
    ...      > largest_eigenvalue_quantile(100, 10000, 0.99))
    True
    """
    mu, scale = johnstone_centring(n_rows, n_columns)
    sigma2 = _check_sigma2(sigma2)
    noise_dof = _check_noise_dof(noise_dof)
    base = mu + scale * float(tracy_widom_quantile(q))
    if noise_dof is None:
        return sigma2 * float(base)
    target = 1.0 - q
    hi = base
    while largest_eigenvalue_sf(hi, n_rows, n_columns, 1.0, noise_dof) > target:
        hi = 2.0 * hi + scale
    return sigma2 * float(optimize.brentq(
        lambda t: largest_eigenvalue_sf(t, n_rows, n_columns, 1.0, noise_dof) - target, mu - 20 * scale, hi,
        xtol=1e-12 * max(mu, 1.0), rtol=1e-10))


#: Degrees of freedom of the MP-median noise estimate per eigenvalue-column pair:
#: 2/pi, the asymptotic efficiency of a median of (nearly independent) row
#: variances when m >> p. A Monte Carlo check over p = 8..64, p/m = 0.001..0.8
#: (600 white Wishart draws each) measured 0.27..0.66 of p*m; with it the
#: false-alarm rate of the sequential test at alpha = 1% stays within 0.4..1.0%
#: for p/m <= 0.1 and about 2% at p/m near 1 (1.2..3.9% when the estimation
#: error is ignored).
MEDIAN_EFFICIENCY = 2.0 / np.pi


def estimate_noise_variance(eigenvalues, n_columns, n_spikes=0, quantile=0.5):
    """Noise variance from the bulk of a spectrum by matching the MP median.

    The ``n_spikes`` largest eigenvalues are set aside; the median of the
    remaining ``p - k`` is divided by the median of the MP law with ratio
    ``(p - k) / m`` (Gavish & Donoho 2014, unknown-noise case, applied to the
    bulk only).

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
        Eigenvalues of ``W W^T / m`` (any order).
    n_columns : float
        ``m``, number of (effective) columns.
    n_spikes : int, default=0
    quantile : float in (0, 1), default=0.5
        Match this quantile of the bulk instead of the median (a lower one
        stays in the bulk when more than half of the eigenvalues left are
        undetected spikes).

    Returns
    -------
    float
        ``nan`` when fewer than one bulk eigenvalue is left, 0 for an all-zero
        bulk.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.marchenko_pastur import estimate_noise_variance
    >>> rng = np.random.default_rng(0)
    >>> W = 0.5 * rng.standard_normal((50, 5000))
    >>> lam = np.linalg.eigvalsh(W @ W.T / 5000)
    >>> round(estimate_noise_variance(lam, 5000), 2)
    0.25
    """
    lam = np.sort(np.asarray(eigenvalues, dtype=np.float64))[::-1]
    p = lam.size
    k = int(n_spikes)
    if k < 0:
        raise ValueError(f"n_spikes must be >= 0, got {n_spikes!r}.")
    bulk = lam[k:]
    if bulk.size < 1:
        return float("nan")
    ratio = (p - k) / float(n_columns)
    if ratio > 1 and _unit_quantile(quantile, ratio) <= 0:
        # more rows than columns: the law's atom at 0 holds this quantile; the non-zero eigenvalues are those of
        # the m x m companion, ratio * MP(1 / ratio)
        nonzero = bulk[:max(1, int(np.floor(float(n_columns))) - k)]
        level = float(np.median(nonzero)) if quantile == 0.5 else _empirical_quantile(np.sort(nonzero), quantile)
        if level <= 0:
            return 0.0
        return level / (ratio * _unit_quantile(quantile, 1.0 / ratio))
    if quantile == 0.5:
        med = float(np.median(bulk))
        if med <= 0:
            return 0.0
        return med / mp_median((p - k) / float(n_columns))
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile!r}.")
    level = _empirical_quantile(np.sort(bulk), quantile)
    if level <= 0:
        return 0.0
    return level / _unit_quantile(quantile, (p - k) / float(n_columns))



def _empirical_quantile(sorted_asc, q):
    return float(np.quantile(sorted_asc, q, method="hazen"))


def fit_mp_bulk(eigenvalues, n_columns, n_spikes=0, quantiles=(0.25, 0.75), sigma2=None, min_columns=None):
    """Fit both MP parameters (noise variance and ratio) to the quartiles of a bulk.

    When the bulk is wider than white noise with ``n_columns`` columns would
    give (e.g. the structured residual of a non-linear inversion), the
    effective ratio is found from the bulk's spread: the ratio of its upper to
    its lower quartile is matched to the MP law's, then the variance by the
    median. Quartiles are untouched by a few undetected spikes. The ratio is
    never below the nominal ``(p - k) / n_columns``.

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
        Nominal number of columns ``m``.
    n_spikes : int, default=0
        Largest eigenvalues ``k`` to set aside.
    quantiles : tuple of two floats, default=(0.25, 0.75)
    sigma2 : float or None, default=None
        A known noise variance: then only the ratio is fitted, from the lower
        quantile alone (``sigma2 * F^{-1}(q_low) = empirical q_low quantile``),
        which stays in the bulk even when most eigenvalues are spikes.
    min_columns : float or None, default=None
        A lower bound on the bulk's effective number of columns (e.g. the
        number of independent samples summed into the statistic): the fitted
        ratio is capped at ``(p - k) / min_columns`` (and at 1), so that
        spikes left among the quartiles cannot widen the bulk beyond what the
        data can produce.

    Returns
    -------
    sigma2 : float
    n_columns_eff : float
        ``(p - k) / ratio_eff``.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.marchenko_pastur import fit_mp_bulk
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((200, 2000))
    >>> lam = np.linalg.eigvalsh(W @ W.T / 2000)
    >>> s2, m_eff = fit_mp_bulk(lam, n_columns=20000)   # true m is 2000
    >>> round(s2, 1), bool(1500 < m_eff < 2500)
    (1.0, True)
    """
    lam = np.sort(np.asarray(eigenvalues, dtype=np.float64))[::-1]
    p = lam.size
    k = int(n_spikes)
    bulk = np.sort(lam[k:])
    q_lo, q_hi = quantiles
    if bulk.size < 4:
        return estimate_noise_variance(lam, n_columns, k), float(n_columns)
    ratio_nom = (p - k) / float(n_columns)
    if min_columns is not None and not float(min_columns) > 0:
        raise ValueError(f"min_columns must be > 0 or None, got {min_columns!r}.")
    max_ratio = 1.0 if min_columns is None else min(1.0, max(ratio_nom, (p - k) / float(min_columns)))
    low, med, high = (float(np.quantile(bulk, q, method="hazen")) for q in (q_lo, 0.5, q_hi))
    if low <= 0 or _unit_quantile(q_lo, ratio_nom) <= 0:
        # (fewer columns than rows: the law's atom at 0 holds the lower quartile, which then says nothing)
        return estimate_noise_variance(lam, n_columns, k), float(n_columns)
    if sigma2 is not None:
        sigma2 = _check_sigma2(sigma2)
        target = low / sigma2
        if target >= _unit_quantile(q_lo, ratio_nom):
            return sigma2, float(n_columns)
        if target <= _unit_quantile(q_lo, max_ratio):
            return sigma2, float((p - k) / max_ratio)
        ratio = optimize.brentq(lambda g: _unit_quantile(q_lo, g) - target, ratio_nom, max_ratio, xtol=1e-12,
                                rtol=1e-6)
        return sigma2, float((p - k) / ratio)
    observed = high / low

    def spread(ratio):
        return _unit_quantile(q_hi, ratio) / _unit_quantile(q_lo, ratio)

    ratio = ratio_nom
    if observed > spread(ratio_nom):
        hi = max_ratio
        if observed >= spread(hi):
            ratio = hi
        else:
            ratio = optimize.brentq(lambda g: spread(g) - observed, ratio_nom, hi, xtol=1e-12, rtol=1e-6)
    sigma2 = med / _unit_quantile(0.5, ratio)
    return float(sigma2), float((p - k) / ratio)
