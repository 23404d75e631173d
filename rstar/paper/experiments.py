"""The paper's experiments (theory §3) as library functions.

Each experiment function returns an :class:`ExperimentResult`: tidy
``records`` (one dict of plain numbers per fitted model), a ``summary`` (the
rows of the printed table), the configuration it ran with and the wall time.
``result.to_markdown()`` prints the table, ``result.plot()`` draws a
matplotlib figure (object-oriented API, no pyplot state, Agg-safe) and
``result.to_dict()`` is JSON-serialisable.

========== ================================================================
function   what it measures
========== ================================================================
table1     linear proxy (B0): rank sweep against the noise floor
           (insufficiency, attainment), over-parameterised recovery
           (MP-corrected R_eff) and the data-only rank.
table2     the interpolation ladder B0 → B1 → B1c → B2 → B3 on the same
           fixed-operator task ``Y = A* X V* + E`` (static transfer).
table3     attention-native teachers (linear QK and softmax): rank sweep,
           recovery (R_eff / R̃_eff) and the data-only rank.
frontier   data-only r̂ of every estimator beside the trained student's
           recovered rank, across logit scale and problem size, all fitted
           through one ``sklearn.model_selection.cross_validate`` loop.
========== ================================================================

Every risk is the held-out *test* risk: the mean per-sample squared error
``||Y - Y_hat||_F^2`` on fresh samples of the same teacher, whose Bayes value
is the noise floor ``sigma^2 T d_v`` (theory §2). The trained students need
torch (``pip install "rstar[torch]"``); plots need matplotlib.
"""

import copy
import time
from dataclasses import dataclass, field

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import KFold, cross_validate

from ..datasets import make_attention_task, make_linear_proxy
from ..estimators import (EnergyRankEstimator, MPRankEstimator, NumericalRankEstimator, RStarEstimator,
                          SoftmaxInversionEstimator)
from ..exceptions import IllConditionedInversionWarning, UnidentifiableRankWarning
from ..metrics import make_rank_scorer, sample_risk, token_r2_score, token_r2_scorer

__all__ = ["ExperimentResult", "EXPERIMENTS", "CONFIGS", "table1", "table2", "table3", "frontier",
           "frontier_estimators", "run_experiment", "insufficiency_bound", "markdown_table", "plot_table1",
           "plot_table2", "plot_table3", "plot_frontier"]

EXPERIMENTS = ("table1", "table2", "table3", "frontier")

_CLASS = {"linear_proxy": "B0", "linear_qk": "B1", "linear_qk_full": "B1c", "softmax": "B2", "block": "B3"}

# Student training settings: Adam, full batch, small initialisation, early stop on plateaus.
_STUDENT_FULL = dict(lr=1e-2, init_scale=1e-2, max_epochs=3000, patience=100, max_lr_drops=3)
_STUDENT_QUICK = dict(lr=1e-2, init_scale=1e-2, max_epochs=1500, patience=50, max_lr_drops=3)

#: sizes of every experiment, ``CONFIGS[name]["quick" | "full"]``
CONFIGS = {
    "table1": {
        "full": dict(seq_len=16, n_features=12, rank=3, noise=0.05, n_train=2000, n_test=1000,
                     ranks=[1, 2, 3, 4, 5, 6, 8, 12], seeds=3, student=_STUDENT_FULL),
        "quick": dict(seq_len=16, n_features=12, rank=3, noise=0.05, n_train=1000, n_test=500,
                      ranks=[1, 2, 3, 4, 6], seeds=1, student=_STUDENT_QUICK),
    },
    "table2": {
        "full": dict(seq_len=16, n_features=12, rank=3, noise=0.05, n_train=2000, n_test=1000, seeds=1,
                     student=_STUDENT_FULL, block_max_epochs=600),
        "quick": dict(seq_len=16, n_features=12, rank=3, noise=0.05, n_train=600, n_test=300, seeds=1,
                      student=dict(_STUDENT_QUICK, max_epochs=400, patience=30), block_max_epochs=150),
    },
    "table3": {
        "full": dict(seq_len=16, n_features=12, rank=3, noise=0.05, logit_scale=2.0, n_train=2000, n_test=1000,
                     ranks=[1, 2, 3, 4, 5, 6], seeds=2, student=_STUDENT_FULL),
        "quick": dict(seq_len=16, n_features=12, rank=3, noise=0.05, logit_scale=2.0, n_train=800, n_test=400,
                      ranks=[1, 2, 3, 4], seeds=1, student=_STUDENT_QUICK),
    },
    "frontier": {
        "full": dict(rank=3, noise=0.05, logit_scales=[1.0, 2.0, 4.0, 6.0],
                     sizes=[(16, 12, 2000), (32, 16, 2000), (8, 16, 2000)], n_splits=2, student=_STUDENT_FULL),
        "quick": dict(rank=3, noise=0.05, logit_scales=[1.0, 4.0], sizes=[(16, 12, 800)], n_splits=2,
                      student=dict(_STUDENT_QUICK, patience=30)),
    },
}


