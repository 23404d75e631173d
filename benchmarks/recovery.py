"""Recovery benchmark: how often each estimator returns r* exactly, against published baselines.

A randomly sampled (seeded) grid of generated tasks in five families -- the
linear proxy; linear QK attention with known and with unknown V; softmax
attention with known and with unknown V -- is run in parallel with joblib.
On every task each rstar estimator is fitted as a user would fit it
(``RStarEstimator``, ``MPRankEstimator``, ``EnergyRankEstimator``,
``NumericalRankEstimator`` with the family's operator, and
``SoftmaxInversionEstimator`` on softmax tasks), and the four baselines of
:mod:`rstar.baselines` (Gavish-Donoho, Minka, Kritchman-Nadler, eigenvalue
ratio) are applied to the same whitened statistic as ``RStarEstimator``'s
rule (its ``spectrum_`` and ``n_columns_``). A second, paired sweep measures
the detection curve: exact recovery against the weakest spike in units of
the BBP threshold.

Usage::

    python benchmarks/recovery.py --quick          # < 5 minutes on 2 cores
    python benchmarks/recovery.py                  # the full grid
    python benchmarks/recovery.py --check-calibration
    python benchmarks/recovery.py --replot benchmarks/out/recovery-full   # tables/figures from saved CSVs

Results, the grid, the baselines' definitions and a discussion are in
docs/recovery.md.

Prints the tables (also written to ``summary.md``) and writes
``results.csv``, ``detection.csv``, ``run.json`` and PNG figures under
``benchmarks/out/recovery-{quick,full}/``.

Spike-strength control (linear families). The rules see the eigenvalues of a
whitened statistic ``W W^T / m`` whose noise part is Marchenko-Pastur with
ratio ``gamma = p / m`` at the noise variance ``sigma^2``; a signal
direction of strength ``theta`` (units of ``sigma^2``) separates from the
bulk iff ``theta > sqrt(gamma)`` (BBP). The grid fixes the *weakest* spike at
``theta_r = c sqrt(gamma)`` and solves for the generator's singular values:

- linear proxy (``C = sum_i Y_i Y_i^T / (n d_v)``, ``p = T``,
  ``m = n d_v``): ``E[Y Y^T] / d_v = kappa A A^T + sigma^2 I`` with
  ``kappa = tr(V^T Sigma_x V) / d_v`` (``Sigma_x`` the token covariance;
  tokens are independent across positions), so
  ``theta_i = kappa s_i^2 / sigma^2`` and
  ``s_i = sigma sqrt(theta_i / kappa)``. ``kappa`` is computed from the
  teacher's realised V (drawn before X by the generator, so a 1-sample call
  with the same seed returns it).
- linear QK (``rstar.inversions.QueryKeyInversion``, ``p = d``,
  ``m = n_columns`` effective): the signal part of the whitened statistic is
  quadratic in the scale of K, so the noiseless statistic of the same X
  (same seed, ``noise=0``) is computed once at a unit scale and K is
  rescaled so that its r-th eigenvalue is ``c sqrt(gamma) sigma^2``
  (exact conditional on X). For Gaussian tokens and ``T > d`` it is close to
  ``theta_i ~ s_i^2 (T - d - 1)(T + d + 1) / (d^2 sigma^2)`` (checked by
  ``--check-calibration``).

Speed. ``fit`` also builds the closed-form operator behind ``predict``
(alternating least squares on d^4 moment sums), which costs 5-10x the rank
estimate and does not change ``rank_``; by default it is skipped here by
replacing the inversions' ``fit_operator`` with a stub (and not accumulating
the query-key moment sums, used only there). ``--exact-fit`` runs the
unmodified ``fit``. The token inversion keeps its moment sums (its residual
noise estimate uses them). The rstar estimators on the same inversion differ
only in their rank rule, so each takes the accumulated sums and the whitened
statistic (computed once per task) of the first one fitted on that inversion
(``RStarEstimator``; on softmax, whose RStar inversion is the least squares,
the paper's inversion is fitted once more, by ``MPRankEstimator``) and runs
only its own rule
(``_fit_on_shared_statistic``; column ``shared``, whose ``seconds`` then count
the rule alone); ``--no-share`` fits each in full. The rows are the same
(tested, and identical on the whole quick grid: 2790 rows).
"""

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
import warnings
from collections import defaultdict

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAMILIES = {
    # name: (generator kind, estimator operator, V known)
    "linear_proxy": ("linear_proxy", "linear_proxy", False),
    "linear_qk_known_v": ("linear_qk", "linear_qk", True),
    "linear_qk_unknown_v": ("linear_qk", "linear_qk", False),
    "softmax_known_v": ("softmax", "softmax", True),
    "softmax_unknown_v": ("softmax", "softmax", False),
}
RSTAR_ESTIMATORS = ["RStar", "MP", "Energy", "Numerical", "SoftmaxInv"]
BASELINE_NAMES = {"gavish_donoho": "GD", "minka": "Minka", "kritchman_nadler": "KN", "eigenvalue_ratio": "ER"}
ESTIMATORS = RSTAR_ESTIMATORS + list(BASELINE_NAMES.values()) + ["Oracle"]
DETECTION_C = [0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 2.0, 3.0, 5.0]
T_RATIOS = [0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0]
DV_RATIOS = [0.5, 1.0, 2.0]
TOKENS = ["gaussian", "student_t", "correlated"]

PROFILES = {
    "quick": dict(tasks_per_family=30, detection_per_point=8, d_values=[8, 12, 16, 24, 32], n_max=3000,
                  cost_qk=6e7, cost_proxy=3e9, cost_exact=6e9, max_entries=1e7),
    "full": dict(tasks_per_family=200, detection_per_point=20, d_values=[8, 12, 16, 24, 32, 48, 64], n_max=10000,
                 cost_qk=1e8, cost_proxy=4e9, cost_exact=8e9, max_entries=2e7),
}
N_MIN = 100


# ---------------------------------------------------------------------------
# task sampling
# ---------------------------------------------------------------------------


def _loguniform(rng, lo, hi):
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def _exact_softmax(family, T, d, d_v):
    """Whether ``method="auto"`` takes the exact softmax inversion for this task's shape."""
    from rstar.estimators import make_inversion
    from rstar.inversions import SoftmaxExactInversion

    if family != "softmax_known_v":
        return False
    return isinstance(make_inversion("softmax", np.zeros((d, d_v)), shape=(T, d, d_v)), SoftmaxExactInversion)


def _n_cap(family, T, d, d_v, prof):
    """Largest n allowed by the per-fit cost model of the family's inversion."""
    kind = FAMILIES[family][0]
    caps = [prof["max_entries"] / (T * max(d, d_v))]
    if kind == "linear_proxy":
        if (T * d) ** 2 <= 2**25:  # rstar accumulates the (Td)^2 moment sums for its residual noise
            caps.append(prof["cost_proxy"] / (T * d) ** 2)
    elif _exact_softmax(family, T, d, d_v):
        caps.append(prof["cost_exact"] / (T**2 * d**4))
    else:
        caps.append(prof["cost_qk"] / (T * d * d))
    return int(min(caps))


