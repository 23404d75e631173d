"""Robustness regimes: heavy-tailed tokens, correlated features, T ~ d, d_v < r*.

For each regime and operator family the behaviour that holds is asserted:
exact recovery of r* over several fixed seeds (with the recovered subspace
checked against the teacher's), or the warning that flags the regime.
Where the library neither recovers r* nor warns, the test is a strict xfail
whose reason names the gap (measured numbers are in the reason strings); a
fix turns it into an XPASS, which fails the suite until the marker is removed.

Sizes are moderate (every fit < 1 s at OMP_NUM_THREADS=1); the seeds are the
first integers, not picked. n = 2000 is used where n = 1000 showed the
rule's alpha-level over-counts that Gaussian tokens show too (e.g. linear
proxy seed 2: p = 0.009 for a 4th spike, with either token law).
"""

import warnings

import numpy as np
import pytest

from rstar import (
    EnergyRankEstimator,
    IllConditionedInversionWarning,
    RStarEstimator,
    SoftmaxInversionEstimator,
    UnidentifiableRankWarning,
)
from rstar.datasets import make_attention_task, make_linear_proxy

ROBUSTNESS_WARNINGS = (IllConditionedInversionWarning, UnidentifiableRankWarning)
HEAVY = dict(token_distribution="student_t", df=3.0)
CORRELATED = dict(token_distribution="correlated", feature_correlation=0.5)  # AR(1): 0.5 ** |a - b|


# --- helpers ----------------------------------------------------------------------------------
def _fit(est, X, Y):
    """Fit, returning the estimator and the robustness warnings raised (categories)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, Y)
    return est, [w.category for w in caught if issubclass(w.category, ROBUSTNESS_WARNINGS)]


def _captured(components, basis):
    """Squared norm of the projection of an orthonormal basis onto span(components): r when contained."""
    return float(np.linalg.norm(components @ basis) ** 2)


def _range(M, r):
    return np.linalg.svd(M)[0][:, :r]


def _proxy(seed, n=1000, **kw):
    return make_linear_proxy(n, random_state=seed, return_teacher=True, **kw)


def _attention(kind, seed, n=1000, seq_len=32, n_features=16, **kw):
    return make_attention_task(n, kind=kind, seq_len=seq_len, n_features=n_features, random_state=seed,
                               return_teacher=True, **kw)


def _estimator(operator, teacher, known_v, softmax="least_squares"):
    """RStar; for softmax with ``softmax="first_order"`` the paper's inversion (exact with a known V and
    ``T <= 0.9 min(d, d_v)``, first order otherwise) instead of RStar's least squares."""
    V = teacher.value_map if known_v else None
    if operator == "softmax" and softmax != "least_squares":
        return SoftmaxInversionEstimator(value_map=V)
    return RStarEstimator(operator=operator, value_map=V)


#: The two softmax inversions the robustness tests run: the paper's (SoftmaxInversionEstimator) and RStar's.
SOFTMAX_INVERSIONS = ["first_order", "least_squares"]


def _assert_recovers(make_task, operator, seeds, known_v=False, op_key="kernel", softmax="least_squares"):
    """rank_ == r* on every seed, range(teacher operator) recovered, no robustness warning."""
    ranks, caps, warned = [], [], []
    for seed in seeds:
        X, Y, t = make_task(seed)
        est, caught = _fit(_estimator(operator, t, known_v, softmax), X, Y)
        ranks.append(est.rank_)
        caps.append(_captured(est.components_, _range(t[op_key], t.rank)))
        warned.append([c.__name__ for c in caught])
    r = t.rank
    assert ranks == [r] * len(seeds), f"rank_ per seed {ranks}, r* = {r}"
    assert min(caps) > r - 0.05, f"range captured per seed {caps}"
    assert not any(warned), f"unexpected warnings {warned}"


def _recovers_or_warns(make_task, operator, seeds, known_v=False, estimator=None):
    """(rank_, warned) per seed; the contract is rank_ == r* or a robustness warning."""
    out = []
    for seed in seeds:
        X, Y, t = make_task(seed)
        est = _estimator(operator, t, known_v) if estimator is None else estimator(t)
        est, caught = _fit(est, X, Y)
        out.append((est.rank_, bool(caught)))
    return out, t.rank


# --- 1. heavy-tailed tokens (Student-t, df = 3, unit variance) ----------------------------------
def test_heavy_tails_linear_proxy_recovers():
    _assert_recovers(lambda s: _proxy(s, **HEAVY), "linear_proxy", range(5), op_key="operator")