@dataclass
class ExperimentResult:
    """Outcome of one experiment.

    Attributes
    ----------
    name : str
        ``"table1"``, ``"table2"``, ``"table3"`` or ``"frontier"``.
    records : list of dict
        One tidy record (plain numbers and strings) per fitted model.
    summary : list of dict
        The rows of the printed table.
    columns : list of str
        Column order of ``summary``.
    config : dict
        The configuration it ran with.
    elapsed : float
        Wall time in seconds.
    notes : list of str
        One-line findings, printed under the table.
    """

    name: str
    records: list
    summary: list
    columns: list
    config: dict
    elapsed: float = 0.0
    notes: list = field(default_factory=list)

    def to_markdown(self):
        """The summary as a markdown table (with the notes under it).

        Returns
        -------
        str
        """
        return markdown_table(self.summary, self.columns) + "".join(f"\n\n{n}" for n in self.notes)

    def to_dict(self):
        """JSON-serialisable dict of everything measured.

        Returns
        -------
        dict
        """
        return _jsonable(dict(name=self.name, config=self.config, elapsed_s=self.elapsed, summary=self.summary,
                              notes=self.notes, records=self.records))

    def plot(self):
        """Draw this experiment's figure.

        Returns
        -------
        matplotlib.figure.Figure
        """
        return _PLOTS[self.name](self)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def markdown_table(rows, columns):
    """Format a list of dicts as a GitHub markdown table.

    Parameters
    ----------
    rows : list of dict
    columns : list of str

    Returns
    -------
    str

    Examples
    --------
    >>> from rstar.paper.experiments import markdown_table
    >>> print(markdown_table([{"r": 1, "risk": 0.48}], ["r", "risk"]))
    | r | risk |
    |---|---|
    | 1 | 0.48 |
    """
    def fmt(v):
        if v is None:
            return ""
        if isinstance(v, (float, np.floating)):
            if not np.isfinite(v):
                return str(v)
            a = abs(v)
            return f"{v:.4g}" if a == 0 or 1e-3 <= a < 1e5 else f"{v:.3e}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def insufficiency_bound(singular_values, value_map, rank):
    """Smallest excess risk of any rank-``rank`` linear-proxy model (Theorem 1).

    For tokens with i.i.d. N(0, 1) entries, ``E ||A* X V* - A X V||_F^2 =
    ||A* ⊗ V* - A ⊗ V||_F^2``; minimised over V and over A of rank <= r
    (Eckart–Young–Mirsky after the Van Loan–Pitsianis rearrangement) this is
    ``||V*||_F^2 * sum_{j>r} sigma_j(A*)^2``.

    Parameters
    ----------
    singular_values : array-like
        Singular values of the teacher's A*.
    value_map : ndarray of shape (d, d_v)
        The teacher's V*.
    rank : int
        The student's rank r.

    Returns
    -------
    float

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.paper.experiments import insufficiency_bound
    >>> insufficiency_bound([1.0, 1.0, 1.0], np.eye(2), 1)
    4.0
    """
    s = np.sort(np.asarray(singular_values, dtype=np.float64))[::-1]
    return float(np.sum(np.asarray(value_map, dtype=np.float64) ** 2) * np.sum(s[int(rank):] ** 2))


# --------------------------------------------------------------------- helpers
def _config(name, quick, overrides):
    cfg = copy.deepcopy(CONFIGS[name]["quick" if quick else "full"])
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown configuration keys for {name}: {sorted(unknown)}; known: {sorted(cfg)}.")
    cfg.update(copy.deepcopy(overrides))
    cfg["quick"] = bool(quick)
    return cfg


def _student(kind, rank, cfg, device, seed, verbose, **extra):
    from ..students import AttentionStudent

    params = dict(cfg["student"], **extra)
    return AttentionStudent(kind=kind, rank=rank, device=device, random_state=seed, verbose=verbose, **params)


def _teacher_split(make_task, cfg, seed, **task):
    """Draw ``n_train + n_test`` samples of ``make_task``'s teacher with ``cfg``'s sizes.

    Returns ``(Xtr, Ytr, Xte, Yte, teacher, noise_floor)``.
    """
    n_train = cfg["n_train"]
    X, Y, teacher = make_task(n_train + cfg["n_test"], seq_len=cfg["seq_len"], n_features=cfg["n_features"],
                              rank=cfg["rank"], noise=cfg["noise"], random_state=seed, return_teacher=True, **task)
    return X[:n_train], Y[:n_train], X[n_train:], Y[n_train:], teacher, float(teacher.noise_floor)


def _measure(kind):
    """The effective-rank measure of a student class: R_eff for the linear ones, R̃_eff otherwise."""
    return "R_eff" if kind in ("linear_proxy", "linear_qk", "linear_qk_full") else "R̃_eff"


def _estimator_labels(records):
    """The ``estimator`` labels of ``records``, each once, in order of first appearance."""
    return list(dict.fromkeys(x["estimator"] for x in records))


def _student_record(student, Xtr, Ytr, Xte, Yte, floor, **extra):
    t0 = time.perf_counter()
    student.fit(Xtr, Ytr)
    wall = time.perf_counter() - t0
    pred = student.predict(Xte)
    test_risk = sample_risk(Yte, pred)
    rec = dict(
        estimator="AttentionStudent", student_class=_CLASS[student.kind], kind=student.kind,
        rank_param=student.rank, test_risk=test_risk, train_risk=float(student.train_risk_),
        noise_floor=floor, risk_ratio=test_risk / floor, test_r2=token_r2_score(Yte, pred),
        rank_=int(student.rank_), effective_rank_=float(student.effective_rank_),
        raw_effective_rank=float(student.raw_effective_rank_), noise_threshold=float(student.noise_threshold_),
        kernel_singular_values=student.kernel_singular_values_.tolist(), n_epochs=int(student.n_iter_),
        fit_time=wall, device=student.device_,
    )
    rec.update(extra)
    return rec