def sample_task(family, rng, prof, c=None, detection=False):
    """One random task configuration (a dict of generator and control parameters)."""
    kind = FAMILIES[family][0]
    for _ in range(200):
        d = int(rng.choice(prof["d_values"] if not detection else [v for v in prof["d_values"] if v <= 32]))
        if detection:
            t_ratio = float(rng.choice([r for r in T_RATIOS if r >= (1.0 if kind == "linear_proxy" else 1.5)]))
        else:
            t_ratio = float(rng.choice(T_RATIOS))
        T = max(2, int(round(t_ratio * d)))
        d_v = max(1, int(round(float(rng.choice(DV_RATIOS)) * d)))
        n = int(round(_loguniform(rng, N_MIN if not detection else 300, prof["n_max"] if not detection else 3000)))
        n = min(n, _n_cap(family, T, d, d_v, prof))
        if n >= N_MIN:
            break
    else:  # pragma: no cover - the grids above always admit a task
        raise RuntimeError("could not sample a task within the cost caps")
    p = T if kind == "linear_proxy" else d
    r_max = min(p, d)
    if detection:
        r = int(rng.integers(1, min(3, r_max) + 1))
    else:
        r = 0 if rng.random() < 0.15 else int(rng.integers(1, r_max + 1))
    task = dict(family=family, kind=kind, T=T, d=d, d_v=d_v, n=n, r_star=r,
                tokens=str(rng.choice(TOKENS)) if not detection else "gaussian",
                sigma=_loguniform(rng, 0.01, 0.5), c=float("nan"), spread=float("nan"), logit_scale=float("nan"),
                seed=int(rng.integers(0, 2**31 - 1)), detection=detection)
    if kind == "softmax":
        task["logit_scale"] = _loguniform(rng, 0.5, 6.0)
    else:
        task["c"] = float(c) if c is not None else _loguniform(rng, 1.0, 10.0)
        task["spread"] = _loguniform(rng, 1.0, 3.0 if detection else 10.0)
    return task


def make_grid(profile, seed, tasks_per_family=None, detection_per_point=None):
    prof = PROFILES[profile]
    tpf = prof["tasks_per_family"] if tasks_per_family is None else tasks_per_family
    dpp = prof["detection_per_point"] if detection_per_point is None else detection_per_point
    tasks = []
    for f_id, family in enumerate(FAMILIES):
        for i in range(tpf):
            rng = np.random.default_rng(np.random.SeedSequence([seed, 1, f_id, i]))
            tasks.append(dict(sample_task(family, rng, prof), task_id=f"{family}/{i}"))
    for f_id, family in enumerate(["linear_proxy", "linear_qk_unknown_v"]):
        for j in range(dpp):
            for i_c, c in enumerate(DETECTION_C):
                # the same configuration j (T, d, d_v, n, r*, spread, sigma) at every spike strength c,
                # with a fresh draw of teacher, tokens and noise for each c
                rng = np.random.default_rng(np.random.SeedSequence([seed, 2, f_id, j]))
                task = sample_task(family, rng, prof, c=c, detection=True)
                task["seed"] = int(np.random.SeedSequence([seed, 3, f_id, j, i_c]).generate_state(1)[0] >> 1)
                tasks.append(dict(task, task_id=f"detection/{family}/{j}/c={c}"))
    return tasks


# ---------------------------------------------------------------------------
# running one task
# ---------------------------------------------------------------------------

_PATCHED = False


def install_fast_patches():
    """Skip the closed-form operator fit (predict only); rank_ is unchanged."""
    global _PATCHED
    if _PATCHED:
        return
    from rstar import inversions

    def _no_operator(self, stats, basis):
        return None

    for cls in (inversions.TokenInversion, inversions.QueryKeyInversion, inversions.SoftmaxExactInversion,
                inversions.SoftmaxLeastSquaresInversion):
        cls.fit_operator = _no_operator
    original = inversions.QueryKeyInversion.new_stats

    def new_stats(self, T, d, d_v):
        stats = original(self, T, d, d_v)
        for key in ("HZ", "FZ"):
            if key in stats:
                stats[key] = None
        return stats

    inversions.QueryKeyInversion.new_stats = new_stats
    _PATCHED = True


def _token_cov(task):
    d = task["d"]
    if task["tokens"] == "correlated":
        idx = np.arange(d)
        return 0.5 ** np.abs(idx[:, None] - idx[None, :])
    return np.eye(d)


def _spike_shape(r, spread):
    """Relative spike strengths theta_i / theta_r, geometric from ``spread`` down to 1."""
    if r == 0:
        return np.zeros(0)
    return spread ** (np.arange(r)[::-1] / max(r - 1, 1)) if r > 1 else np.ones(1)