@pytest.mark.parametrize("known_v", [False, True], ids=["V_unknown", "V_known"])
def test_heavy_tails_linear_qk_recovers(known_v):
    # residual noise outside col(X_i) is exact for linear QK whatever the token law
    _assert_recovers(lambda s: _attention("linear_qk", s, **HEAVY), "linear_qk", range(4), known_v)


@pytest.mark.parametrize("softmax", SOFTMAX_INVERSIONS)
def test_heavy_tails_softmax_recovers(softmax):
    # The residual power outside col(P X_i) holds the higher-order terms and is heavy-tailed across
    # samples with Student-t tokens (q99/median ~ 60): without reweighting, rank_ was
    # [4, 3, 4, 6, 5, 5] (and [11, 10, 7, 12, 12, 10] with the bulk-width cap); weighting each
    # sample by 1 / its residual power (QueryKeyInversion.reweight) gives r* on every seed.
    # RStar's least squares: its information is far from a Kronecker product here, which the simulated
    # null allows for (a Kronecker-whitened MP test read [3, 4, 3, 3, 5, 3]).
    _assert_recovers(lambda s: _attention("softmax", s, **HEAVY), "softmax", range(6), softmax=softmax)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "gap: exact softmax inversion (known V, d = d_v = 12 >= T = 8) over-counts with Student-t(3) tokens, "
    "mostly without warning. n=1000, seeds 0-5: rank_ = [5, 4, 4, 3, 5, 4] with the split-half noise level "
    "(before it: [7, 6, 4, 4, 6, 6], only seed 0 warns "
    "(UnidentifiableRankWarning); 30 seeds: 10% exact (Gaussian 80%). Cause: outlier tokens dominate the "
    "normal matrix H (phi ~ x_j x_k^T), so the nearest-Kronecker whitening is driven by a few samples and "
    "the 12-eigenvalue bulk spans decades; the split-half noise draw is heavy-tailed too (its top "
    "eigenvalue up to 200x its median), so its median understates the noise that meets the spikes). "
    "EnergyRankEstimator gives [2, 3, 3, 3, 3, 3]."))
def test_heavy_tails_softmax_exact_recovers_or_warns():
    out, r = _recovers_or_warns(lambda s: _attention("softmax", s, seq_len=8, n_features=12, **HEAVY),
                                "softmax", range(6), known_v=True,
                                estimator=lambda t: SoftmaxInversionEstimator(value_map=t.value_map, method="exact"))
    assert all(rank == r or warned for rank, warned in out), f"(rank_, warned) per seed: {out}, r* = {r}"


def test_heavy_tails_softmax_known_v_least_squares_recovers():
    # the same tasks: RStar's least squares with its simulated null (the information need not be a
    # Kronecker product) gets r* on every seed
    _assert_recovers(lambda s: _attention("softmax", s, seq_len=8, n_features=12, **HEAVY), "softmax", range(6),
                     known_v=True)


# --- 2. correlated features (AR(1) covariance 0.5 ** |a - b|) ----------------------------------
def test_correlated_features_linear_proxy_recovers():
    # token-space statistic: the feature covariance only changes the column law of X V
    _assert_recovers(lambda s: _proxy(s, n=2000, **CORRELATED), "linear_proxy", range(5), op_key="operator")


@pytest.mark.parametrize("rho", [0.5, 0.9])
@pytest.mark.parametrize("known_v", [False, True], ids=["V_unknown", "V_known"])
def test_correlated_features_linear_qk_recovers(known_v, rho):
    # X_i^+ undoes any feature covariance: M_i = K G_i V + X_i^+ E_i still holds
    _assert_recovers(lambda s: _attention("linear_qk", s, token_distribution="correlated", feature_correlation=rho),
                     "linear_qk", range(4), known_v)


@pytest.mark.parametrize("softmax", SOFTMAX_INVERSIONS)
def test_correlated_features_softmax_recovers(softmax):
    _assert_recovers(lambda s: _attention("softmax", s, n=2000, **CORRELATED), "softmax", range(5), softmax=softmax)


def _exact_correlated(seed):
    return _attention("softmax", seed, seq_len=8, n_features=12, **CORRELATED)


def test_correlated_features_softmax_exact_finds_the_spikes():
    """What holds for the exact inversion: the r* spikes are found (never an under-count, range(K*)
    recovered, over-count at most 2) and the energy rule recovers r* exactly."""
    ranks, energy = [], []
    for seed in range(6):
        X, Y, t = _exact_correlated(seed)
        est, _ = _fit(SoftmaxInversionEstimator(value_map=t.value_map), X, Y)
        assert est.inversion_ == "softmax_exact"
        assert _captured(est.components_[:t.rank], _range(t.kernel, t.rank)) > t.rank - 0.02
        ranks.append(est.rank_)
        energy.append(EnergyRankEstimator(operator="softmax", value_map=t.value_map).fit(X, Y).rank_)
    assert all(t.rank <= r <= t.rank + 2 for r in ranks), ranks
    assert sum(r == t.rank for r in ranks) >= 4, ranks
    assert energy == [t.rank] * 6, energy


