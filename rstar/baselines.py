"""Published rank-selection baselines, applied to a whitened spectrum.

Each baseline is a pure function ``name(eigenvalues, n_columns, ...) -> int``
of the descending eigenvalues ``lambda_1 >= ... >= lambda_p`` of a ``p x p``
statistic ``W W^T / m`` built from a ``p x m`` data matrix ``W``
(``m = n_columns`` effective columns, possibly non-integer). This is exactly
what an inversion of :mod:`rstar.inversions` produces
(:class:`~rstar.inversions.WhitenedStatistic` ``.eigenvalues`` and
``.n_columns``), so the baselines see the *same* statistic as rstar's rank
rules. Only ``q = min(p, floor(m))`` eigenvalues can be non-zero; the
baselines use those.

:class:`BaselineRule` wraps any of them in the :class:`rstar.rules.RankRule`
interface, and :func:`baseline_ranks` applies all of them at once to a
``WhitenedStatistic`` or to a fitted rstar estimator (``spectrum_`` and
``n_columns_``).

All four are written from the equations of the papers cited in each
docstring; no published code is copied.

References
----------
Gavish, M. and Donoho, D. L. (2014). The optimal hard threshold for singular
values is 4/sqrt(3). IEEE Trans. Inf. Theory 60(8), 5040-5053.
Minka, T. P. (2000). Automatic choice of dimensionality for PCA. NIPS 13,
598-604.
Kritchman, S. and Nadler, B. (2008). Determining the number of components in
a factor model from limited noisy data. Chemometr. Intell. Lab. Syst. 94(1),
19-32.
Kritchman, S. and Nadler, B. (2009). Non-parametric detection of the number
of signals: hypothesis testing and random matrix theory. IEEE Trans. Signal
Process. 57(10), 3930-3941.
Ahn, S. C. and Horenstein, A. R. (2013). Eigenvalue ratio test for the number
of factors. Econometrica 81(3), 1203-1227.
"""

import numpy as np
from scipy.special import gammaln

from .marchenko_pastur import johnstone_centring, mp_median
from .inversions import WishartNull
from .rules import RankRule, RuleResult

__all__ = [
    "gavish_donoho_coefficient",
    "gavish_donoho_threshold",
    "gavish_donoho_rank",
    "minka_log_evidence",
    "minka_rank",
    "kritchman_nadler_noise_variance",
    "kritchman_nadler_rank",
    "eigenvalue_ratio_rank",
    "BASELINES",
    "BaselineRule",
    "baseline_ranks",
]


def _prepare(eigenvalues, n_columns):
    """Descending eigenvalues (negatives from round-off set to 0), m and q."""
    lam = np.sort(np.asarray(eigenvalues, dtype=np.float64).ravel())[::-1]
    if lam.size == 0:
        raise ValueError("eigenvalues must be a non-empty 1-D array.")
    if not np.all(np.isfinite(lam)):
        raise ValueError("eigenvalues must be finite.")
    m = float(n_columns)
    if not np.isfinite(m) or m < 1:
        raise ValueError(f"n_columns must be a finite number >= 1, got {n_columns!r}.")
    lam = np.maximum(lam, 0.0)
    q = int(min(lam.size, max(np.floor(m), 1)))
    return lam, m, q


# ---------------------------------------------------------------------------
# (a) Gavish & Donoho (2014): optimal hard threshold for singular values
# ---------------------------------------------------------------------------


def gavish_donoho_coefficient(beta):
    """Gavish–Donoho optimal hard-threshold coefficient ``lambda*(beta)``.

    ``lambda*(beta) = sqrt(2 (beta + 1) + 8 beta / ((beta + 1) + sqrt(beta**2 + 14 beta + 1)))``
    (Gavish & Donoho 2014, the optimal coefficient for known noise), for the aspect ratio
    ``beta = min(p, m) / max(p, m)`` in ``(0, 1]``. With a known noise level
    ``sigma`` the optimal threshold on the singular values of the ``p x m``
    matrix is ``lambda*(beta) sqrt(max(p, m)) sigma``.

    Parameters
    ----------
    beta : float in (0, 1]

    Returns
    -------
    float

    Examples
    --------
    >>> from rstar.baselines import gavish_donoho_coefficient
    >>> round(gavish_donoho_coefficient(1.0), 4)   # 4 / sqrt(3)
    2.3094
    """
    beta = float(beta)
    if not 0 < beta <= 1:
        raise ValueError(f"beta must be in (0, 1], got {beta!r}.")
    return float(np.sqrt(2 * (beta + 1) + 8 * beta / ((beta + 1) + np.sqrt(beta**2 + 14 * beta + 1))))


