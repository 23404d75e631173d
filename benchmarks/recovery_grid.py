"""The recovery benchmark's grid: task families, sampling, generation with a calibrated spike strength, and the
oracle reference (used by ``recovery.py``; see its docstring for the spike-strength control)."""

import math
import os
import warnings

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from rstar.budgets import CostBudget  # noqa: E402
from rstar.inversions.token import moment_sums_fit  # noqa: E402

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
    from rstar.inversions import choose_inversion

    if family != "softmax_known_v":
        return False
    return choose_inversion("softmax", value_map_known=True, shape=(T, d, d_v)).name == "softmax_exact"


def _n_cap(family, T, d, d_v, prof):
    """Largest n allowed by the per-fit cost model of the family's inversion."""
    kind = FAMILIES[family][0]
    caps = [prof["max_entries"] / (T * max(d, d_v))]
    if kind == "linear_proxy":
        if moment_sums_fit(CostBudget(), T, d, d_v):  # rstar accumulates the (Td)^2 moment sums for its residual noise
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
    from rstar.inversions import make_inversion

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
    inv = QueryKeyInversion(centred=True, residual_noise=False, reweight=False, predict_sums=False)
    stats = inv.new_stats(T, d, Y_clean.shape[2])
    inv.update(stats, X, Y_clean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lam = inv.whiten(stats).eigenvalues
    if r >= d:
        return float("inf")
    return float(lam[r - 1] / lam[r]) if lam[r] > 0 else float("inf")



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



# ---------------------------------------------------------------------------
# calibration check
# ---------------------------------------------------------------------------


def check_calibration(seeds=4):
    """Monte Carlo check of the spike-strength formulas: predicted vs observed top eigenvalue."""
    from rstar.inversions import make_inversion
    from rstar.marchenko_pastur import spike_sample_eigenvalue

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
                         f"{_fmt_number(np.mean(approx), 2) if approx else '—'} |")
    return "\n".join(lines)




def _fmt_number(x, digits=1):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"