def _data_only_record(est, X, Y, **extra):
    t0 = time.perf_counter()
    est.fit(X, Y)
    wall = time.perf_counter() - t0
    rec = dict(estimator=type(est).__name__, operator=getattr(est, "operator", "softmax"),
               value_map_known=est.value_map is not None, rank_=int(est.rank_),
               effective_rank_=float(est.effective_rank_), spectrum=np.asarray(est.spectrum_).tolist(),
               threshold=float(est.threshold_), fit_time=wall)
    rec.update(extra)
    return rec


def _mean(records, key):
    vals = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def _ranks(records):
    return ", ".join(str(r["rank_"]) for r in records)


def _done(name, cfg, records, summary, columns, notes, t0):
    return ExperimentResult(name=name, records=records, summary=summary, columns=columns, config=cfg,
                            elapsed=time.perf_counter() - t0, notes=notes)


# --------------------------------------------------------------------- table 1
def table1(*, quick=False, device="auto", random_state=0, verbose=0, **overrides):
    """Table 1: the linear proxy (B0) — insufficiency, attainment, recovery, data-only rank.

    Task ``Y = A* X V* + E`` (T=16, d=d_v=12, r*=3 with equal singular values,
    sigma=0.05, noise floor 0.48). A rank-r B0 student is trained for each r
    in ``ranks`` (rank sweep), an over-parameterised one (r = T, small
    initialisation) for recovery, and the data-only estimators on the same
    training data.

    Parameters
    ----------
    quick : bool, default=False
        Use the small configuration ``CONFIGS["table1"]["quick"]``.
    device : str, default="auto"
        Passed to every :class:`~rstar.students.AttentionStudent`.
    random_state : int, default=0
        Seed ``k`` uses data seed ``random_state + 1000 k`` and student seed
        ``random_state + k``.
    verbose : int, default=0
        Progress bars of the students.
    **overrides
        Replace configuration entries (``n_train``, ``ranks``, ``seeds``, ``student`` ...).

    Returns
    -------
    ExperimentResult
        ``records`` have ``part`` in {"rank_sweep", "recovery", "data_only"}.

    Examples
    --------
    >>> from rstar.paper.experiments import table1
    >>> res = table1(quick=True, ranks=[3], n_train=300, n_test=100,
    ...              student=dict(max_epochs=200))  # doctest: +SKIP
    >>> res.summary[0]["r"]  # doctest: +SKIP
    3
    """
    t0 = time.perf_counter()
    cfg = _config("table1", quick, overrides)
    records = []
    for k in range(cfg["seeds"]):
        Xtr, Ytr, Xte, Yte, teacher, floor = _teacher_split(make_linear_proxy, cfg, random_state + 1000 * k)
        common = dict(experiment="table1", task="linear_proxy", seed=k, true_rank=teacher.rank,
                      n_train=cfg["n_train"], seq_len=cfg["seq_len"], n_features=cfg["n_features"])
        for r in cfg["ranks"]:
            st = _student("linear_proxy", r, cfg, device, random_state + k, verbose)
            bound = insufficiency_bound(teacher.singular_values, teacher.value_map, r)
            records.append(_student_record(st, Xtr, Ytr, Xte, Yte, floor, part="rank_sweep",
                                           excess_bound=bound, **common))
        st = _student("linear_proxy", None, cfg, device, random_state + k, verbose)
        records.append(_student_record(st, Xtr, Ytr, Xte, Yte, floor, part="recovery", excess_bound=0.0, **common))
        for est in (NumericalRankEstimator("linear_proxy"), MPRankEstimator("linear_proxy"),
                    RStarEstimator("linear_proxy")):
            records.append(_data_only_record(est, Xtr, Ytr, part="data_only", noise_floor=floor, **common))

    summary = []
    for r in cfg["ranks"] + [None]:
        rows = [x for x in records if x["part"] in ("rank_sweep", "recovery") and x["rank_param"] == r]
        summary.append({
            "r": f"{r}" if r is not None else f"None (over-param, width {cfg['seq_len']})",
            "test risk": _mean(rows, "test_risk"), "risk / floor": _mean(rows, "risk_ratio"),
            "EYM excess bound": _mean(rows, "excess_bound"), "train risk": _mean(rows, "train_risk"),
            "student rank_": _ranks(rows), "MP-corrected R_eff": _mean(rows, "effective_rank_"),
            "raw R_eff": _mean(rows, "raw_effective_rank"), "epochs": _mean(rows, "n_epochs"),
            "fit s": _mean(rows, "fit_time"),
        })
    for name in ("NumericalRankEstimator", "MPRankEstimator", "RStarEstimator"):
        rows = [x for x in records if x["part"] == "data_only" and x["estimator"] == name]
        summary.append({"r": f"data-only {name}", "student rank_": _ranks(rows),
                        "MP-corrected R_eff": _mean(rows, "effective_rank_"), "fit s": _mean(rows, "fit_time")})
    floor = records[0]["noise_floor"]
    rec = [x for x in records if x["part"] == "recovery"]
    data_t = _mean([x for x in records if x["estimator"] == "RStarEstimator"], "fit_time")
    notes = [
        f"Noise floor sigma^2 T d_v = {floor:.4g}. Risks are held-out test risks (n_test = {cfg['n_test']}), "
        f"mean over {cfg['seeds']} seed(s); 'EYM excess bound' is the smallest possible excess for rank r "
        "(Theorem 1), 'student rank_' lists each seed.",
        f"Training time of the over-parameterised student / data-only RStarEstimator on the same "
        f"{cfg['n_train']} samples: {_mean(rec, 'fit_time'):.3g} s / {data_t:.3g} s = "
        f"{_mean(rec, 'fit_time') / data_t:.3g}x.",
    ]
    return _done("table1", cfg, records, summary,
                 ["r", "test risk", "risk / floor", "EYM excess bound", "train risk", "student rank_",
                  "MP-corrected R_eff", "raw R_eff", "epochs", "fit s"], notes, t0)