def gavish_donoho_threshold(eigenvalues, n_columns, noise_variance=None):
    """Gavish–Donoho threshold, returned in the units of the eigenvalues.

    Singular values of the ``p x m`` matrix (up to the common factor
    ``sqrt(m)``) are ``s_i = sqrt(lambda_i)``, ``i <= q = min(p, m)``, and
    ``beta = min(p, m) / max(p, m)``.

    - Unknown noise (Gavish & Donoho 2014, the unknown-noise threshold): the cut
      on the singular values is ``omega(beta) * median(s)`` with
      ``omega(beta) = lambda*(beta) / sqrt(mu_beta)``, where ``mu_beta`` is
      the median of the Marchenko–Pastur law of ratio ``beta``
      (:func:`rstar.marchenko_pastur.mp_median`). It is scale-free.
    - Known noise variance ``sigma**2`` of the entries of ``W``: the cut on
      the singular values of ``W`` is ``lambda*(beta) sqrt(max(p, m)) sigma``
      (``sqrt`` of the *larger* dimension, their ``sqrt(n)`` with
      ``n >= m``). Note: the PyPI package ``optht`` multiplies by the
      square root of the *smaller* dimension instead (it uses the number of
      singular values), which puts the cut inside the noise bulk whenever
      the matrix is far from square. In eigenvalue units the cut is
      ``lambda*(beta)**2 sigma**2 max(p, m) / m``.

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
        Eigenvalues of ``W W^T / m``.
    n_columns : float
        ``m``.
    noise_variance : float or None, default=None
        Known ``sigma**2`` (same units as the eigenvalues: pure noise gives
        an MP bulk around it); None uses the median rule.

    Returns
    -------
    threshold : float
        Eigenvalues strictly above it are signal.

    Examples
    --------
    >>> from rstar.baselines import gavish_donoho_threshold
    >>> round(gavish_donoho_threshold([4.0, 1.0, 1.0, 1.0], 100, noise_variance=1.0), 4)
    2.2198
    """
    lam, m, q = _prepare(eigenvalues, n_columns)
    p = lam.size
    beta = min(p, m) / max(p, m)
    coef = gavish_donoho_coefficient(beta)
    if noise_variance is not None:
        sigma2 = float(noise_variance)
        if not np.isfinite(sigma2) or sigma2 < 0:
            raise ValueError(f"noise_variance must be a finite number >= 0, got {noise_variance!r}.")
        return float(coef**2 * sigma2 * max(p, m) / m)
    s = np.sqrt(lam[:q])
    omega = coef / np.sqrt(mp_median(beta))
    return float((omega * np.median(s)) ** 2)


def gavish_donoho_rank(eigenvalues, n_columns, noise_variance=None):
    """Rank by the Gavish–Donoho (2014) optimal hard threshold.

    Counts the singular values ``sqrt(lambda_i)`` above the threshold of
    :func:`gavish_donoho_threshold` (unknown noise: ``omega(beta)`` times the
    median singular value; known noise: ``lambda*(beta) sqrt(max(p, m)) sigma``).
    The threshold minimises the asymptotic mean squared error of the
    reconstruction, so it sits above the BBP detection edge: spikes just
    above the edge are deliberately dropped.

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
    noise_variance : float or None, default=None

    Returns
    -------
    int

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.baselines import gavish_donoho_rank
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((20, 2000))
    >>> W[:2] *= 3.0                      # two strong directions
    >>> lam = np.linalg.eigvalsh(W @ W.T / 2000)
    >>> gavish_donoho_rank(lam, 2000)
    2
    """
    lam, m, q = _prepare(eigenvalues, n_columns)
    tau = gavish_donoho_threshold(lam, m, noise_variance)
    return int(np.sum(lam[:q] > tau))


# ---------------------------------------------------------------------------
# (b) Minka (2000): Laplace approximation to the PPCA evidence
# ---------------------------------------------------------------------------


