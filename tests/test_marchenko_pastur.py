import numpy as np
import pytest
from scipy import integrate

from rstar.marchenko_pastur import (
    bbp_threshold,
    debias_spike,
    estimate_noise_variance,
    fit_mp_bulk,
    largest_eigenvalue_quantile,
    mp_cdf,
    mp_edges,
    mp_median,
    mp_pdf,
    mp_quantile,
    spike_sample_eigenvalue,
    tracy_widom_quantile,
)

from _reasons import assert_warned, reasons


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0, 2.5])
def test_pdf_integrates_to_continuous_mass(ratio):
    a, b = mp_edges(ratio)
    mass, _ = integrate.quad(lambda x: float(mp_pdf(x, ratio)), a, b, limit=200)
    assert mass == pytest.approx(min(1.0, 1.0 / ratio), abs=1e-6)


@pytest.mark.parametrize("ratio", [0.05, 0.5, 2.0])
def test_cdf_matches_simulation(ratio):
    rng = np.random.default_rng(0)
    p = 400
    m = int(p / ratio)
    W = rng.standard_normal((p, m)) * np.sqrt(2.0)
    lam = np.linalg.eigvalsh(W @ W.T / m)
    for x in np.quantile(lam[lam > 1e-8], [0.1, 0.5, 0.9]):
        assert float(mp_cdf(x, ratio, sigma2=2.0)) == pytest.approx(np.mean(lam <= x), abs=0.03)


def test_quantile_inverts_cdf():
    for ratio in (0.1, 0.7, 1.0):
        for q in (0.1, 0.5, 0.95):
            assert float(mp_cdf(mp_quantile(q, ratio), ratio)) == pytest.approx(q, abs=1e-9)
    # the Gavish–Donoho median for a square matrix
    assert mp_median(1.0) == pytest.approx(0.6528, abs=1e-4)
    assert mp_quantile(0.2, 3.0) == 0.0  # inside the atom at 0


def test_bbp_round_trip():
    ratio = 0.2
    assert bbp_threshold(ratio) == pytest.approx(np.sqrt(0.2))
    theta = np.array([0.5, 1.0, 4.0])
    lam = spike_sample_eigenvalue(theta, ratio)
    np.testing.assert_allclose(debias_spike(lam, ratio), theta, rtol=1e-10)
    # below threshold: the spike sticks to the edge and cannot be recovered
    assert float(spike_sample_eigenvalue(0.3, ratio)) == pytest.approx(mp_edges(ratio)[1])
    assert float(debias_spike(mp_edges(ratio)[1] * 0.99, ratio)) == 0.0


def test_spike_position_simulation():
    """A population spike 1 + theta lands at (1 + theta)(1 + ratio / theta)."""
    rng = np.random.default_rng(1)
    p, m, theta = 300, 1500, 2.0
    W = rng.standard_normal((p, m))
    W[0] *= np.sqrt(1 + theta)
    top = np.linalg.eigvalsh(W @ W.T / m)[-1]
    assert top == pytest.approx(float(spike_sample_eigenvalue(theta, p / m)), rel=0.03)


def test_tracy_widom_quantiles():
    # Tracy–Widom (beta = 1) quantiles from the literature: 0.95 -> 0.98, 0.99 -> 2.02
    assert tracy_widom_quantile(0.95) == pytest.approx(0.98, abs=0.02)
    assert tracy_widom_quantile(0.99) == pytest.approx(2.02, abs=0.03)


def test_largest_eigenvalue_quantile_coverage():
    rng = np.random.default_rng(2)
    p, m, reps = 40, 400, 300
    tops = np.array([np.linalg.eigvalsh((W := rng.standard_normal((p, m))) @ W.T / m)[-1] for _ in range(reps)])
    q95 = largest_eigenvalue_quantile(p, m, 0.95)
    assert np.mean(tops > q95) == pytest.approx(0.05, abs=0.035)


def test_noise_variance_estimates():
    rng = np.random.default_rng(3)
    p, m = 100, 2000
    W = 0.3 * rng.standard_normal((p, m))
    W[:5] *= 5.0  # five strong spikes
    lam = np.linalg.eigvalsh(W @ W.T / m)
    assert estimate_noise_variance(lam, m, n_spikes=5) == pytest.approx(0.09, rel=0.03)
    s2, m_eff = fit_mp_bulk(lam, m, n_spikes=5)
    assert s2 == pytest.approx(0.09, rel=0.05)
    assert m_eff == pytest.approx(m, rel=0.35)
    # a bulk 4x wider than the nominal columns claim is recognised
    s2, m_eff = fit_mp_bulk(lam, 20 * m, n_spikes=5)
    assert m_eff < 4 * m
    assert np.isnan(estimate_noise_variance([1.0], 10, n_spikes=1))