# --------------------------------------------------------------------- table 2
def table2(*, quick=False, device="auto", random_state=0, verbose=0, **overrides):
    """Table 2: static transfer — the ladder B0 → B1 → B1c → B2 → B3 on one fixed-operator task.

    Every student is trained on the Table 1 task ``Y = A* X V* + E``
    (rank A* = r* = 3) at r = r* (B1c: unconstrained kernel) for attainment,
    and over-parameterised (r = None) for the effective rank of its learned
    static kernel. The query–key data-only estimators are run on the same
    data to show what a static-kernel rank reads off a fixed-operator task.

    Parameters
    ----------
    quick : bool, default=False
    device : str, default="auto"
    random_state : int, default=0
    verbose : int, default=0
    **overrides
        Replace configuration entries (``block_max_epochs`` caps B3's epochs).

    Returns
    -------
    ExperimentResult
    """
    t0 = time.perf_counter()
    cfg = _config("table2", quick, overrides)
    ladder = [("linear_proxy", cfg["rank"]), ("linear_proxy", None), ("linear_qk", cfg["rank"]),
              ("linear_qk", None), ("linear_qk_full", None), ("softmax", cfg["rank"]), ("softmax", None),
              ("block", cfg["rank"]), ("block", None)]
    records = []
    for k in range(cfg["seeds"]):
        Xtr, Ytr, Xte, Yte, teacher, floor = _teacher_split(make_linear_proxy, cfg, random_state + 1000 * k)
        common = dict(experiment="table2", task="linear_proxy (fixed A*)", seed=k, true_rank=teacher.rank,
                      n_train=cfg["n_train"])
        for kind, r in ladder:
            extra = {"max_epochs": cfg["block_max_epochs"]} if kind == "block" else {}
            st = _student(kind, r, cfg, device, random_state + k, verbose, **extra)
            part = "recovery" if (r is None and kind != "linear_qk_full") else "attainment"
            records.append(_student_record(st, Xtr, Ytr, Xte, Yte, floor, part=part, **common))
        for op in ("linear_proxy", "linear_qk", "softmax"):
            records.append(_data_only_record(RStarEstimator(op), Xtr, Ytr, part="data_only", noise_floor=floor,
                                             **common))
    summary = []
    for kind in ("linear_proxy", "linear_qk", "linear_qk_full", "softmax", "block"):
        att = [x for x in records if x.get("kind") == kind and x["part"] == "attainment"]
        rec = [x for x in records if x.get("kind") == kind and x["part"] == "recovery"] or att
        measure = _measure(kind)
        summary.append({
            "class": f"{_CLASS[kind]} ({kind})", "r": "full (d x d)" if kind == "linear_qk_full" else cfg["rank"],
            "test risk at r": _mean(att, "test_risk"), "risk / floor": _mean(att, "risk_ratio"),
            "test R²": _mean(att, "test_r2"), "attains floor (< 1.05x)": "yes" if _mean(att, "risk_ratio") < 1.05
            else "no",
            "over-param risk / floor": _mean(rec, "risk_ratio"),
            "over-param kernel rank_": _ranks(rec), "measure": measure,
            "MP-corrected eff. rank": _mean(rec, "effective_rank_"), "raw eff. rank": _mean(rec, "raw_effective_rank"),
        })
    notes = [f"Task: Y = A* X V* + E, T={cfg['seq_len']}, d={cfg['n_features']}, r*={cfg['rank']}, "
             f"noise floor {floor:.4g}; held-out test risk (n_test = {cfg['n_test']}). B1c has no rank "
             "parameter: its row is the unconstrained kernel. The over-parameterised columns measure the learned "
             "static kernel (A for B0, W_Q W_K^T otherwise)."]
    for x in (r for r in records if r["part"] == "data_only"):
        notes.append(f"Data-only RStarEstimator(operator={x['operator']!r}) on the same data: "
                     f"rank_ = {x['rank_']}, effective rank {x['effective_rank_']:.3g}.")
    return _done("table2", cfg, records, summary,
                 ["class", "r", "test risk at r", "risk / floor", "test R²", "attains floor (< 1.05x)",
                  "over-param risk / floor", "over-param kernel rank_", "measure", "MP-corrected eff. rank",
                  "raw eff. rank"], notes, t0)