def minka_log_evidence(eigenvalues, n_columns, k):
    """Minka's (2000) Laplace approximation to ``log p(D | k)`` for PPCA.

    With ``d = p`` dimensions, ``N = n_columns`` samples and the sample
    covariance eigenvalues ``lambda_j`` (Minka 2000, the Laplace
    approximation of his Sec. 3)::

        log p(D|k) = log p(U) - N/2 sum_{j<=k} log lambda_j
                     - N (d-k)/2 log v + (m_k + k)/2 log(2 pi)
                     - 1/2 log|A_Z| - k/2 log N

    where ``v = sum_{j>k} lambda_j / (d - k)``, ``m_k = d k - k (k+1)/2``,
    ``log p(U) = -k log 2 + sum_{i<=k} [lgamma((d-i+1)/2) - (d-i+1)/2 log pi]``
    and ``log|A_Z| = sum_{i<=k} sum_{j>i} log(N (1/lhat_j - 1/lhat_i)(lambda_i - lambda_j))``
    with ``lhat_j = lambda_j`` for ``j <= k`` and ``v`` otherwise. The
    formula is invariant to a common scale of the eigenvalues. ``k = 0``
    reduces to the isotropic model, ``-N d / 2 log v``.

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
        ``N``, the number of samples (here the effective columns ``m``).
    k : int in [0, p - 1]

    Returns
    -------
    float
        ``-inf`` when the model is degenerate (a zero or tied retained
        eigenvalue, or a zero residual variance).

    Examples
    --------
    >>> from rstar.baselines import minka_log_evidence
    >>> lam = [10.0, 1.1, 1.0, 0.9]
    >>> bool(minka_log_evidence(lam, 500, 1) > minka_log_evidence(lam, 500, 0))
    True
    """
    lam, N, _ = _prepare(eigenvalues, n_columns)
    d = lam.size
    k = int(k)
    if not 0 <= k < d:
        raise ValueError(f"k must be in [0, {d - 1}], got {k!r}.")
    v = float(np.sum(lam[k:])) / (d - k)
    if v <= 0 or (k > 0 and lam[k - 1] <= 0):
        return -np.inf
    i = np.arange(1, k + 1)
    log_pu = -k * np.log(2.0) + float(np.sum(gammaln((d - i + 1) / 2.0) - (d - i + 1) / 2.0 * np.log(np.pi)))
    log_lik = -N / 2.0 * float(np.sum(np.log(lam[:k]))) - N * (d - k) / 2.0 * np.log(v)
    m_k = d * k - k * (k + 1) / 2.0
    log_vol = (m_k + k) / 2.0 * np.log(2 * np.pi)
    lhat = np.concatenate([lam[:k], np.full(d - k, v)])
    log_az = 0.0
    for a in range(k):
        j = np.arange(a + 1, d)
        factor = (1.0 / lhat[j] - 1.0 / lhat[a]) * (lam[a] - lam[j])
        if np.any(factor <= 0):
            return -np.inf
        log_az += float(np.sum(np.log(factor))) + j.size * np.log(N)
    return float(log_pu + log_lik + log_vol - log_az / 2.0 - k / 2.0 * np.log(N))


def minka_rank(eigenvalues, n_columns, allow_zero=True, max_rank=None):
    """Rank by Minka's (2000) Bayesian model selection for PCA.

    ``argmax_k`` of :func:`minka_log_evidence` over ``k = 0 .. q - 1``
    (``q = min(p, floor(m))``; ``k = p`` has no residual variance). This is
    what ``sklearn.decomposition.PCA(n_components="mle")`` computes, with
    ``N`` the number of samples; scikit-learn excludes ``k = 0``
    (``allow_zero=False`` reproduces it exactly). Here ``k = 0`` (isotropic
    noise, no component) is allowed by default so that pure noise can be
    called rank 0.

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
        ``N``: the effective number of columns ``m`` of the statistic.
    allow_zero : bool, default=True
    max_rank : int or None, default=None

    Returns
    -------
    int

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.baselines import minka_rank
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((20, 2000))
    >>> W[:3] *= 2.0
    >>> minka_rank(np.linalg.eigvalsh(W @ W.T / 2000), 2000)
    3
    """
    lam, m, q = _prepare(eigenvalues, n_columns)
    k_max = q - 1
    if max_rank is not None:
        k_max = min(k_max, int(max_rank))
    ks = range(0 if allow_zero else 1, k_max + 1)
    best_k, best = 0, -np.inf
    for k in ks:
        ll = minka_log_evidence(lam, m, k)
        if ll > best:
            best_k, best = k, ll
    return int(best_k)


# ---------------------------------------------------------------------------
# (c) Kritchman & Nadler (2008, 2009): sequential Tracy–Widom tests
# ---------------------------------------------------------------------------