@pytest.mark.parametrize("softmax", SOFTMAX_INVERSIONS)
def test_correlated_features_softmax_known_v_recovers(softmax):
    # The exact inversion's noise level now comes from the split-half draw (K_odd - K_even) / 2;
    # fitting an MP bulk to the irregular 12-eigenvalue spectrum gave [3, 3, 3, 3, 4, 5].
    _assert_recovers(_exact_correlated, "softmax", range(6), known_v=True, softmax=softmax)


# --- 3. T ~ d: hard edge of the MP law --------------------------------------------------------
D = 12


# softmax at T = d - 1 is not here: with T > 0.9 min(d, d_v) method="auto" uses the first-order
# inversion even when V is known, and it sees T-1 = d-2 centred tokens, which is not ill-conditioned
# (see test_t_close_to_d_softmax_first_order_below_edge_recovers).
# linear QK with a known V is not here either: its least-squares inversion pools every sample into one
# system for K and is not ill-conditioned at T = d (see test_t_close_to_d_linear_qk_least_squares).
# linear QK with an unknown V and T <= d is not here: the cross-fitted least squares has no X_i^+ either
# (see test_t_close_to_d_linear_qk_least_squares).
NEAR_EDGE = [pytest.param(kind, known_v, T, id=f"{kind}-{'V_known' if known_v else 'V_unknown'}-T{T}")
             for kind, known_v in [("linear_qk", False), ("softmax", False), ("softmax", True)]
             for T in (D - 1, D, D + 1) if not (kind == "softmax" and T == D - 1)
             and not (kind == "linear_qk" and T <= D)]


@pytest.mark.parametrize("kind,known_v,T", NEAR_EDGE)
def test_t_close_to_d_warns_ill_conditioned(kind, known_v, T):
    """Every fit near T = d warns; the r* spikes are still among those found (range(K*) recovered)."""
    for seed in range(3):
        X, Y, t = _attention(kind, seed, seq_len=T, n_features=D)
        # the query-key inversion's aspect-ratio warning (method="auto" does not use the exact
        # softmax inversion this close to the edge)
        # softmax: the paper's first-order inversion (RStar's least squares is not ill-conditioned here,
        # see test_t_close_to_d_softmax_least_squares)
        est = (SoftmaxInversionEstimator(value_map=t.value_map if known_v else None) if kind == "softmax"
               else _estimator(kind, t, known_v))
        with pytest.warns(IllConditionedInversionWarning, match="ill-conditioned.*close to d=12"):
            est.fit(X, Y)
        assert est.inversion_ == {"linear_qk": "query_key_first_order", "softmax": "softmax_first_order"}[kind]
        assert t.rank <= est.rank_ <= t.rank + 2, (seed, est.rank_)
        assert _captured(est.components_[:t.rank], _range(t.kernel, t.rank)) > t.rank - 0.15
        if kind == "softmax":
            # T - 1 <= d: no model check for the first order, so its interval does not vouch for rank_
            assert est.rank_interval_ == (0, D)


@pytest.mark.parametrize("known_v", [False, True])
@pytest.mark.parametrize("T", [D - 1, D, D + 1])
def test_t_close_to_d_softmax_least_squares(known_v, T):
    """RStar's softmax inversion is least squares on the model itself, pooled over samples: no X_i^+ or
    (X_i V)^+, so T = d is an ordinary, well-posed regression: no warning, and r* exactly."""
    for seed in range(3):
        X, Y, t = _attention("softmax", seed, n=600, seq_len=T, n_features=D)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            est = _estimator("softmax", t, known_v).fit(X, Y)
        assert est.inversion_ == "softmax_least_squares"
        assert est.rank_ == t.rank, (seed, est.rank_)
        assert _captured(est.components_, _range(t.kernel, t.rank)) > t.rank - 0.05


@pytest.mark.parametrize("known_v,T,inversion", [
    (True, D - 1, "query_key_least_squares"), (True, D, "query_key_least_squares"),
    (True, D + 1, "query_key_least_squares"),
    (False, D - 1, "query_key_cross_fit"), (False, D, "query_key_cross_fit")])