# --------------------------------------------------------------------- table 3
def table3(*, quick=False, device="auto", random_state=0, verbose=0, **overrides):
    """Table 3: attention-native teachers (linear QK and softmax) — the bound structure again.

    For each teacher ``Y = Attn_{K*, V*}(X) + E`` with rank K* = r*
    (:func:`rstar.datasets.make_attention_task`), a student of the same class
    is trained at each r in ``ranks`` (insufficiency, attainment) and
    over-parameterised (recovery: MP-corrected R_eff for linear QK, R̃_eff for
    softmax), and the data-only estimators run on the same data.

    Parameters
    ----------
    quick : bool, default=False
    device : str, default="auto"
    random_state : int, default=0
    verbose : int, default=0
    **overrides

    Returns
    -------
    ExperimentResult
    """
    t0 = time.perf_counter()
    cfg = _config("table3", quick, overrides)
    records = []
    for teacher_kind in ("linear_qk", "softmax"):
        for k in range(cfg["seeds"]):
            Xtr, Ytr, Xte, Yte, teacher, floor = _teacher_split(make_attention_task, cfg, random_state + 1000 * k,
                                                                kind=teacher_kind, logit_scale=cfg["logit_scale"])
            common = dict(experiment="table3", task=teacher_kind, seed=k, true_rank=teacher.rank,
                          n_train=cfg["n_train"], logit_scale=cfg["logit_scale"])
            for r in cfg["ranks"] + [None]:
                st = _student(teacher_kind, r, cfg, device, random_state + k, verbose)
                rec = _student_record(st, Xtr, Ytr, Xte, Yte, floor,
                                      part="rank_sweep" if r is not None else "recovery", **common)
                if r is None:  # raw numerical rank of the learned kernel (numpy default tolerance)
                    s = np.asarray(rec["kernel_singular_values"])
                    rec["raw_numerical_rank"] = int(np.sum(s > s[0] * s.size * np.finfo(np.float32).eps))
                records.append(rec)
            for est in (NumericalRankEstimator(teacher_kind), EnergyRankEstimator(teacher_kind),
                        RStarEstimator(teacher_kind)):
                records.append(_data_only_record(est, Xtr, Ytr, part="data_only", noise_floor=floor, **common))
    summary = []
    for teacher_kind in ("linear_qk", "softmax"):
        measure = _measure(teacher_kind)
        for r in cfg["ranks"] + [None]:
            rows = [x for x in records if x["task"] == teacher_kind and x.get("rank_param", -1) == r
                    and x["estimator"] == "AttentionStudent"]
            summary.append({
                "teacher": teacher_kind, "student": _CLASS[teacher_kind],
                "r": r if r is not None else "None (over-param)", "test risk": _mean(rows, "test_risk"),
                "risk / floor": _mean(rows, "risk_ratio"), "student rank_": _ranks(rows),
                "measure": measure, "MP-corrected eff. rank": _mean(rows, "effective_rank_"),
                "raw eff. rank": _mean(rows, "raw_effective_rank"),
                "raw numerical rank": _mean(rows, "raw_numerical_rank"), "fit s": _mean(rows, "fit_time"),
            })
        for name in ("NumericalRankEstimator", "EnergyRankEstimator", "RStarEstimator"):
            rows = [x for x in records if x["task"] == teacher_kind and x["estimator"] == name]
            summary.append({"teacher": teacher_kind, "student": f"data-only {name}", "student rank_": _ranks(rows),
                            "MP-corrected eff. rank": _mean(rows, "effective_rank_"),
                            "fit s": _mean(rows, "fit_time")})
    floor = records[0]["noise_floor"]
    notes = [f"T={cfg['seq_len']}, d={cfg['n_features']}, r*={cfg['rank']}, sigma={cfg['noise']}, logit scale "
             f"{cfg['logit_scale']}, noise floor {floor:.4g}; held-out test risk (n_test = {cfg['n_test']}), "
             f"mean over {cfg['seeds']} seed(s). 'raw numerical rank' counts the learned kernel's singular values "
             "above numpy's float32 default tolerance, with no noise correction."]
    return _done("table3", cfg, records, summary,
                 ["teacher", "student", "r", "test risk", "risk / floor", "student rank_", "measure",
                  "MP-corrected eff. rank", "raw eff. rank", "raw numerical rank", "fit s"], notes, t0)


# ------------------------------------------------------------------- frontier
def frontier_estimators(operator, value_map=None, student=None, device="auto", random_state=0, verbose=0):
    """The list of estimators compared on the predictability frontier.

    Parameters
    ----------
    operator : {"linear_qk", "softmax"}
    value_map : ndarray or None
        When given (softmax only), adds the exact inversion with known V.
    student : dict or None
        :class:`~rstar.students.AttentionStudent` parameters; None leaves the
        student out.
    device, random_state, verbose
        For the student.

    Returns
    -------
    list of (str, estimator)
    """
    ests = [("numerical", NumericalRankEstimator(operator)), ("MP", MPRankEstimator(operator)),
            ("energy", EnergyRankEstimator(operator)), ("RStar", RStarEstimator(operator))]
    if operator == "softmax" and value_map is not None:
        ests.append(("softmax-exact (V known)", SoftmaxInversionEstimator(value_map=value_map, method="exact")))
    if student is not None:
        from ..students import AttentionStudent

        ests.append(("student", AttentionStudent(kind=operator, rank=None, device=device, random_state=random_state,
                                                 verbose=verbose, **student)))
    return ests