def _kn_tw_quantile(alpha):
    """Right-tail Tracy–Widom (beta = 1) quantile used by Kritchman & Nadler.

    From the tail asymptotics ``P(TW1 > s) ~ exp(-2/3 s**1.5) / (4 sqrt(pi) s**1.5)``
    they drop the power and take ``s(alpha) = (-3/2 log(4 sqrt(pi) alpha))**(2/3)``
    (2.93 at alpha = 0.5%, against the exact 2.42: a slightly more
    conservative test than its nominal level).
    """
    return float((-1.5 * np.log(4 * np.sqrt(np.pi) * alpha)) ** (2.0 / 3.0))


def kritchman_nadler_noise_variance(eigenvalues, n_columns, n_signals, max_iter=30, tol=1e-5):
    """Kritchman & Nadler's consistent noise-variance estimate given ``k`` signals.

    Solves jointly (Kritchman & Nadler 2008, 2009: their consistent noise
    estimator) for the noise
    variance ``sigma2`` and the population signal eigenvalues ``rho_j``,
    ``j <= k``:

    - ``rho_j**2 - rho_j (lambda_j + sigma2 - sigma2 (p - k)/m) + lambda_j sigma2 = 0``
      (the inverse of the spiked-model bias ``lambda = rho + (p-k)/m sigma2 rho / (rho - sigma2)``,
      larger root),
    - ``sigma2 = (sum_{j>k} lambda_j + sum_{j<=k} (lambda_j - rho_j)) / (p - k)``
      (the trace the signal eigenvalues borrowed from the noise is given back),

    by fixed-point iteration from ``sigma2 = mean(lambda_{k+1..p}) / (1 - k/m)``,
    stopping when the relative change is below ``tol`` or when the quadratic
    has no real root (the current value is then kept).

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
    n_signals : int in [0, p - 1]
    max_iter : int, default=30
    tol : float, default=1e-5

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.baselines import kritchman_nadler_noise_variance
    >>> rng = np.random.default_rng(0)
    >>> W = 0.5 * rng.standard_normal((50, 500))
    >>> W[0] *= 6.0
    >>> lam = np.linalg.eigvalsh(W @ W.T / 500)
    >>> round(kritchman_nadler_noise_variance(lam, 500, 1), 2)
    0.25
    """
    lam, m, _ = _prepare(eigenvalues, n_columns)
    p = lam.size
    k = int(n_signals)
    if not 0 <= k < p:
        raise ValueError(f"n_signals must be in [0, {p - 1}], got {n_signals!r}.")
    tail = float(np.sum(lam[k:]))
    sigma2 = tail / (p - k) / max(1.0 - k / m, 1e-12)
    if k == 0:
        return tail / p
    top = lam[:k]
    for _ in range(max_iter):
        b = top + sigma2 - (p - k) / m * sigma2
        disc = b**2 - 4 * top * sigma2
        if np.any(disc < 0):
            break
        rho = (b + np.sqrt(disc)) / 2
        new = (tail + float(np.sum(np.maximum(top - rho, 0.0)))) / (p - k)
        if sigma2 > 0 and abs(new - sigma2) / sigma2 < tol:
            sigma2 = new
            break
        sigma2 = new
    return float(sigma2)