def generate(task):
    """(X, Y, teacher, info) for a task; linear families calibrated to the weakest spike c x BBP."""
    from rstar.datasets import make_attention_task, make_linear_proxy
    from rstar.estimators import make_inversion

    T, d, d_v, n, r, sigma = (task[k] for k in ("T", "d", "d_v", "n", "r_star", "sigma"))
    common = dict(seq_len=T, n_features=d, value_dim=d_v, rank=r, noise=sigma, token_distribution=task["tokens"],
                  random_state=task["seed"], return_teacher=True)
    info = {}
    if task["kind"] == "linear_proxy":
        shape = _spike_shape(r, task["spread"])
        if r:
            # V is drawn before X: a one-sample call with the same seed returns the teacher's V.
            _, _, t0 = make_linear_proxy(1, singular_values=np.ones(r), **common)
            V = t0.value_map
            kappa = float(np.trace(V.T @ _token_cov(task) @ V)) / d_v
            gamma = T / (n * d_v)
            theta = task["c"] * np.sqrt(gamma) * shape
            s = sigma * np.sqrt(theta / kappa)
            info.update(kappa=kappa, gamma=gamma, thetas=theta, n_columns=float(n * d_v))
        else:
            s = np.zeros(0)
        X, Y, teacher = make_linear_proxy(n, singular_values=s if r else None, **common)
        return X, Y, teacher, info
    if task["kind"] == "linear_qk":
        if r:
            s0 = np.sqrt(_spike_shape(r, task["spread"]))
            X, Y0, _ = make_attention_task(n, kind="linear_qk", singular_values=s0,
                                           **dict(common, noise=0.0))
            inv = make_inversion("linear_qk")
            stats = inv.new_stats(T, d, d_v)
            inv.update(stats, X, Y0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ws = inv.whiten(stats)
            gamma = d / ws.n_columns
            weakest = float(ws.eigenvalues[r - 1])
            scale = np.sqrt(task["c"] * np.sqrt(gamma) * sigma**2 / weakest) if weakest > 0 else 1.0
            s = s0 * scale
            thetas = ws.eigenvalues[:r] * scale**2 / sigma**2
            info.update(gamma=gamma, n_columns=float(ws.n_columns), thetas=thetas)
        else:
            s = None
        X, Y, teacher = make_attention_task(n, kind="linear_qk", singular_values=s, **common)
        return X, Y, teacher, info
    X, Y, teacher = make_attention_task(n, kind="softmax", logit_scale=task["logit_scale"], **common)
    info["exact_inversion"] = _exact_softmax(task["family"], T, d, d_v)
    if r and not info["exact_inversion"]:
        X0, Y0, _ = make_attention_task(n, kind="softmax", logit_scale=task["logit_scale"], **dict(common, noise=0.0))
        info["clean_gap"] = first_order_clean_gap(X0, Y0, r)
    return X, Y, teacher, info


def first_order_clean_gap(X, Y_clean, r):
    """Eigen-gap at r* of the first-order softmax statistic of noise-free data: lambda_r / lambda_{r+1}.

    The statistic is the centred query-key inversion without residual weights
    (``QueryKeyInversion(centred=True, reweight=False)``) on the task's tokens and
    noise-free outputs. Its top r* directions are K*'s; the rest is the higher-order
    softmax bulk. A gap near 1 means that even without noise the r* signal
    directions do not stand apart from the higher-order terms, so no rule reading
    this spectrum can single r* out; ``inf`` when r* = d (no bulk).
    """
    from rstar.inversions import QueryKeyInversion

    n, T, d = X.shape
    inv = QueryKeyInversion(centred=True, residual_noise=False, reweight=False)
    stats = inv.new_stats(T, d, Y_clean.shape[2])
    stats["HZ"] = stats["FZ"] = None   # moment sums are for predict only
    inv.update(stats, X, Y_clean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lam = inv.whiten(stats).eigenvalues
    if r >= d:
        return float("inf")
    return float(lam[r - 1] / lam[r]) if lam[r] > 0 else float("inf")


def _estimators(task, V):
    from rstar import (
        EnergyRankEstimator,
        MPRankEstimator,
        NumericalRankEstimator,
        RStarEstimator,
        SoftmaxInversionEstimator,
    )

    op = FAMILIES[task["family"]][1]
    out = [("RStar", RStarEstimator(operator=op, value_map=V)),
           ("MP", MPRankEstimator(operator=op, value_map=V)),
           ("Energy", EnergyRankEstimator(operator=op, value_map=V)),
           ("Numerical", NumericalRankEstimator(operator=op, value_map=V))]
    if op == "softmax":
        out.append(("SoftmaxInv", SoftmaxInversionEstimator(value_map=V)))
    return out


def oracle_rank(thetas, p, m, seed, alpha=0.01):
    """Reference, not an estimator: the sequential Tracy-Widom test at level alpha with the noise variance
    *known*, on a white spiked Wishart with the task's p, m and population spikes theta_i.

    The draw uses Bartlett's decomposition (W = L L^T, L lower triangular with chi and normal entries), so
    it costs O(p^3) whatever m. It shows the finite-size limit of a largest-eigenvalue test at this p, m:
    no rule with the same false-alarm level and less information should beat it on average.
    """
    from rstar.rules import sequential_spike_test

    rng = np.random.default_rng(seed)
    m_int = max(int(round(m)), p)
    L = np.tril(rng.standard_normal((p, p)), -1)
    L[np.diag_indices(p)] = np.sqrt(rng.chisquare(m_int - np.arange(p)))
    scale = np.ones(p)
    scale[: len(thetas)] = np.sqrt(1.0 + np.asarray(thetas))
    A = scale[:, None] * L
    lam = np.linalg.eigvalsh(A @ A.T / m_int)[::-1]
    return sequential_spike_test(lam, m_int, alpha, noise_variance=1.0).rank


def _residual_noise(task):
    """Whether rstar's inversion can estimate sigma^2 from a residual (mirrors rstar.inversions, approximately).

    Linear proxy: the regression of vec Y on vec X needs n > T d (and the (T d)^2 moment sums);
    linear QK with V known: the residual of the pooled least-squares fit of K (n T d_v > d^2);
    linear QK with V unknown: the part of Y_i outside col(X_i) needs T > d; with T <= d or d_v < d, the
    cross-fitted least squares' residual, within its cost budget; softmax: the residual of RStar's least-squares fit of the model,
    within its budgets (else the first-order inversion fits the bulk instead).
    """
    T, d, d_v, n = task["T"], task["d"], task["d_v"], task["n"]
    if task["kind"] == "softmax":
        from rstar.inversions import SoftmaxLeastSquaresInversion

        return bool(SoftmaxLeastSquaresInversion.sizes_allow_fit(n, T, d, d_v, task["family"] == "softmax_known_v"))
    if task["kind"] == "linear_proxy":
        return bool((T * d) ** 2 <= 2**25 and T * d_v * (n - T * d) >= 50)
    if task["family"] == "linear_qk_known_v" and d**4 <= 2**25:
        return bool(n * T * d_v - d * d >= 50)  # least-squares inversion: residual of the pooled fit
    if task["kind"] == "linear_qk" and (T <= d or d_v < d) and d**4 <= 2**25:
        from rstar.inversions import QueryKeyCrossFitInversion

        if QueryKeyCrossFitInversion.sizes_allow_cross_fit(n, T, d, d_v):
            return True   # else first order: its residual outside col(X_i) needs T > d (below)
    if task["kind"] == "linear_qk":
        return bool(n * max(T - d, 0) * d_v >= 50)
    return False


def _same_inversion(a, b):
    """Whether two inversion objects are configured alike (same class and parameters; a memoised ``whiten``
    does not count)."""
    va = {k: v for k, v in vars(a).items() if k != "whiten"}
    vb = {k: v for k, v in vars(b).items() if k != "whiten"}
    if type(a) is not type(b) or va.keys() != vb.keys():
        return False
    for key, value in va.items():
        other = vb[key]
        if isinstance(value, np.ndarray) or isinstance(other, np.ndarray):
            if not (isinstance(value, np.ndarray) and isinstance(other, np.ndarray) and np.array_equal(value, other)):
                return False
        elif value != other:
            return False
    return True


def _fit_on_shared_statistic(est, ref):
    """``est.fit(X, Y)`` when ``ref`` was fitted on the same X, Y with the same inversion, without recomputing it.

    The rstar estimators on the same inversion differ only in their rank rule (RStar, MP, Energy, Numerical,
    SoftmaxInv on the same operator and value_map, except RStar's least squares on softmax): the accumulated
    sums and the whitened statistic are the same, so ``est`` takes
    ``ref``'s fitted state and runs only its own rule (``_finalize``). ``ref._inv.whiten`` is memoised for the
    task (the expensive part: coherent fits, the cross-fit). Returns False (nothing done) when ``est`` would
    build a different inversion. ``--no-share`` runs every fit in full instead; the two give identical rows
    (tested on the quick grid).
    """
    from rstar.estimators import make_inversion

    T, d, d_v = ref._dims
    V = None if est.value_map is None else np.asarray(est.value_map) * (ref._x_scale / ref._y_scale)
    try:
        est._validate_params_()
        candidate = make_inversion(est._get_operator(), V, shape=(T, d, d_v), **est._inversion_options())
    except Exception:
        return False
    if not _same_inversion(candidate, ref._inv):
        return False
    for attr in ("n_features_in_", "_dims", "_y_ndim", "_x_scale", "_y_scale", "_inv", "_stats"):
        setattr(est, attr, getattr(ref, attr))
    est._finalize()
    return True


def _memoise_whiten(inversion):
    """Make ``inversion.whiten(stats)`` compute once per stats dict (instance attribute; the rules do not mutate
    the whitened statistic)."""
    cache = {}
    whiten = inversion.whiten

    def memo(stats):
        key = id(stats)
        if key not in cache:
            cache[key] = (stats, whiten(stats))
        return cache[key][1]

    inversion.whiten = memo


def _fit_memoised(est, X, Y):
    """``est.fit(X, Y)`` with its inversion's ``whiten`` memoised, for the estimators that share it."""
    import rstar.estimators as estimators

    original = estimators.make_inversion

    def make(*args, **kwargs):
        inversion = original(*args, **kwargs)
        _memoise_whiten(inversion)
        return inversion

    estimators.make_inversion = make
    try:
        est.fit(X, Y)
    finally:
        estimators.make_inversion = original


def run_task(task, fast=True, share=True):
    """Fit every estimator and baseline on one generated task; one row per estimator.

    With ``share``, each rstar estimator reuses the inversion of the first one fitted on the same inversion
    (``_fit_on_shared_statistic``); its ``seconds`` then count only its own rule (column ``shared``).
    """
    from threadpoolctl import threadpool_limits

    from rstar.baselines import BASELINES

    if fast:
        install_fast_patches()
    with threadpool_limits(1):
        t0 = time.perf_counter()
        X, Y, teacher, info = generate(task)
        t_gen = time.perf_counter() - t0
        V = teacher.value_map if FAMILIES[task["family"]][2] else None
        rows = []
        base = {k: v for k, v in task.items()}
        base.update(gamma=info.get("gamma", float("nan")), clean_gap=info.get("clean_gap", float("nan")),
                    gen_seconds=round(t_gen, 4),
                    exact_inversion=bool(info.get("exact_inversion", False)), residual_noise=_residual_noise(task))
        ref, fitted = None, []
        for name, est in _estimators(task, V):
            caught = []
            shared = False
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    # the first estimator fitted on each inversion lends it to the later ones
                    # (softmax: RStar's least squares, then the paper's inversion for the others)
                    shared = share and any(_fit_on_shared_statistic(est, other) for other in fitted)
                    if share and not shared:
                        _fit_memoised(est, X, Y)
                    elif not shared:
                        est.fit(X, Y)
                caught = sorted({type(x.message).__name__ for x in w
                                 if type(x.message).__name__.endswith("Warning")
                                 and x.category.__module__.startswith("rstar")})
                r_hat, error = int(est.rank_), ""
            except Exception as exc:  # recorded, counted as a miss
                r_hat, error = -1, f"{type(exc).__name__}: {exc}"[:200]
            seconds = time.perf_counter() - t0
            if share and not shared and not error:
                fitted.append(est)
            diag = dict(noise_ratio=float("nan"), n_columns=float("nan"), p_values="")
            if name == "RStar" and not error:
                ref = est
                # the sequential p-values: rank_ is the count of leading ones below alpha, so the rank at
                # any other level can be read off them (benchmarks/alpha_calibration.py)
                diag = dict(noise_ratio=est.noise_variance_ / task["sigma"] ** 2, n_columns=est.n_columns_,
                            p_values=" ".join(f"{q:.6g}" for q in est.p_values_))
            rows.append(dict(base, estimator=name, r_hat=r_hat, seconds=round(seconds, 4), shared=shared,
                             warnings="|".join(caught), error=error, **diag))
        for key, short in BASELINE_NAMES.items():
            t0 = time.perf_counter()
            if ref is None:
                r_hat, error = -1, "RStarEstimator failed: no statistic"
            else:
                try:
                    r_hat, error = int(BASELINES[key](ref.spectrum_, ref.n_columns_)), ""
                except Exception as exc:
                    r_hat, error = -1, f"{type(exc).__name__}: {exc}"[:200]
            rows.append(dict(base, estimator=short, r_hat=r_hat, seconds=round(time.perf_counter() - t0, 4),
                             shared=False, warnings="", error=error, noise_ratio=float("nan"),
                             n_columns=float("nan"), p_values=""))
        if task["kind"] != "softmax":
            p = task["T"] if task["kind"] == "linear_proxy" else task["d"]
            thetas = info.get("thetas", np.zeros(0))
            m = info.get("n_columns", float(task["n"] * task["d_v"]))
            rows.append(dict(base, estimator="Oracle", r_hat=oracle_rank(thetas, p, m, task["seed"] + 1), seconds=0.0,
                             shared=False, warnings="", error="", noise_ratio=float("nan"), n_columns=m,
                             p_values=""))
    for row in rows:
        row["abs_err"] = abs(row["r_hat"] - row["r_star"]) if row["r_hat"] >= 0 else float("nan")
        row["exact"] = int(row["r_hat"] == row["r_star"])
    return rows


# ---------------------------------------------------------------------------
# aggregation and tables
# ---------------------------------------------------------------------------


def _rate(rows):
    return 100.0 * np.mean([r["exact"] for r in rows]) if rows else float("nan")


def _mae(rows):
    errs = [r["r_hat"] - r["r_star"] for r in rows if r["r_hat"] >= 0]
    errs = [abs(e) for e in errs] + [float(r["r_star"]) + 1 for r in rows if r["r_hat"] < 0]
    return float(np.mean(errs)) if errs else float("nan")


def _fp(rows):
    zero = [r for r in rows if r["r_star"] == 0]
    return (100.0 * np.mean([r["r_hat"] != 0 for r in zero]) if zero else float("nan")), len(zero)


def _fmt(x, digits=1):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _estimators_in(rows):
    present = {r["estimator"] for r in rows}
    return [e for e in ESTIMATORS if e in present]


def _group(rows, key):
    out = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def table_main(rows):
    lines = ["| family | estimator | tasks | exact recovery % | mean abs err | FP % on r*=0 (tasks) |",
             "|---|---|---|---|---|---|"]
    by_family = _group(rows, lambda r: r["family"])
    for family in FAMILIES:
        fam = by_family.get(family, [])
        by_est = _group(fam, lambda r: r["estimator"])
        for est in _estimators_in(fam):
            er = by_est[est]
            fp, n0 = _fp(er)
            lines.append(f"| {family} | {est} | {len(er)} | {_fmt(_rate(er))} | {_fmt(_mae(er), 2)} | "
                         f"{_fmt(fp)} ({n0}) |")
    return "\n".join(lines)


def table_wide(rows, group_key, group_order, title, metric=_rate, digits=1):
    ests = _estimators_in(rows)
    lines = [f"| {title} | tasks | " + " | ".join(ests) + " |", "|---" * (len(ests) + 2) + "|"]
    groups = _group(rows, group_key)
    for g in group_order:
        gr = groups.get(g, [])
        if not gr:
            continue
        by_est = _group(gr, lambda r: r["estimator"])
        n_tasks = len({r["task_id"] for r in gr})
        vals = [_fmt(metric(by_est[e]), digits) if by_est.get(e) else "—" for e in ests]
        lines.append(f"| {g} | {n_tasks} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def t_regime(r):
    ratio = r["T"] / r["d"]
    if abs(ratio - 1.0) <= 0.15:
        return "T ≈ d (0.85–1.15)"
    return "T < d" if ratio < 1 else ("d < T < 2d" if ratio < 2 else "T ≥ 2d")


T_REGIMES = ["T < d", "T ≈ d (0.85–1.15)", "d < T < 2d", "T ≥ 2d"]


def c_bin(r):
    c = r["c"]
    if math.isnan(c):
        return None
    for lo, hi in [(0, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, 5.0), (5.0, 1e9)]:
        if lo <= c < hi:
            return f"[{lo:g}, {hi:g})" if hi < 1e9 else f"≥ {lo:g}"
    return None


C_BINS = ["[1, 1.5)", "[1.5, 2)", "[2, 3)", "[3, 5)", "≥ 5"]


def logit_bin(r):
    s = r["logit_scale"]
    for lo, hi in [(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 6.01)]:
        if lo <= s < hi:
            return f"[{lo:g}, {min(hi, 6):g})"
    return None


LOGIT_BINS = ["[0.5, 1)", "[1, 2)", "[2, 4)", "[4, 6)"]


def rank_bin(r):
    if r["r_star"] == 0:
        return "r* = 0"
    p = r["T"] if r["kind"] == "linear_proxy" else r["d"]
    f = r["r_star"] / p
    if r["r_star"] >= p - 1:
        return "r* ≥ p − 1"
    return "r*/p ≤ 1/4" if f <= 0.25 else ("1/4 < r*/p ≤ 1/2" if f <= 0.5 else "r*/p > 1/2")


RANK_BINS = ["r* = 0", "r*/p ≤ 1/4", "1/4 < r*/p ≤ 1/2", "r*/p > 1/2", "r* ≥ p − 1"]


def gap_bin(r):
    """First-order softmax tasks by the eigen-gap at r* of their noise-free statistic."""
    if r["r_star"] == 0:
        return "r* = 0"
    g = r.get("clean_gap", float("nan"))
    if isinstance(g, float) and math.isnan(g):
        return "exact inversion" if r.get("exact_inversion") else None
    if r["r_star"] >= r["d"]:
        return "r* = d (no bulk)"
    if g < 1.5:
        return "gap < 1.5"
    return "1.5 ≤ gap < 2" if g < 2 else ("2 ≤ gap < 4" if g < 4 else "gap ≥ 4")


GAP_BINS = ["r* = 0", "gap < 1.5", "1.5 ≤ gap < 2", "2 ≤ gap < 4", "gap ≥ 4", "r* = d (no bulk)", "exact inversion"]


def n_bin(r):
    n = r["n"]
    return "n < 300" if n < 300 else ("300 ≤ n < 1000" if n < 1000 else ("1000 ≤ n < 3000" if n < 3000 else "n ≥ 3000"))


N_BINS = ["n < 300", "300 ≤ n < 1000", "1000 ≤ n < 3000", "n ≥ 3000"]


def detection_table(det_rows):
    """Exact recovery vs c, per family and estimator, and the 50%-detection point."""
    out = []
    points = {}
    for family in ["linear_proxy", "linear_qk_unknown_v"]:
        fam = [r for r in det_rows if r["family"] == family]
        if not fam:
            continue
        ests = _estimators_in(fam)
        lines = [f"**{family}** (exact recovery %, by weakest spike c in units of the BBP threshold)", "",
                 "| c | tasks | " + " | ".join(ests) + " |", "|---" * (len(ests) + 2) + "|"]
        by_c = _group(fam, lambda r: r["c"])
        curves = defaultdict(list)
        for c in DETECTION_C:
            cr = by_c.get(c, [])
            if not cr:
                continue
            by_est = _group(cr, lambda r: r["estimator"])
            vals = []
            for e in ests:
                rate = _rate(by_est[e])
                curves[e].append((c, rate))
                vals.append(_fmt(rate))
            lines.append(f"| {c:g} | {len({r['task_id'] for r in cr})} | " + " | ".join(vals) + " |")
        half = []
        for e in ests:
            c50 = fifty_point(curves[e])
            points[(family, e)] = c50
            half.append(_fmt_c50(c50))
        lines.append("| **50% point** | | " + " | ".join(half) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out), points


def _fmt_c50(c50):
    """The 50%-detection point as printed: "> 5" above the sweep, "≤ 0.5" at or below its first point."""
    if c50 is None:
        return f"> {DETECTION_C[-1]:g}"
    if c50 <= DETECTION_C[0]:
        return f"≤ {DETECTION_C[0]:g}"
    return _fmt(c50, 2)


def fifty_point(curve):
    """Smallest c where exact recovery first reaches 50% (log-linear interpolation)."""
    for (c0, r0), (c1, r1) in zip(curve, curve[1:]):
        if r0 >= 50:
            return c0
        if r0 < 50 <= r1:
            t = (50 - r0) / (r1 - r0)
            return float(np.exp(np.log(c0) + t * (np.log(c1) - np.log(c0))))
    if curve and curve[0][1] >= 50:
        return curve[0][0]
    return None


def goals_table(rows, points):
    ests = _estimators_in(rows)
    lines = ["| goal (issue 4) | target | " + " | ".join(ests) + " |", "|---" * (len(ests) + 2) + "|"]

    def add(label, target, sel, metric=_rate):
        by_est = _group(sel, lambda r: r["estimator"])
        n = len({r["task_id"] for r in sel})
        vals = [_fmt(metric(by_est[e])) if by_est.get(e) else "—" for e in ests]
        lines.append(f"| {label} ({n} tasks) | {target} | " + " | ".join(vals) + " |")

    for family in ["linear_proxy", "linear_qk_known_v", "linear_qk_unknown_v"]:
        add(f"{family}, weakest spike ≥ 1.5× BBP", "≥ 99%",
            [r for r in rows if r["family"] == family and r["r_star"] > 0 and r["c"] >= 1.5])
    for family in ["linear_proxy", "linear_qk_known_v", "linear_qk_unknown_v"]:
        add(f"{family}, weakest spike ≥ 3× BBP (reference)", "",
            [r for r in rows if r["family"] == family and r["r_star"] > 0 and r["c"] >= 3])
    add("linear families, r*=0 ∪ spike ≥ 1.5×, T ≥ 1.25d or proxy", "≥ 99%",
        [r for r in rows if r["kind"] != "softmax" and (r["r_star"] == 0 or r["c"] >= 1.5)
         and (r["kind"] == "linear_proxy" or r["T"] >= 1.25 * r["d"])])
    add("softmax_unknown_v, logit scale ≤ 4, T ≥ d", "≥ 95%",
        [r for r in rows if r["family"] == "softmax_unknown_v" and r["logit_scale"] <= 4 and r["T"] >= r["d"]])
    add("softmax_unknown_v, logit scale ≤ 4, T ≥ d, within RStar's least-squares budget", "(≥ 95%)",
        [r for r in rows if r["family"] == "softmax_unknown_v" and r["logit_scale"] <= 4 and r["T"] >= r["d"]
         and r["residual_noise"]])
    add("softmax_unknown_v, logit scale ≤ 4, T ≥ d, noise-free gap at r* ≥ 2", "(≥ 95%)",
        [r for r in rows if r["family"] == "softmax_unknown_v" and r["logit_scale"] <= 4 and r["T"] >= r["d"]
         and (r["r_star"] == 0 or r.get("clean_gap", 0.0) >= 2)])
    add("softmax_known_v, logit scale ≤ 4, T ≥ d", "(≥ 95%)",
        [r for r in rows if r["family"] == "softmax_known_v" and r["logit_scale"] <= 4 and r["T"] >= r["d"]])
    add("false positives, all r*=0 tasks", "≤ 2%", [r for r in rows if r["r_star"] == 0],
        metric=lambda er: _fp(er)[0])
    add("exact recovery, all tasks (aggregate)", "best", rows)
    for family in ["linear_proxy", "linear_qk_unknown_v"]:
        vals = []
        for e in ests:
            if (family, e) not in points:
                vals.append("—")
            else:
                c50 = points[(family, e)]
                vals.append(_fmt_c50(c50))
        lines.append(f"| 50%-detection point, {family} (× BBP) | ≤ 1.3 | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def summarise(rows, det_rows):
    """All printed tables, as one markdown string."""
    parts = ["### Exact recovery per family and estimator (main grid)", "", table_main(rows), ""]
    est_rows = [r for r in rows if r["estimator"] != "Oracle"]
    parts += ["### Aggregate over all families (exact recovery %)", "",
              table_wide(est_rows, lambda r: "all families", ["all families"], "set"), "",
              table_wide(est_rows, lambda r: "linear families" if r["kind"] != "softmax" else "softmax families",
                         ["linear families", "softmax families"], "set", metric=_mae, digits=2)
              .replace("| set |", "| mean abs err |"), ""]
    det_md, points = detection_table(det_rows)
    parts += ["### Goals of issue 4", "", goals_table(rows, points), ""]
    parts += ["### Detection curve (same configurations at every c, fresh draws)", "", det_md, ""]
    for family in FAMILIES:
        fam = [r for r in rows if r["family"] == family]
        if not fam:
            continue
        parts += [f"### {family}: exact recovery % by regime", "",
                  table_wide(fam, t_regime, T_REGIMES, "T vs d"), "",
                  table_wide(fam, rank_bin, RANK_BINS, "r* / p"), "",
                  table_wide(fam, lambda r: r["tokens"], TOKENS, "tokens"), "",
                  table_wide(fam, n_bin, N_BINS, "n"), ""]
        if FAMILIES[family][0] != "softmax":
            parts += [table_wide(fam, lambda r: "residual σ² (exact under the model)" if r["residual_noise"]
                                 else "σ² from the bulk", ["residual σ² (exact under the model)", "σ² from the bulk"],
                                 "RStar's noise source"), ""]
        if FAMILIES[family][0] == "softmax":
            parts += [table_wide(fam, lambda r: "least squares" if r["residual_noise"] else "first order (over budget)",
                                 ["least squares", "first order (over budget)"], "RStar's inversion"), "",
                      table_wide(fam, lambda r: "exact (T ≤ 0.9 min(d, d_v))" if r["exact_inversion"] else "first-order",
                                 ["exact (T ≤ 0.9 min(d, d_v))", "first-order"],
                                 "paper's inversion (MP, Energy, Numerical, SoftmaxInv)"), "",
                      table_wide(fam, logit_bin, LOGIT_BINS, "logit scale"), "",
                      table_wide([r for r in fam if r["T"] >= r["d"]], logit_bin, LOGIT_BINS,
                                 "logit scale, T ≥ d"), "",
                      table_wide(fam, gap_bin, GAP_BINS, "noise-free gap at r*"), ""]
        else:
            parts += [table_wide([r for r in fam if r["r_star"] > 0], c_bin, C_BINS, "weakest spike c"), ""]
    return "\n".join(parts), points


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------

_STYLE = {
    "RStar": dict(color="black", lw=2.6, marker="o"),
    "MP": dict(color="tab:blue", lw=1.4, marker="s", ls="--"),
    "Energy": dict(color="tab:green", lw=1.4, marker="^"),
    "Numerical": dict(color="tab:gray", lw=1.4, marker="v", ls=":"),
    "SoftmaxInv": dict(color="tab:purple", lw=1.4, marker="D", ls="--"),
    "GD": dict(color="tab:orange", lw=1.6, marker="P"),
    "Minka": dict(color="tab:red", lw=1.6, marker="X"),
    "KN": dict(color="tab:brown", lw=1.6, marker="*", ms=9),
    "ER": dict(color="tab:pink", lw=1.6, marker="d"),
    "Oracle": dict(color="gray", lw=3, alpha=0.45, ls="-", marker=None),
}


def make_figures(rows, det_rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    written = []
    # 1. detection curves
    fams = [f for f in ["linear_proxy", "linear_qk_unknown_v"] if any(r["family"] == f for r in det_rows)]
    if fams:
        fig, axes = plt.subplots(1, len(fams), figsize=(6.5 * len(fams), 4.8), sharey=True, squeeze=False)
        for ax, family in zip(axes[0], fams):
            fam = [r for r in det_rows if r["family"] == family]
            by_est = _group(fam, lambda r: r["estimator"])
            for e in _estimators_in(fam):
                by_c = _group(by_est[e], lambda r: r["c"])
                cs = sorted(by_c)
                ax.plot(cs, [_rate(by_c[c]) for c in cs], label=e, **_STYLE.get(e, {}))
            ax.axvspan(0.45, 1.0, color="red", alpha=0.06)
            ax.axvline(1.0, color="red", lw=2, alpha=0.7, label="BBP threshold (second moment)")
            ax.text(0.72, 55, "below BBP: invisible\nin the second-moment\nstatistic (coherent\nstatistics still see it)",
                    color="red", ha="center", fontsize=7)
            ax.axvline(1.5, color="gray", lw=1, ls="--")
            ax.axhline(50, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.set_xlim(0.45, 5.5)
            ax.set_xticks(DETECTION_C)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xticklabels([f"{c:g}" for c in DETECTION_C], fontsize=8)
            ax.set_xlabel("weakest spike θ_r / √γ  (units of the BBP threshold; dashed: 1.5×)")
            n_cfg = len({r["task_id"].rsplit("/", 1)[0] for r in fam})
            ax.set_title(f"{family.replace('_', ' ')}: {n_cfg} configurations, a fresh draw at each c")
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("exact recovery of r* (%)")
        axes[0][0].legend(loc="upper left", fontsize=8, ncol=2)
        fig.suptitle("Detection curve: exact recovery vs weakest spike strength")
        fig.tight_layout()
        path = os.path.join(out_dir, "detection_curve.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    # 2. per family bars
    fams = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    if fams:
        ests = _estimators_in(rows)
        fig, ax = plt.subplots(figsize=(12, 4.8))
        width = 0.8 / len(ests)
        for j, e in enumerate(ests):
            vals = []
            for family in fams:
                er = [r for r in rows if r["family"] == family and r["estimator"] == e]
                vals.append(_rate(er) if er else np.nan)
            oracle = e == "Oracle"
            ax.bar(np.arange(len(fams)) + (j - (len(ests) - 1) / 2) * width, vals, width,
                   label="Oracle (reference)" if oracle else e, color="white" if oracle else _STYLE.get(e, {}).get("color"),
                   hatch="///" if oracle else None, edgecolor="gray" if oracle else "black", linewidth=0.6)
        ax.set_xticks(np.arange(len(fams)))
        ax.set_xticklabels([f.replace("_", " ") for f in fams])
        ax.set_ylabel("exact recovery of r* (%)")
        ax.set_ylim(0, 105)
        ax.axhline(99, color="gray", ls="--", lw=0.8)
        ax.set_title("Exact recovery per family on the sampled grid (all regimes, including non-identifiable ones)")
        ax.legend(ncol=len(ests), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1))
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, "recovery_by_family.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    # 3. recovery vs c and vs T/d on the main grid
    panels = [("linear families: weakest spike c (× BBP)", [r for r in rows if r["kind"] != "softmax"
                                                            and r["r_star"] > 0], c_bin, C_BINS),
              ("all families: T vs d", [r for r in rows if r["estimator"] != "Oracle"], t_regime, T_REGIMES),
              ("softmax families: logit scale, T ≥ d", [r for r in rows if r["kind"] == "softmax"
                                                         and r["T"] >= r["d"]], logit_bin, LOGIT_BINS)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), sharey=True)
    for ax, (title, sel, key, order) in zip(axes, panels):
        groups = _group(sel, key)
        order = [g for g in order if groups.get(g)]
        for e in _estimators_in(sel):
            vals = [_rate([r for r in groups[g] if r["estimator"] == e]) for g in order]
            ax.plot(range(len(order)), vals, label=e, **_STYLE.get(e, {}))
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels(order, fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.set_ylim(-2, 102)
    axes[0].set_ylabel("exact recovery of r* (%)")
    legend = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    labels = [e for e in ESTIMATORS if e in legend]
    fig.legend([legend[e] for e in labels], [e if e != "Oracle" else "Oracle (reference)" for e in labels],
               loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle("Exact recovery by regime (main grid)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = os.path.join(out_dir, "recovery_by_regime.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ---------------------------------------------------------------------------
# calibration check
# ---------------------------------------------------------------------------


def check_calibration(seeds=4):
    """Monte Carlo check of the spike-strength formulas: predicted vs observed top eigenvalue."""
    from rstar.estimators import make_inversion
    from rstar.marchenko_pastur import spike_sample_eigenvalue

    install_fast_patches()
    lines = ["| family | T | d | d_v | n | tokens | c | θ_r = c√γ | predicted λ_r/σ² | observed (mean ± sd) |"
             " QK approx θ / exact θ |", "|---" * 11 + "|"]
    configs = [("linear_proxy", 16, 12, 12, 500, "gaussian"), ("linear_proxy", 32, 16, 8, 300, "correlated"),
               ("linear_proxy", 24, 16, 32, 200, "student_t"), ("linear_qk_unknown_v", 64, 16, 16, 1000, "gaussian"),
               ("linear_qk_unknown_v", 48, 24, 12, 1000, "gaussian"),
               ("linear_qk_unknown_v", 64, 16, 32, 1000, "correlated")]
    for family, T, d, d_v, n, tokens in configs:
        for c in (2.0, 4.0):
            obs, pred, approx = [], [], []
            for s in range(seeds):
                task = dict(family=family, kind=FAMILIES[family][0], T=T, d=d, d_v=d_v, n=n, r_star=1,
                            tokens=tokens, sigma=0.1, c=c, spread=1.0, logit_scale=float("nan"), seed=1000 + s)
                X, Y, teacher, info = generate(task)
                inv = make_inversion(FAMILIES[family][1])
                stats = inv.new_stats(T, d, d_v)
                inv.update(stats, X, Y)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ws = inv.whiten(stats)
                gamma = T / (n * d_v) if family == "linear_proxy" else d / ws.n_columns
                theta = c * np.sqrt(gamma)
                obs.append(ws.eigenvalues[0] / 0.1**2)
                pred.append(float(spike_sample_eigenvalue(theta, gamma)))
                if family != "linear_proxy":
                    sv = teacher.singular_values[0]
                    approx.append(sv**2 * (T - d - 1) * (T + d + 1) / (d**2 * 0.1**2) / theta)
            lines.append(f"| {family} | {T} | {d} | {d_v} | {n} | {tokens} | {c:g} | {theta:.3f} | "
                         f"{np.mean(pred):.3f} | {np.mean(obs):.3f} ± {np.std(obs):.3f} | "
                         f"{_fmt(np.mean(approx), 2) if approx else '—'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def _write_csv(path, rows):
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))   # rows from an older run may lack a column
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)


_INT_FIELDS = ("T", "d", "d_v", "n", "r_star", "seed", "r_hat", "exact")
_BOOL_FIELDS = ("detection", "exact_inversion", "residual_noise", "shared")
_STR_FIELDS = ("family", "kind", "tokens", "task_id", "estimator", "warnings", "error", "p_values")


def _read_csv(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            for k, v in row.items():
                if k in _INT_FIELDS:
                    row[k] = int(v)
                elif k in _BOOL_FIELDS:
                    row[k] = v == "True"
                elif k not in _STR_FIELDS:
                    row[k] = float(v)
            rows.append(row)
    return rows


def _rows_of_other_families(run_dir, profile, seed, tasks):
    """The rows in an earlier run's ``rows.jsonl`` of the tasks not in ``tasks`` (same profile and seed)."""
    with open(os.path.join(run_dir, "run.json")) as fh:
        run = json.load(fh)
    if run["profile"] != profile or run["seed"] != seed:
        raise SystemExit(f"--rows-from {run_dir}: that run is profile {run['profile']!r}, seed {run['seed']}, "
                         f"not {profile!r}, seed {seed}")
    rerun = {t["family"] for t in tasks}   # their detection-sweep tasks are rerun too
    with open(os.path.join(run_dir, "rows.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r for r in rows if r["family"] not in rerun]


def replot(out_dir):
    """Rebuild summary.md and the figures from the CSVs of an earlier run."""
    main_rows = _read_csv(os.path.join(out_dir, "results.csv"))
    det_rows = _read_csv(os.path.join(out_dir, "detection.csv"))
    if not main_rows and os.path.exists(os.path.join(out_dir, "rows.jsonl")):  # an interrupted run
        with open(os.path.join(out_dir, "rows.jsonl")) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        main_rows = [r for r in rows if not r["detection"]]
        det_rows = [r for r in rows if r["detection"]]
        print(f"(partial run: {len({r['task_id'] for r in rows})} tasks read from rows.jsonl)")
    summary, _ = summarise(main_rows, det_rows)
    header = ""
    meta = os.path.join(out_dir, "run.json")
    previous = os.path.join(out_dir, "summary.md")
    if os.path.exists(previous):  # keep the header written by the run itself
        with open(previous) as fh:
            header = fh.read().split("###")[0].rstrip("\n") + "\n"
    elif os.path.exists(meta):
        with open(meta) as fh:
            run = json.load(fh)
        header = (f"command: `{run['command']}`  \nprofile: {run['profile']}, seed {run['seed']}, "
                  f"{run['n_tasks']} tasks, n_jobs={run['n_jobs']}  \nwall time {run['wall_seconds']:.0f} s; "
                  f"time inside fits and generators {run['fit_seconds']:.0f} s; {run['failed_fits']} failed fits\n")
    print(header)
    print(summary)
    with open(os.path.join(out_dir, "summary.md"), "w") as fh:
        fh.write(header + "\n" + summary + "\n")
    print("figures:", make_figures(main_rows, det_rows, out_dir))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid (< 5 minutes on 2 cores)")
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks-per-family", type=int, default=None)
    parser.add_argument("--detection-per-point", type=int, default=None)
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/out/recovery-{quick,full})")
    parser.add_argument("--exact-fit", action="store_true",
                        help="run the estimators' fit unmodified (also builds the predict operator; slower)")
    parser.add_argument("--no-share", action="store_true",
                        help="fit every rstar estimator in full (by default those after RStarEstimator reuse its "
                             "inversion and whitened statistic and run only their own rule; same rows)")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=None,
                        help="run only these families' tasks (the grid is drawn in full, so each task is the "
                             "same as in a run of every family)")
    parser.add_argument("--rows-from", metavar="DIR", default=None,
                        help="with --families: take the other families' rows (and the detection sweep, if its "
                             "families are not run) from an earlier run in DIR at the same profile and seed, so "
                             "the tables cover the whole grid after rerunning only what a change touches")
    parser.add_argument("--no-figures", action="store_true")
    parser.add_argument("--replot", metavar="DIR", default=None,
                        help="only rebuild summary.md and the figures from the CSVs in DIR")
    parser.add_argument("--check-calibration", action="store_true",
                        help="only print the Monte Carlo check of the spike-strength control")
    args = parser.parse_args(argv)

    warnings.simplefilter("ignore")
    if args.check_calibration:
        print(check_calibration())
        return 0
    if args.replot:
        replot(args.replot)
        return 0
    profile = "quick" if args.quick else "full"
    out_dir = args.out or os.path.join(ROOT, "benchmarks", "out", f"recovery-{profile}")
    os.makedirs(out_dir, exist_ok=True)
    tasks = make_grid(profile, args.seed, args.tasks_per_family, args.detection_per_point)
    kept_rows = []
    if args.rows_from and not args.families:
        parser.error("--rows-from needs --families")
    if args.families:
        tasks = [t for t in tasks if t["family"] in args.families]
        if args.rows_from:
            kept_rows = _rows_of_other_families(args.rows_from, profile, args.seed, tasks)
    # expensive tasks first so that the two workers finish together
    tasks.sort(key=lambda t: -t["n"] * t["T"] * t["d"] ** 2)
    from joblib import Parallel, delayed
    from tqdm import tqdm

    t0 = time.perf_counter()
    rows = []
    jobs = (delayed(run_task)(t, not args.exact_fit, not args.no_share) for t in tasks)
    if args.n_jobs == 1:
        results = (run_task(t, not args.exact_fit, not args.no_share) for t in tasks)
    else:
        results = Parallel(n_jobs=args.n_jobs, return_as="generator_unordered")(jobs)
    # rows are also streamed to rows.jsonl, so an interrupted run can still be summarised (--replot)
    with open(os.path.join(out_dir, "rows.jsonl"), "w") as stream:
        for row in kept_rows:   # first, so that this run's rows.jsonl serves a later --rows-from too
            stream.write(json.dumps(row) + "\n")
        for res in tqdm(results, total=len(tasks), desc="tasks", unit="task"):
            rows.extend(res)
            for row in res:
                stream.write(json.dumps(row) + "\n")
            stream.flush()
    elapsed = time.perf_counter() - t0
    rows.extend(kept_rows)
    rows.sort(key=lambda r: (r["task_id"], ESTIMATORS.index(r["estimator"])))
    main_rows = [r for r in rows if not r["detection"]]
    det_rows = [r for r in rows if r["detection"]]
    _write_csv(os.path.join(out_dir, "results.csv"), main_rows)
    _write_csv(os.path.join(out_dir, "detection.csv"), det_rows)
    summary, _ = summarise(main_rows, det_rows)
    n_err = sum(1 for r in rows if r["error"])
    cpu = sum(r["seconds"] for r in rows) + sum(r["gen_seconds"] for r in rows if r["estimator"] == "RStar")
    command = "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    kept_note = (f"rows of the families not run ({len({r['task_id'] for r in kept_rows})} tasks) from "
                 f"`{os.path.relpath(os.path.abspath(args.rows_from), ROOT)}`  \n") if kept_rows else ""
    header = (f"command: `{command}`  \n" + kept_note +
              f"profile: {profile}, seed {args.seed}, {len(tasks)} tasks "
              f"({len({r['task_id'] for r in main_rows})} main grid, "
              f"{len({r['task_id'] for r in det_rows})} detection sweep), n_jobs={args.n_jobs}, "
              f"fit={'exact' if args.exact_fit else 'fast (no predict operator)'}  \n"
              f"wall time {elapsed:.0f} s; time inside fits and generators {cpu:.0f} s; "
              f"{n_err} failed fits (counted as misses)\n")
    print()
    print(header)
    print(summary)
    with open(os.path.join(out_dir, "summary.md"), "w") as fh:
        fh.write(header + "\n" + summary + "\n")
    figures = [] if args.no_figures else make_figures(main_rows, det_rows, out_dir)
    import joblib
    import matplotlib
    import scipy
    import sklearn

    with open(os.path.join(out_dir, "run.json"), "w") as fh:
        json.dump(dict(command=command, profile=profile, seed=args.seed, n_tasks=len(tasks),
                       families=args.families or list(FAMILIES), rows_from=args.rows_from,
                       wall_seconds=round(elapsed, 1), fit_seconds=round(cpu, 1), n_jobs=args.n_jobs,
                       exact_fit=args.exact_fit, failed_fits=n_err, grid=PROFILES[profile],
                       detection_c=DETECTION_C, python=platform.python_version(), numpy=np.__version__,
                       scipy=scipy.__version__, sklearn=sklearn.__version__, joblib=joblib.__version__,
                       matplotlib=matplotlib.__version__, figures=figures), fh, indent=1)
    print("wrote", out_dir, ":", ", ".join(sorted(os.listdir(out_dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