def frontier(*, quick=False, device="auto", random_state=0, verbose=0, **overrides):
    """Predictability frontier: data-only r̂ beside the trained student's recovered rank.

    For each operator (linear QK, softmax), logit scale and size (T, d, n),
    every estimator of :func:`frontier_estimators` — the data-only ones and the
    over-parameterised student — goes through the same
    ``cross_validate(est, X, Y, cv=KFold(n_splits), scoring=..., return_estimator=True)``
    call; each fold gives a rank, an effective rank, the held-out token R²
    and the fit time. The value map is unknown to every data-only estimator
    except the exact softmax inversion, added where it applies (d >= T).

    Parameters
    ----------
    quick : bool, default=False
    device : str, default="auto"
    random_state : int, default=0
    verbose : int, default=0
    **overrides
        ``logit_scales``, ``sizes`` (list of (T, d, n)), ``n_splits``, ``student`` ...

    Returns
    -------
    ExperimentResult
    """
    import warnings

    t0 = time.perf_counter()
    cfg = _config("frontier", quick, overrides)
    records = []
    for operator in ("linear_qk", "softmax"):
        for T, d, n in cfg["sizes"]:
            for scale in cfg["logit_scales"]:
                X, Y, teacher = make_attention_task(n, kind=operator, seq_len=T, n_features=d, rank=cfg["rank"],
                                                    noise=cfg["noise"], logit_scale=scale,
                                                    random_state=random_state, return_teacher=True)
                known_v = teacher.value_map if (operator == "softmax" and d >= T) else None
                cv = KFold(n_splits=cfg["n_splits"], shuffle=True, random_state=random_state)
                scoring = {"r2": token_r2_scorer, "exact": make_rank_scorer(teacher.rank, kind="exact")}
                for label, est in frontier_estimators(operator, known_v, cfg["student"], device, random_state,
                                                      verbose):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always", IllConditionedInversionWarning)
                        warnings.simplefilter("always", UnidentifiableRankWarning)
                        out = cross_validate(clone(est), X, Y, cv=cv, scoring=scoring, return_estimator=True,
                                             error_score="raise")
                    warned = sorted({type(w.message).__name__ for w in caught
                                     if issubclass(w.category, (IllConditionedInversionWarning,
                                                                UnidentifiableRankWarning))})
                    for fold, fitted in enumerate(out["estimator"]):
                        records.append(dict(
                            experiment="frontier", operator=operator, seq_len=T, n_features=d, n_samples=n,
                            logit_scale=scale, true_rank=teacher.rank, estimator=label,
                            data_only=label != "student", fold=fold, rank_=int(fitted.rank_),
                            effective_rank_=float(fitted.effective_rank_), exact=float(out["test_exact"][fold]),
                            test_r2=float(out["test_r2"][fold]), fit_time=float(out["fit_time"][fold]),
                            n_epochs=getattr(fitted, "n_iter_", None), warnings=warned))
    labels = _estimator_labels(records)
    summary = []
    keys = sorted({(x["operator"], x["seq_len"], x["n_features"], x["n_samples"], x["logit_scale"])
                   for x in records}, key=lambda k: (k[0] != "linear_qk", k[1], k[2], k[4]))
    for op, T, d, n, scale in keys:
        rows = [x for x in records if (x["operator"], x["seq_len"], x["n_features"], x["n_samples"],
                                       x["logit_scale"]) == (op, T, d, n, scale)]
        row = {"operator": op, "T": T, "d": d, "n": n, "logit scale": scale}
        for label in labels:
            sel = [x for x in rows if x["estimator"] == label]
            row[label] = _ranks(sel) if sel else ""
        stud = [x for x in rows if x["estimator"] == "student"]
        if stud:
            row["student eff. rank"] = _mean(stud, "effective_rank_")
            row["student R²"] = _mean(stud, "test_r2")
            data_t = _mean([x for x in rows if x["estimator"] == "RStar"], "fit_time")
            row["train / data-only time"] = _mean(stud, "fit_time") / data_t
        summary.append(row)
    columns = ["operator", "T", "d", "n", "logit scale"] + labels
    if "student" in labels:
        columns += ["student eff. rank", "student R²", "train / data-only time"]
    ratio = [r["train / data-only time"] for r in summary if r.get("train / data-only time")]
    notes = [f"r* = {cfg['rank']}, sigma = {cfg['noise']}; each cell lists rank_ per fold "
             f"({cfg['n_splits']}-fold cross_validate, trained on (n - n/{cfg['n_splits']}) samples). The student is "
             "over-parameterised (rank=None); its effective rank is R_eff (linear QK) or R̃_eff (softmax) above "
             "the noise threshold. Data-only estimators do not know V except 'softmax-exact (V known)'."]
    if ratio:
        notes.append(f"Training / data-only (RStar) fit time on the same folds: median {np.median(ratio):.3g}x "
                     f"(range {min(ratio):.3g}–{max(ratio):.3g}x).")
    return _done("frontier", cfg, records, summary, columns, notes, t0)


def run_experiment(name, **kwargs):
    """Run an experiment by name.

    Parameters
    ----------
    name : {"table1", "table2", "table3", "frontier"}
    **kwargs
        Passed to the experiment function (``quick``, ``device``, ``random_state``, ...).

    Returns
    -------
    ExperimentResult

    Examples
    --------
    >>> from rstar.paper.experiments import run_experiment
    >>> run_experiment("table9")
    Traceback (most recent call last):
    ...
    ValueError: unknown experiment 'table9'; choose from ('table1', 'table2', 'table3', 'frontier').
    """
    funcs = {"table1": table1, "table2": table2, "table3": table3, "frontier": frontier}
    if name not in funcs:
        raise ValueError(f"unknown experiment {name!r}; choose from {EXPERIMENTS}.")
    return funcs[name](**kwargs)


# ---------------------------------------------------------------------- plots
_COLORS = {"B0": "#1f77b4", "B1": "#ff7f0e", "B1c": "#8c564b", "B2": "#2ca02c", "B3": "#d62728"}