def kritchman_nadler_rank(eigenvalues, n_columns, alpha=0.005, max_rank=None, return_noise=False):
    """Rank by Kritchman & Nadler's (2008, 2009) sequential Tracy–Widom tests.

    For ``k = 1, 2, ..., k_max`` (``k_max = min(p, m) - 1`` by default) test
    ``H0: at most k - 1 signals`` against ``at least k``: reject when ::

        lambda_k > sigma2_k (mu_{m, p-k} + s(alpha) sigma_{m, p-k})

    with ``sigma2_k`` from :func:`kritchman_nadler_noise_variance` assuming
    ``k`` signals, Johnstone's real-case centring and scaling
    ``mu_{m,p} = (sqrt(m - 1/2) + sqrt(p - 1/2))**2 / m`` and
    ``sigma_{m,p} = sqrt(m mu_{m,p}) (1/sqrt(m - 1/2) + 1/sqrt(p - 1/2))**(1/3) / m``,
    and the authors' tail approximation of the Tracy–Widom quantile
    ``s(alpha) = (-3/2 log(4 sqrt(pi) alpha))**(2/3)``. The estimate is the
    last ``k`` rejected; when every test up to ``k_max`` rejects the full
    count ``k_max`` is returned (the authors' reference code returns
    ``k_max - 1`` in that case, an off-by-one).

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
        ``m`` (the authors' ``n``, number of samples).
    alpha : float in (0, 0.141), default=0.005
        False-alarm level (the authors' default 0.5%).
    max_rank : int or None, default=None
    return_noise : bool, default=False
        Also return the noise variance under the selected rank.

    Returns
    -------
    rank : int
    noise_variance : float, only if ``return_noise``

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.baselines import kritchman_nadler_rank
    >>> rng = np.random.default_rng(0)
    >>> W = rng.standard_normal((20, 2000))
    >>> W[:3] *= 2.0
    >>> kritchman_nadler_rank(np.linalg.eigvalsh(W @ W.T / 2000), 2000)
    3
    """
    if not 0 < alpha < 1 / (4 * np.sqrt(np.pi)):
        raise ValueError(f"alpha must be in (0, {1 / (4 * np.sqrt(np.pi)):.3f}) (the Tracy-Widom tail "
                         f"approximation of Kritchman & Nadler), got {alpha!r}.")
    lam, m, q = _prepare(eigenvalues, n_columns)
    p = lam.size
    k_max = q - 1
    if max_rank is not None:
        k_max = min(k_max, int(max_rank))
    s_alpha = _kn_tw_quantile(alpha)
    rank = 0
    for k in range(1, k_max + 1):
        mu, scale = johnstone_centring(p - k, m)  # Johnstone's real-case centring, -1/2 corrections
        sigma2 = kritchman_nadler_noise_variance(lam, m, k)
        if lam[k - 1] > sigma2 * (mu + s_alpha * scale):
            rank = k
            continue
        break
    if not return_noise:
        return int(rank)
    return int(rank), (kritchman_nadler_noise_variance(lam, m, rank) if rank < p else float("nan"))


# ---------------------------------------------------------------------------
# (d) Ahn & Horenstein (2013): eigenvalue ratio
# ---------------------------------------------------------------------------