def test_t_close_to_d_linear_qk_least_squares(known_v, T, inversion):
    """No X_i^+, so T = d is an ordinary, well-posed regression: no warning, and r* exactly. With V known, K is
    the least-squares solution of Y_i = X_i K G_i V pooled over samples; with V unknown and T <= d, V is fitted
    on one half of the samples and K by that least squares on the other (and the reverse)."""
    for seed in range(3):
        X, Y, t = _attention("linear_qk", seed, seq_len=T, n_features=D)
        with warnings.catch_warnings():
            warnings.simplefilter("error", IllConditionedInversionWarning)
            est = _estimator("linear_qk", t, known_v).fit(X, Y)
        assert est.inversion_ == inversion
        assert est.rank_ == t.rank, (seed, est.rank_)
        assert _captured(est.components_[:t.rank], _range(t.kernel, t.rank)) > t.rank - 0.01


@pytest.mark.parametrize("softmax", SOFTMAX_INVERSIONS)
@pytest.mark.parametrize("known_v", [False, True], ids=["V_unknown", "V_known"])
def test_t_close_to_d_softmax_below_edge_recovers(known_v, softmax):
    # T = d - 1: the centred inversion sees T-1 = d-2 tokens (aspect 0.83 < 0.9): handled, no warning
    _assert_recovers(lambda s: _attention("softmax", s, seq_len=D - 1, n_features=D), "softmax", range(5), known_v,
                     softmax=softmax)


@pytest.mark.parametrize("softmax", SOFTMAX_INVERSIONS)
def test_t_close_to_d_softmax_known_v_low_noise_recovers(softmax):
    # With T = 11 > 0.9 min(d, d_v) = 10.8, S_i = Y_i (X_i V)^+ is ill-conditioned (median
    # sigma_min(X_i V) 0.11 against 0.44 at T = 8): the exact inversion gave rank_ [4, 5, 5, 3, 3, 5]
    # at noise 0.01 without a warning. method="auto" now takes the first-order inversion there;
    # RStar's least squares has no (X_i V)^+.
    _assert_recovers(lambda s: _attention("softmax", s, seq_len=D - 1, n_features=D, noise=0.01), "softmax",
                     range(6), known_v=True, softmax=softmax)


def test_t_close_to_d_softmax_forced_exact_warns():
    X, Y, t = _attention("softmax", 0, seq_len=D - 1, n_features=D, noise=0.01)
    with pytest.warns(IllConditionedInversionWarning, match="exact softmax inversion is ill-conditioned"):
        est = SoftmaxInversionEstimator(value_map=t.value_map, method="exact").fit(X, Y)
    assert est.inversion_ == "softmax_exact"


# --- 4. d_v < r* (d_v = 2, r* = 4) ---------------------------------------------------------------
# Identifiable: for the linear proxy rank(A) lives in token space whatever d_v is; for query-key
# inversions each M_i = K G_i V has only d_v columns, but they lie in range(K*) and, pooled over
# samples with varying G_i = X_i^T X_i, span all of it (the r* - d_v directions beyond range(V) only through
# the isotropic part of E[G_i V V^T G_i], about T / d_v times weaker: with V unknown and d_v < d RStar
# cross-fits the least squares instead, see tests/inversions/test_query_key_cross_fit.py).
def test_value_dim_below_rank_linear_proxy_recovers():
    _assert_recovers(lambda s: _proxy(s, value_dim=2, rank=4), "linear_proxy", range(5), op_key="operator")


@pytest.mark.parametrize("known_v", [False, True], ids=["V_unknown", "V_known"])
def test_value_dim_below_rank_linear_qk_recovers(known_v):
    _assert_recovers(lambda s: _attention("linear_qk", s, value_dim=2, rank=4), "linear_qk", range(5), known_v)


def test_value_dim_below_rank_softmax_first_order_finds_all_spikes():
    """All r* = 4 > d_v spikes are found on every seed; the count is exact on 5 of 6 (the extra spike of
    seed 5 is the first-order rule's ~10% over-count, the same with d_v = d: see docs 'Known limits')."""
    ranks = []
    for seed in range(6):
        X, Y, t = _attention("softmax", seed, n=2000, value_dim=2, rank=4)
        est, caught = _fit(SoftmaxInversionEstimator(), X, Y)
        assert not caught
        assert est.rank_ >= 4, (seed, est.rank_)  # not capped at d_v = 2
        assert _captured(est.components_[:4], _range(t.kernel, 4)) > 4 - 0.02
        ranks.append(est.rank_)
    assert sum(r == 4 for r in ranks) >= 5, ranks
    assert max(ranks) <= 5, ranks


def test_value_dim_below_rank_softmax_least_squares_recovers():
    # RStar's least squares on the model: K is identified through all d = 16 directions of the tokens,
    # whatever d_v is
    _assert_recovers(lambda s: _attention("softmax", s, n=2000, value_dim=2, rank=4), "softmax", range(6))
