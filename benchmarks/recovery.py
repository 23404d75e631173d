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
docs/validation.md.

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

Speed. ``fit`` also accumulates the query-key moment sums behind ``predict``
(``d^4`` entries), which cost several times the rank estimate and do not change
``rank_``; the benchmark skips them with the estimators' public option
``predict_sums=False`` (``--exact-fit`` keeps them). The rstar estimators on
the same inversion differ only in their rank rule, so each after the first
runs its rule on the first one's statistic with ``fit_from`` (``RStarEstimator``
first; on softmax, whose RStar inversion is the least squares, the paper's
inversion is fitted once more, by ``MPRankEstimator``; column ``shared``, whose
``seconds`` then count the rule alone); ``--no-share`` fits each in full. The
rows are the same (tested). Nothing in rstar is patched.

The module is split: ``recovery_grid.py`` (families, sampling, generation),
``recovery_tables.py`` (tables, figures, CSV files) and this file (running).
"""

import argparse
import json
import os
import platform
import sys
import time
import warnings

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from recovery_grid import *  # noqa: E402,F401,F403  (the grid: families, sampling, generation)
from recovery_grid import BASELINE_NAMES, ESTIMATORS, FAMILIES, PROFILES, ROOT, generate, make_grid, oracle_rank  # noqa: E402
from recovery_grid import check_calibration  # noqa: E402
from recovery_tables import *  # noqa: E402,F401,F403  (tables and figures)
from recovery_tables import _fp, _rate, _read_csv, _rows_of_other_families, _write_csv, make_figures, replot, summarise  # noqa: E402,F401

def _estimators(task, V, predict_sums):
    from rstar import (
        EnergyRankEstimator,
        MPRankEstimator,
        NumericalRankEstimator,
        RStarEstimator,
        SoftmaxInversionEstimator,
    )

    op = FAMILIES[task["family"]][1]
    kw = dict(value_map=V, predict_sums=predict_sums)
    out = [("RStar", RStarEstimator(operator=op, **kw)),
           ("MP", MPRankEstimator(operator=op, **kw)),
           ("Energy", EnergyRankEstimator(operator=op, **kw)),
           ("Numerical", NumericalRankEstimator(operator=op, **kw))]
    if op == "softmax":
        out.append(("SoftmaxInv", SoftmaxInversionEstimator(**kw)))
    return out


def _fit_from_any(est, fitted):
    """``est.fit_from(f)`` for the first ``f`` in ``fitted`` fitted on the same inversion (True), else False."""
    for other in fitted:
        try:
            est.fit_from(other)
            return True
        except ValueError:
            continue
    return False


def run_task(task, fast=True, share=True):
    """Fit every estimator and baseline on one generated task; one row per estimator.

    ``fast`` skips the moment sums behind ``predict`` (``predict_sums=False``; ``rank_`` is unchanged). With
    ``share``, each rstar estimator after the first on an inversion runs only its own rule on that one's
    statistic (``fit_from``); its ``seconds`` then count only its rule (column ``shared``).
    """
    from threadpoolctl import threadpool_limits

    from rstar.baselines import BASELINES

    with threadpool_limits(1):
        t0 = time.perf_counter()
        X, Y, teacher, info = generate(task)
        t_gen = time.perf_counter() - t0
        V = teacher.value_map if FAMILIES[task["family"]][2] else None
        rows = []
        base = {k: v for k, v in task.items()}
        base.update(gamma=info.get("gamma", float("nan")), clean_gap=info.get("clean_gap", float("nan")),
                    gen_seconds=round(t_gen, 4), exact_inversion=bool(info.get("exact_inversion", False)))
        ref, fitted = None, []
        for name, est in _estimators(task, V, predict_sums=not fast):
            caught = []
            shared = False
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    # the first estimator fitted on each inversion lends its statistic to the later ones
                    # (softmax: RStar's least squares, then the paper's inversion for the others)
                    shared = share and _fit_from_any(est, fitted)
                    if not shared:
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
            diag = dict(noise_ratio=float("nan"), n_columns=float("nan"), p_values="", inversion="")
            if not error:
                diag["inversion"] = est.inversion_
            if name == "RStar" and not error:
                ref = est
                # the sequential p-values: rank_ is the count of leading ones below alpha, so the rank at
                # any other level can be read off them (benchmarks/alpha_calibration.py)
                diag.update(noise_ratio=est.noise_variance_ / task["sigma"] ** 2, n_columns=est.n_columns_,
                            p_values=" ".join(f"{q:.6g}" for q in est.p_values_))
            rows.append(dict(base, estimator=name, r_hat=r_hat, seconds=round(seconds, 4), shared=shared,
                             warnings="|".join(caught), error=error, **diag))
        # whether RStar's noise level came from a residual (not the bulk): what it actually used
        residual = ref is not None and ref.noise_source_ not in ("bulk", "fitted bulk")
        for row in rows:
            row["residual_noise"] = residual
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
                             n_columns=float("nan"), p_values="", inversion="", residual_noise=residual))
        if task["kind"] != "softmax":
            p = task["T"] if task["kind"] == "linear_proxy" else task["d"]
            thetas = info.get("thetas", np.zeros(0))
            m = info.get("n_columns", float(task["n"] * task["d_v"]))
            rows.append(dict(base, estimator="Oracle", r_hat=oracle_rank(thetas, p, m, task["seed"] + 1), seconds=0.0,
                             shared=False, warnings="", error="", noise_ratio=float("nan"), n_columns=m,
                             p_values="", inversion="", residual_noise=residual))
    for row in rows:
        row["abs_err"] = abs(row["r_hat"] - row["r_star"]) if row["r_hat"] >= 0 else float("nan")
        row["exact"] = int(row["r_hat"] == row["r_star"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid (< 5 minutes on 2 cores)")
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks-per-family", type=int, default=None)
    parser.add_argument("--detection-per-point", type=int, default=None)
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/out/recovery-{quick,full})")
    parser.add_argument("--exact-fit", action="store_true",
                        help="also accumulate the moment sums behind predict (predict_sums=True; slower, same ranks)")
    parser.add_argument("--no-share", action="store_true",
                        help="fit every rstar estimator in full (by default those after RStarEstimator reuse its "
                             "statistic through fit_from and run only their own rule; same rows)")
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
              f"fit={'with predict sums' if args.exact_fit else 'predict_sums=False'}  \n"
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