def eigenvalue_ratio_rank(eigenvalues, n_columns, max_rank=None):
    """Rank by Ahn & Horenstein's (2013) eigenvalue-ratio (ER) estimator.

    With ``mu_k`` the ``k``-th largest eigenvalue of ``X X^T / (N T)`` for a
    ``T x N`` panel (here the ``p x m`` matrix: ``mu_k = lambda_k / p``) and
    ``qq = min(p, m)``, AH define ``V(k) = sum_{j=k+1}^{qq} mu_j`` and the mock
    eigenvalue ``mu_0 = V(0) / log(qq)``, and estimate ::

        k_ER = argmax_{0 <= k <= k_max} ER(k),   ER(k) = mu_k / mu_{k+1}.

    ER is invariant to a common scale, so the normalisation by ``p m`` (or by
    ``m`` as in the whitened statistic) is immaterial. AH leave ``k_max`` to
    the user (their theory needs ``k_max >= r*`` and ``k_max`` small relative
    to ``qq``); the default here is ``qq - 1`` so that any rank can be
    returned. The full rank ``qq`` cannot be (ER would need ``mu_{qq+1}``).

    Parameters
    ----------
    eigenvalues : array-like of shape (p,)
    n_columns : float
    max_rank : int or None, default=None
        ``k_max``.

    Returns
    -------
    int

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.baselines import eigenvalue_ratio_rank
    >>> eigenvalue_ratio_rank([9.0, 8.0, 1.1, 1.0, 0.9], 1000)
    2
    """
    lam, m, q = _prepare(eigenvalues, n_columns)
    if q < 2:
        return 0
    mu = lam[:q]
    k_max = q - 1 if max_rank is None else min(q - 1, int(max_rank))
    mock = float(np.sum(mu)) / np.log(q)
    ext = np.concatenate([[mock], mu])  # ext[k] = mu_k, k = 0 .. q
    num, den = ext[: k_max + 1], ext[1 : k_max + 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return int(np.argmax(ratios))


# ---------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------

#: name -> function(eigenvalues, n_columns) -> int, with the defaults used in the benchmark
BASELINES = {
    "gavish_donoho": gavish_donoho_rank,
    "minka": minka_rank,
    "kritchman_nadler": kritchman_nadler_rank,
    "eigenvalue_ratio": eigenvalue_ratio_rank,
}


def _statistic(statistic):
    """(eigenvalues, n_columns) of a WhitenedStatistic or a fitted rstar estimator."""
    if hasattr(statistic, "eigenvalues") and hasattr(statistic, "n_columns"):
        return np.asarray(statistic.eigenvalues), float(statistic.n_columns)
    if hasattr(statistic, "spectrum_") and hasattr(statistic, "n_columns_"):
        return np.asarray(statistic.spectrum_), float(statistic.n_columns_)
    raise TypeError("expected a WhitenedStatistic (eigenvalues, n_columns) or a fitted rstar estimator "
                    f"(spectrum_, n_columns_), got {type(statistic).__name__}.")


class BaselineRule(RankRule):
    """A baseline as an rstar rank rule: ``rule(ws) -> RuleResult``.

    Parameters
    ----------
    method : {"gavish_donoho", "minka", "kritchman_nadler", "eigenvalue_ratio"}
    **kwargs
        Passed to the baseline function (e.g. ``alpha`` for Kritchman–Nadler).

    Notes
    -----
    The baselines assume a white-noise (Marchenko–Pastur) bulk, so the rule
    supports statistics whose null model is a
    :class:`~rstar.inversions.WishartNull` and raises
    :class:`~rstar.inversions.UnsupportedNullModelError` for any other (to
    apply a baseline to any spectrum anyway, call its function, e.g.
    ``minka_rank(est.spectrum_, est.n_columns_)``, or
    :func:`baseline_ranks`). Only Gavish–Donoho uses a given ``noise_variance`` (its known-noise
    threshold); the others are defined for unknown noise and ignore it.
    ``effective_rank`` is the rank itself, ``threshold`` is the cut in
    eigenvalue units where the method has one (Gavish–Donoho), else the
    midpoint between the last retained and the first rejected eigenvalue.

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.baselines import BaselineRule
    >>> from rstar.inversions import make_inversion
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
    >>> inv = make_inversion("linear_proxy")
    >>> stats = inv.new_stats(16, 12, 12)
    >>> inv.update(stats, X, Y)
    >>> BaselineRule("kritchman_nadler")(inv.whiten(stats)).rank
    3
    """

    def __init__(self, method, **kwargs):
        if method not in BASELINES:
            raise ValueError(f"method must be one of {sorted(BASELINES)}, got {method!r}.")
        self.method = method
        self.kwargs = kwargs

    supported_nulls = (WishartNull,)

    def _call(self, ws, noise_variance, max_rank):
        lam, m = _statistic(ws)
        lam = np.sort(lam)[::-1]
        kwargs = dict(self.kwargs)
        sigma2 = float("nan")
        if self.method == "gavish_donoho":
            tau = gavish_donoho_threshold(lam, m, noise_variance)
            rank = int(np.sum(lam[: int(min(lam.size, max(np.floor(m), 1)))] > tau))
            if max_rank is not None:
                rank = min(rank, int(max_rank))
            if noise_variance is not None:
                sigma2 = float(noise_variance)
            return RuleResult(rank, tau, float(rank), sigma2)
        if max_rank is not None:
            kwargs["max_rank"] = max_rank
        if self.method == "kritchman_nadler":
            rank, sigma2 = kritchman_nadler_rank(lam, m, return_noise=True, **kwargs)
        else:
            rank = BASELINES[self.method](lam, m, **kwargs)
        upper = lam[rank - 1] if rank > 0 else lam[0] * (1 + 1e-12)
        lower = lam[rank] if rank < lam.size else 0.0
        return RuleResult(int(rank), float((upper + lower) / 2), float(rank), float(sigma2))


def baseline_ranks(statistic, methods=None):
    """Apply the baselines to one statistic.

    Parameters
    ----------
    statistic : WhitenedStatistic or fitted rstar estimator
        Anything with ``eigenvalues`` and ``n_columns``, or ``spectrum_`` and
        ``n_columns_`` (the statistic the estimator's rule saw).
    methods : iterable of str or None
        Keys of :data:`BASELINES` (default: all).

    Returns
    -------
    dict
        ``{method: rank}``.

    Examples
    --------
    >>> from rstar import MPRankEstimator
    >>> from rstar.baselines import baseline_ranks
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y = make_linear_proxy(500, rank=3, random_state=0)
    >>> baseline_ranks(MPRankEstimator().fit(X, Y))
    {'gavish_donoho': 3, 'minka': 3, 'kritchman_nadler': 3, 'eigenvalue_ratio': 3}
    """
    lam, m = _statistic(statistic)
    methods = list(BASELINES) if methods is None else list(methods)
    out = {}
    for name in methods:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}.")
        out[name] = int(BASELINES[name](lam, m))
    return out