def _figure(width, height, ncols, nrows=1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _floor_line(ax, floor, label=True):
    ax.axhline(floor, color="k", ls="--", lw=1.2,
               label=f"noise floor σ²·T·d_v = {floor:.3g}" if label else None)


def _sweep_panel(ax, rows, floor, true_rank, title, color, bound=False):
    ranks = sorted({x["rank_param"] for x in rows if x["rank_param"] is not None})
    risk = [_mean([x for x in rows if x["rank_param"] == r], "test_risk") for r in ranks]
    ax.plot(ranks, risk, "o-", color=color, label="trained student, held-out test risk")
    for r, v in zip(ranks, risk):
        if r < true_rank:
            ax.annotate(f"{v / floor:.3g}× floor", (r, v), textcoords="offset points", xytext=(6, 2), fontsize=8,
                        color=color)
    at = [v / floor for r, v in zip(ranks, risk) if r >= true_rank]
    if at:
        ax.annotate(f"r ≥ r*: {min(at):.3f}–{max(at):.3f}× floor", (true_rank, floor), textcoords="offset points",
                    xytext=(8, 12), fontsize=8, color=color)
    if bound:
        b = [floor + _mean([x for x in rows if x["rank_param"] == r], "excess_bound") for r in ranks]
        ax.plot(ranks, b, "v:", color="0.45", label="floor + Eckart–Young lower bound (Thm 1)")
    over = [x for x in rows if x["rank_param"] is None]
    if over:
        x_over = max(ranks) + 1
        ax.plot([x_over], [_mean(over, "test_risk")], "*", ms=14, color=color, mec="k",
                label="over-parameterised student (r = full)")
        ax.set_xticks(ranks + [x_over], [str(r) for r in ranks] + ["full"])
    _floor_line(ax, floor)
    ax.axvline(true_rank, color="0.6", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("student rank r  (dotted line: r* = %d)" % true_rank)
    ax.set_ylabel("test risk  E‖Y − Ŷ‖²_F per sample  (labels: × floor)")
    ax.set_title(title)
    ax.legend(fontsize=8)


def _spectrum_panel(ax, rec, title, measure):
    s = np.asarray(rec["kernel_singular_values"])
    idx = np.arange(1, s.size + 1)
    keep = s > rec["noise_threshold"]
    floor_val = max(s[s > 0].min() if np.any(s > 0) else 1e-12, rec["noise_threshold"] * 1e-3)
    ax.semilogy(idx[keep], s[keep], "o", color="C3", label="above noise: counted")
    ax.semilogy(idx[~keep], np.maximum(s[~keep], floor_val), "o", mfc="none", color="0.5",
                label="below noise: discarded")
    ax.axhline(rec["noise_threshold"], color="k", ls="--", lw=1.2, label="finite-sample noise threshold τ")
    ax.set_xlabel("index i")
    ax.set_ylabel("singular value σ_i of the learned operator")
    ax.set_title(f"{title}\nrank_ = {rec['rank_']}, MP-corrected {measure} = {rec['effective_rank_']:.3f}")
    ax.legend(fontsize=8)


def plot_table1(result):
    """Figure of Table 1: rank sweep, recovery spectrum, data-only spectrum.

    Parameters
    ----------
    result : ExperimentResult
        From :func:`table1`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    recs = result.records
    floor = recs[0]["noise_floor"]
    r_star = recs[0]["true_rank"]
    fig, axes = _figure(15, 4.6, 3)
    rows = [x for x in recs if x["part"] in ("rank_sweep", "recovery")]
    _sweep_panel(axes[0, 0], rows, floor, r_star,
                 "Insufficiency and attainment: B0 student A = PQᵀ\n(linear proxy, T=16, d=12, r*=3)",
                 _COLORS["B0"], bound=True)
    rec = [x for x in recs if x["part"] == "recovery" and x["seed"] == 0][0]
    _spectrum_panel(axes[0, 1], rec, "Recovery: learned A of the over-parameterised student", "R_eff")
    data = [x for x in recs if x["part"] == "data_only" and x["estimator"] == "RStarEstimator" and x["seed"] == 0][0]
    ax = axes[0, 2]
    lam = np.asarray(data["spectrum"])
    keep = lam > data["threshold"]
    idx = np.arange(1, lam.size + 1)
    ax.semilogy(idx[keep], lam[keep], "s", color="C2", label="above the MP edge: counted")
    ax.semilogy(idx[~keep], lam[~keep], "s", mfc="none", color="0.5", label="MP bulk")
    ax.axhline(data["threshold"], color="k", ls="--", lw=1.2, label="MP edge + Tracy–Widom margin")
    ax.set_xlabel("index i")
    ax.set_ylabel("eigenvalue of the whitened statistic")
    ax.set_title(f"Data only, no training (RStarEstimator)\nr̂ = {data['rank_']}")
    ax.legend(fontsize=8)
    return fig


def plot_table2(result):
    """Figure of Table 2: risk of each class at r = r*, and its learned static kernel's spectrum.

    Parameters
    ----------
    result : ExperimentResult
        From :func:`table2`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    recs = [x for x in result.records if x["estimator"] == "AttentionStudent"]
    floor = recs[0]["noise_floor"]
    fig, axes = _figure(13, 4.8, 2)
    ax = axes[0, 0]
    kinds = ["linear_proxy", "linear_qk", "linear_qk_full", "softmax", "block"]
    ratios, r2 = [], []
    for kind in kinds:
        att = [x for x in recs if x["kind"] == kind and x["part"] == "attainment"]
        ratios.append(_mean(att, "risk_ratio"))
        r2.append(_mean(att, "test_r2"))
    labels = [f"{_CLASS[k]}\n{k}" for k in kinds]
    bars = ax.bar(labels, ratios, color=[_COLORS[_CLASS[k]] for k in kinds])
    for b, v, q in zip(bars, ratios, r2):
        ax.text(b.get_x() + b.get_width() / 2, v * 1.08, f"{v:.3g}×\nR²={q:.3f}", ha="center", fontsize=8)
    ax.axhline(1.0, color="k", ls="--", lw=1.2, label=f"noise floor (= 1, i.e. {floor:.3g})")
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(ratios) * 4)
    ax.set_ylabel("test risk / noise floor")
    ax.set_title("Static transfer: every class trained on the same task Y = A* X V* + E\n"
                 "(r = r* = 3; B1c: unconstrained full kernel)")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[0, 1]
    for kind in kinds:
        rows = [x for x in recs if x["kind"] == kind and x["part"] == "recovery"] or \
            [x for x in recs if x["kind"] == kind and x["part"] == "attainment"]
        x = rows[0]
        s = np.asarray(x["kernel_singular_values"])
        measure = _measure(kind)
        ax.semilogy(np.arange(1, s.size + 1), np.maximum(s / s[0], 1e-8), "o-", ms=4, color=_COLORS[_CLASS[kind]],
                    label=f"{_CLASS[kind]}: rank_ = {x['rank_']}, {measure} = {x['effective_rank_']:.2f}")
    ax.axvline(3, color="0.6", ls=":", lw=1)
    ax.set_xlabel("index i  (dotted line: r* = 3)")
    ax.set_ylabel("σ_i / σ_1 of the learned operator (A or W_Q W_Kᵀ)")
    ax.set_title("Learned static kernels, over-parameterised students\n(rank_ counts σ_i above the noise level)")
    ax.legend(fontsize=8)
    return fig


def plot_table3(result):
    """Figure of Table 3: rank sweeps and recovered kernels for the attention-native teachers.

    Parameters
    ----------
    result : ExperimentResult
        From :func:`table3`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    fig, axes = _figure(12, 9, 2, 2)
    for j, teacher in enumerate(("linear_qk", "softmax")):
        rows = [x for x in result.records if x["task"] == teacher and x["estimator"] == "AttentionStudent"]
        floor, r_star = rows[0]["noise_floor"], rows[0]["true_rank"]
        cls = _CLASS[teacher]
        _sweep_panel(axes[0, j], rows, floor, r_star,
                     f"{teacher} teacher, rank K* = {r_star}: {cls} students", _COLORS[cls])
        rec = [x for x in rows if x["rank_param"] is None and x["seed"] == 0][0]
        measure = _measure(teacher)
        _spectrum_panel(axes[1, j], rec, f"Recovery: learned W_Q W_Kᵀ of the over-parameterised {cls}", measure)
    return fig


def plot_frontier(result):
    """Figure of the predictability frontier: r̂ vs logit scale, one panel per operator and size.

    Parameters
    ----------
    result : ExperimentResult
        From :func:`frontier`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    recs = result.records
    sizes = sorted({(x["seq_len"], x["n_features"], x["n_samples"]) for x in recs})
    ops = ["linear_qk", "softmax"]
    labels = _estimator_labels(recs)
    markers = dict(zip(labels, "osD^vP*X"))
    fig, axes = _figure(4.6 * len(sizes) + 3, 7.5, len(sizes), 2)
    r_star = recs[0]["true_rank"]
    for i, op in enumerate(ops):
        for j, (T, d, n) in enumerate(sizes):
            ax = axes[i, j]
            for k, label in enumerate(labels):
                sel = [x for x in recs if x["operator"] == op and (x["seq_len"], x["n_features"], x["n_samples"])
                       == (T, d, n) and x["estimator"] == label]
                if not sel:
                    continue
                scales = sorted({x["logit_scale"] for x in sel})
                mean = [np.mean([x["rank_"] for x in sel if x["logit_scale"] == s]) for s in scales]
                jitter = 1.04 ** (k - (len(labels) - 1) / 2)  # horizontal offset so equal values stay visible
                ax.plot(np.asarray(scales) * jitter, mean, marker=markers[label], ls="-",
                        color="k" if label == "student" else f"C{k}", lw=2.2 if label == "student" else 1,
                        label=("trained student (rank_)" if label == "student" else f"data-only: {label}"))
            ax.axhline(r_star, color="0.5", ls="--", lw=1, label=f"true r* = {r_star}")
            ax.set_xscale("log")
            all_scales = sorted({x["logit_scale"] for x in recs})
            ax.set_xticks(all_scales, [f"{v:g}" for v in all_scales])
            ax.minorticks_off()
            ax.set_xlabel("logit scale (std of X K* Xᵀ/√d); markers offset sideways")
            ax.set_ylabel("estimated rank (mean over folds)")
            ax.set_title(f"{op} teacher, T={T}, d={d}, n={n}")
            ax.set_ylim(0, max(d, 4) + 0.5)
    handles, names = [], []
    for ax in axes.ravel():
        for h, nm in zip(*ax.get_legend_handles_labels()):
            if nm not in names:
                handles.append(h)
                names.append(nm)
    fig.legend(handles, names, loc="outside right center", fontsize=8)
    fig.suptitle("Predictability frontier:\ndata-only r̂ vs the trained student's recovered rank")
    return fig


_PLOTS = {"table1": plot_table1, "table2": plot_table2, "table3": plot_table3, "frontier": plot_frontier}