def test_bad_parameters():
    with pytest.raises(ValueError, match="ratio"):
        mp_edges(-1.0)
    with pytest.raises(ValueError, match="sigma2"):
        mp_edges(0.5, sigma2=0.0)
    with pytest.raises(ValueError, match="q"):
        mp_quantile(1.5, 0.5)
    with pytest.raises(ValueError, match="n_spikes"):
        estimate_noise_variance([1.0, 2.0], 10, n_spikes=-1)


def test_fit_mp_bulk_width_cap_keeps_spikes_out_of_the_bulk():
    # 12 strong spikes among 16 eigenvalues: the quartiles are spikes and, uncapped,
    # the fitted bulk becomes as wide as MP allows; capped at 2000 columns it stays narrow.
    rng = np.random.default_rng(0)
    W = rng.standard_normal((16, 2000))
    W[:12] *= np.linspace(4.0, 2.0, 12)[:, None]
    lam = np.linalg.eigvalsh(W @ W.T / 2000)[::-1]
    _, m_free = fit_mp_bulk(lam, 2000 * 16)
    s2, m_cap = fit_mp_bulk(lam, 2000 * 16, min_columns=2000)
    assert m_free < 100 and m_cap == pytest.approx(2000)
    _, m_cap12 = fit_mp_bulk(lam, 2000 * 16, n_spikes=12, min_columns=2000)
    assert m_cap12 >= 2000 * (4 / 16) - 1e-6


def test_most_of_the_spectrum_counted_from_a_small_bulk_reaches_down_to_zero():
    # a smooth spectrum over a handful of near-zero eigenvalues: the noise level from that bulk is tiny, so nearly
    # everything counts (MiniLM tokens at T = 512, d = 384: the first-order statistic read 346 of 384 for a planted
    # 8, interval (346, 346)); the warning says the count may be mostly noise, and the interval reaches 0
    import warnings

    from rstar.exceptions import UnidentifiableRankWarning
    from rstar.inversions import WhitenedStatistic, WishartNull
    from rstar.rules import NumericalRule, sequential_spike_test

    lam = np.concatenate([np.linspace(100, 10, 30), np.full(8, 1e-3)])
    res = sequential_spike_test(lam, 400.0, 0.01)
    assert res.rank == 30 and res.rank_interval == (0, 30)
    assert_warned(res.warnings, "mostly_spikes", bounds=(0, 30), category=UnidentifiableRankWarning)
    # no bulk left to set the noise level after the spikes: the uncounted eigenvalue stays in the interval
    exhausted = sequential_spike_test(np.array([1000.0, 1e-3]), 400.0, 0.01)
    assert exhausted.rank == 1 and exhausted.rank_interval == (1, 2)
    assert_warned(exhausted.warnings, "bulk_exhausted", bounds=(None, 2), category=UnidentifiableRankWarning)
    # three clear spikes over a real bulk keep their tight interval, unwarned
    clear = sequential_spike_test(np.concatenate([[50.0, 40.0, 30.0], np.linspace(1.2, 0.8, 35)]), 400.0, 0.01)
    assert clear.rank == 3 and clear.rank_interval == (3, 3) and not clear.warnings
    # the numerical rank inside that range passes the warning on
    ws = WhitenedStatistic(lam, np.eye(38), np.eye(38), 400.0, WishartNull(), "softmax_first_order", (), [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        num = NumericalRule()(ws)
    assert num.rank == 30 and num.rank_interval == (0, 30)
    assert num.warnings and all(c is UnidentifiableRankWarning for c, _ in num.warnings)
    # the noise-aware test's own reason, not the numerical rank's (numerical_outside)
    assert reasons(num.warnings) == {"mostly_spikes"}


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0, 1.5, 7.0])
def test_scalar_cdf_of_the_root_finders_is_mp_cdf(ratio):
    # the quantiles' root finders use a scalar copy of mp_cdf's quadrature: it must be the same function
    from rstar.marchenko_pastur import _unit_cdf_inside

    a, b = mp_edges(ratio)
    atom = max(0.0, 1.0 - 1.0 / ratio)
    for x in np.linspace(a, b, 41):
        assert _unit_cdf_inside(x, ratio, a, b, atom) == pytest.approx(float(mp_cdf(x, ratio)), abs=1e-14)
