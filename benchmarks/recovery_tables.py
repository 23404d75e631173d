"""The recovery benchmark's tables, figures and CSV files (used by ``recovery.py`` and ``alpha_calibration.py``)."""

import csv
import json
import math
import os
from collections import defaultdict

import numpy as np

from recovery_grid import BASELINE_NAMES, DETECTION_C, ESTIMATORS, FAMILIES, PROFILES, RSTAR_ESTIMATORS, TOKENS  # noqa: F401

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
_STR_FIELDS = ("family", "kind", "tokens", "task_id", "estimator", "warnings", "error", "p_values", "inversion")


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


