"""Rank plans put back into MiniLM: the model's fidelity under each allocation users run today and under rstar's.

For the heads fitted once by ``rstar heads`` (its ``heads.json``, with tolerances; the whole model or some
layers), each allocation's ranks are put into the model (:func:`rstar.heads.truncated_heads`, value maps
untouched) and the model's sentence embeddings (mean-pooled last hidden states, normalised, as
all-MiniLM-L6-v2 is used) on other windows of text (``--seed``) are compared with the full model's: the mean and
the smallest cosine similarity.

Allocations at each total query–key width W (the sum of the heads' ranks), all truncated the same way (by SVD in
the metric of the layer's tokens, what rstar's curves measure), so that only the allocation differs:

- ``rstar budget``: W split to minimise the summed predicted excess (:func:`rstar.heads.rank_plan`), the heads'
  own kernels truncated; and ``(fit's models)``: the data-only fits' own rank-r models put in their place (where
  the run saved them: ``rstar heads --save-factors``) — rstar alone, from the data, without the weights;
- ``rstar tolerance``: each head's r*(ε) (at its own width only);
- ``uniform``: W split evenly (one ratio for every head, as SVD-LLM and the fine-tuning libraries by default);
- ``weight energy``: the most of the kernels' own SVD energy (the weights alone);
- ``Eigen Attention``: its per-layer threshold search on key/query activation spectra (``eigen_attention_plan``,
  the smallest layer-output error budget whose plan fits in W);
- ``Palu``: ranks in proportion to each head's Fisher score (``head_fisher_scores``: for this embedding model a
  Gaussian likelihood on the last hidden state);
- ``EVA``: the layers' input components ranked by explained variance (``eva_plan``, rho = 2).

And each anchor with its own truncation: ``Eigen Attention (own)`` (queries and keys on their activations' top
directions) and ``SVD-LLM (own)`` (uniform ranks, each of W_Q and W_K truncated on its own, whitened by the
tokens); Eigen Attention also at its own error budgets (its own widths). The anchors' calibration is the first
``--n-calib`` windows the fits read.

With ``--students``, each tolerance plan is also put back with trained students in the fits' place: for each head
a rank-r*(ε) softmax student (:class:`rstar.students.AttentionStudent`, ``kind="softmax"``, torch, on a GPU when
one is present) trained on the head's own (X, Y) — the windows the fits read — whose query–key map goes into the
model (``rstar tolerance ε (students)``). The students are trained with the head's value map W_V held fixed
(``AttentionStudent(value_map=...)``), the task the V-known fits read, since the model keeps its W_V: a student
that learns its own value map learns a query–key map paired with it, which beside W_V can be far off (at
ε = 5% one such layer-0 student, training R² 0.93, left 122% of its head's variance with W_V). Each student is
one step of the journal, its factors saved under ``OUT/students/``: the mission's check of a data-only rank
against trained students, at the scale of a real model.

For each tolerance plan: each head's predicted excess at r*(ε) (its risk curve: the upper bound the plan reads,
and the point estimate with its standard error) against the realised excess of its truncated kernel (and of the
fit's own rank-r model, and of the student) on the held-out windows, the head alone (its layer truncated, the
layers before it intact) and inside the whole truncated model (the layers before it truncated too), with the
realised excess's standard error over windows. The fit's own model is also predicted by the curve with its floor
moved in sample (``risk_curve_point + risk_curve_floor - risk_curve_floor_in_sample``, where the table's rows
carry both floors): the curve subtracts the full half models held out, whose estimation error the fit's model
does not share. With the fits' own models saved and both floors in the rows, each tolerance also gets the plan
chosen by that prediction (``rank_plan(model="fitted")``: each head at the smallest width where its fit's own model
is predicted within ε), put back with those models (``rstar tolerance ε (fit's models at their widths)``), every
allocation also run at its total width, and its per-head realised excess (``fit's model at its width``, against
that plan's own prediction, ``predicted_excess_fitted_model``). The same counts are given again over the heads whose
r*(ε) the table's row does not warn (the warnings of the rstar version that wrote the table).

Usage::

    rstar heads --model minilm --seq-len 32 --n-samples 500 --save-factors --out runs/minilm   # about 15 min
    python benchmarks/compress.py --table runs/minilm/heads.json                   # about 10 min on 2 cores
    python benchmarks/compress.py --table runs/minilm/heads.json --students        # + a student per head and ε
    python benchmarks/compress.py --table runs/minilm/heads.json --resume --target 0.01,0.003   # + the width per target

Writes ``compress.json``, ``compress.md`` and ``compress_pareto.png``, ``compress_predicted.png`` under ``--out``;
each step as it finishes to ``compress.partial.jsonl`` there, with the steps done and the time left printed, so an
interrupted run continues with ``--resume`` (same options).
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from _runs import (PREDICTED_HEADER, UNWARNED_HEADER, Journal, plan_ranks, predicted_against_realised,
                   predicted_rows, realised_excess, record_search, records, search_line, student_step, timed_records,
                   unwarned_rows)


def _embed(model, windows, batch=50):
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(windows), batch):
            h = model(torch.as_tensor(windows[s:s + batch])).last_hidden_state.mean(dim=1)
            out.append(torch.nn.functional.normalize(h, dim=1).double().numpy())
    return np.concatenate(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", required=True,
                   help="heads.json of `rstar heads` with tolerances (its rows, and the windows it fitted on)")
    p.add_argument("--n-eval", type=int, default=500, help="windows the embeddings are compared on")
    p.add_argument("--seed", type=int, default=1, help="seed of those windows (not the fits' --seed)")
    p.add_argument("--n-calib", type=int, default=128,
                   help="the anchors' calibration windows (the first of the fits' windows)")
    p.add_argument("--fractions", default="0.25,0.5,0.75",
                   help="total widths as fractions of the full width, beside the tolerance plans' widths")
    p.add_argument("--target", default="", metavar="LOSS",
                   help="comma-separated values of 1 - mean cosine: for each, the smallest width whose budget split "
                        "keeps the embeddings within it, plus two standard errors (rstar.heads.smallest_budget_plan, "
                        "the model measured at each width tried)")
    p.add_argument("--error-budgets", default="0.02,0.05,0.1,0.2,0.4",
                   help="Eigen Attention's layer-output error budgets, at its own widths")
    p.add_argument("--students", action="store_true",
                   help="also put back rank-r*(eps) softmax students trained on each head's (X, Y) (rstar.students)")
    p.add_argument("--student-epochs", type=int, default=3000, help="the students' max_epochs")
    p.add_argument("--student-validation", type=float, default=None, metavar="FRACTION",
                   help="stop each student on this share of its windows held out (validation_fraction)")
    p.add_argument("--out", default="benchmarks/out/compress")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out (its compress.partial.jsonl) instead of starting over")
    args = p.parse_args(argv)

    from rstar.heads import (collect_attention, eigen_attention_plan, eigen_attention_sweep, eva_plan,
                             fisher_share_plan, head_fisher_scores, load_minilm, rank_plan, smallest_budget_plan,
                             text_windows, truncated_heads, uniform_plan, weight_energy_plan)

    t0 = time.perf_counter()
    run = json.loads(Path(args.table).read_text())
    rows, T = run["rows"], run["seq_len"]
    if run["seed"] == args.seed:
        raise SystemExit(f"--seed {args.seed} is the fits' own: give another for the windows compared on.")
    if any(r.get("risk_curve") is None for r in rows):
        bad = next(r for r in rows if r.get("risk_curve") is None)
        raise SystemExit(f"layer {bad['layer']} head {bad['head']} has no risk curve ({bad.get('note')}): "
                         "the plans need every head's.")
    keys = [(int(r["layer"]), int(r["head"])) for r in rows]
    full_width = sum(int(r["d_head"]) for r in rows)

    # the fits' own models (``rstar heads --save-factors``), where the run saved them
    folder = Path(args.table).parent / "factors"
    fitted = {}
    for k in keys:
        path = folder / f"layer{k[0]}_head{k[1]}.npz"
        if path.exists():
            with np.load(path) as f:
                fitted[k] = (f["A"], f["B"])
    fitted = fitted if len(fitted) == len(keys) else None

    tolerances = sorted(float(k[len("rank_at_"):]) for k in rows[0] if k.startswith("rank_at_"))
    tol_plans = {tol: records(rank_plan(rows, tolerance=tol)) for tol in tolerances}
    # the widths at which the fits' own models are predicted within each tolerance (the curve plus the floors'
    # gap: rank_plan(model="fitted")), where the run saved them and its rows carry both floors
    own_plans = {}
    if fitted:
        try:
            own_plans = {tol: records(rank_plan(rows, tolerance=tol, model="fitted")) for tol in tolerances}
        except ValueError as exc:   # a table without both floors (an older rstar's)
            print(f"no plans for the fits' own models: {exc}", flush=True)
    widths = sorted({sum(p["rank"] for p in plan) for plan in (*tol_plans.values(), *own_plans.values())}
                    | {int(round(float(f) * full_width)) for f in args.fractions.split(",") if f})
    budgets = [float(v) for v in args.error_budgets.split(",") if v]
    # the steps, counted before any runs (for the time left): the two calibrations, then per width the tolerance
    # plans at their widths, the budget split and the anchors, then Eigen Attention's own budgets and the per-head
    # comparisons
    models = 2 if fitted else 1
    n_steps = (2 + sum(models * sum(sum(p["rank"] for p in plan) == W for plan in tol_plans.values())
                       + sum(sum(p["rank"] for p in plan) == W for plan in own_plans.values())
                       + models + 7 for W in widths) + len(budgets) + models * len(tol_plans) + len(own_plans))
    # per tolerance plan: one student per head of rank > 0, the plan put back with them, their realised excess
    n_students = sum(sum(int(p["rank"]) > 0 for p in plan) for plan in tol_plans.values()) if args.students else 0
    n_steps += n_students + (2 * len(tol_plans) if args.students else 0)
    record = dict(table=str(Path(args.table).resolve()), n_eval=args.n_eval, seed=args.seed, n_calib=args.n_calib,
                  fractions=args.fractions, error_budgets=args.error_budgets, fitted=bool(fitted))
    if args.students:   # (a run without students keeps its record, so that it resumes as before)
        record.update(students=True, student_epochs=args.student_epochs, student_value_map="known",
                      **({} if args.student_validation is None else dict(student_validation=args.student_validation)))
    targets = [float(t) for t in args.target.split(",") if t]
    # each --target's bisection: about log2 of the full width over one dimension a head, widths shared between the
    # targets measured once (an estimate for the time left; the count checked at the end leaves them out)
    # the per-head comparisons (a forward pass per head cut: 40-60 s each on MiniLM where a plan's measurement takes
    # seconds) timed at their own pace
    n_realised = models * len(tol_plans) + len(own_plans) + (len(tol_plans) if args.students else 0)
    journal = Journal(Path(args.out) / "compress.partial.jsonl", record, args.resume,
                      n_steps + len(targets) * (int(np.ceil(np.log2((full_width + 1) / len(rows)))) + 1),
                      kinds=dict(student=n_students, realised=n_realised))

    model, tok = load_minilm()
    model.eval()
    held = text_windows(tok, T, args.n_eval, random_state=args.seed)
    # the layers' tokens for the truncations: the windows the fits read (their seed and count)
    fit_windows = text_windows(tok, T, run["n_samples"], random_state=run["seed"])
    index = sorted({k[0] for k in keys})
    layers = [layer.select_heads(sorted(h for li, h in keys if li == layer.index))
              for layer in collect_attention(model, fit_windows, layers=index)]
    calib = fit_windows[:args.n_calib]
    print(f"{len(rows)} heads in {len(layers)} layers, full width {full_width}, {n_steps} steps; calibrating the "
          f"anchors on {len(calib)} windows ...", flush=True)

    fisher = journal.step("fisher",
                          lambda: timed_records(lambda: head_fisher_scores(model, layers, calib, random_state=0)))
    sweep = journal.step("sweep", lambda: timed_records(lambda: eigen_attention_sweep(model, layers, calib)))
    t_fisher, t_sweep = fisher["seconds"], sweep["seconds"]
    fisher_loss = fisher["rows"][0]["fisher_loss"]
    fisher, sweep = fisher["rows"], sweep["rows"]
    print(f"Palu's Fisher scores {t_fisher:.0f} s (loss: {fisher_loss}), Eigen Attention's sweep {t_sweep:.0f} s",
          flush=True)
    print("the fits' own models: " + ("in " + str(folder) if fitted else "not saved (rstar heads --save-factors)"),
          flush=True)
    state = {}

    def evaluate(name, ranks, metric, width_asked, extra=None, factors=None):
        def compute():
            if "full" not in state:
                state["full"] = _embed(model, held)
            plan = [dict(layer=k[0], head=k[1], rank=int(r)) for k, r in zip(keys, ranks)]
            with truncated_heads(model, plan, layers, metric=metric, factors=factors):
                emb = _embed(model, held)
            cos = np.sum(emb * state["full"], axis=1)
            return dict(allocation=name, truncation=metric, width_asked=width_asked, width=int(sum(ranks)),
                        ranks=[int(r) for r in ranks], mean_cosine=float(cos.mean()), min_cosine=float(cos.min()),
                        loss=float(1 - cos.mean()), **(extra or {}))

        res = journal.step(f"evaluate|{name}|{metric}|{width_asked}", compute)
        results.append(res)
        asked = "-" if width_asked is None else width_asked
        print(f"W {asked:>5}: {name:24s} {metric:11s} width {res['width']:5d}  1 - cosine {res['loss']:.3e} "
              f"(min cosine {res['min_cosine']:.4f})", flush=True)
        return res

    results = []
    for W in widths:
        for tol, plan in tol_plans.items():
            if sum(p["rank"] for p in plan) == W:
                total = dict(predicted_total=float(sum(p["predicted_excess"] for p in plan)))
                evaluate(f"rstar tolerance {tol:g}", plan_ranks(plan, keys), "tokens", W, total)
                if fitted:
                    evaluate(f"rstar tolerance {tol:g} (fit's models)", plan_ranks(plan, keys), "tokens", W, total,
                             fitted)
        for tol, plan in own_plans.items():
            if sum(p["rank"] for p in plan) == W:
                total = dict(predicted_total=float(sum(p["predicted_excess_fitted_model"] for p in plan)))
                evaluate(f"rstar tolerance {tol:g} (fit's models at their widths)", plan_ranks(plan, keys),
                         "tokens", W, total, fitted)
        budget_plan = records(rank_plan(rows, budget=W))
        total = dict(predicted_total=float(sum(p["predicted_excess"] for p in budget_plan)))
        evaluate("rstar budget", plan_ranks(budget_plan, keys), "tokens", W, total)
        if fitted:
            evaluate("rstar budget (fit's models)", plan_ranks(budget_plan, keys), "tokens", W, total, fitted)
        ea = eigen_attention_plan(sweep, layers, budget=W)
        plans = {"uniform": uniform_plan(layers, W), "weight energy": weight_energy_plan(layers, W),
                 "Eigen Attention": ea, "Palu": fisher_share_plan(fisher, W), "EVA": eva_plan(layers, W)}
        for name, plan in plans.items():
            evaluate(name, plan_ranks(plan, keys), "tokens", W,
                     dict(fisher_loss=fisher_loss) if name == "Palu" else None)
        evaluate("Eigen Attention (own)", plan_ranks(ea, keys), "activations", W)
        evaluate("SVD-LLM (own)", plan_ranks(plans["uniform"], keys), "whitened", W)
    for e in budgets:
        plan = eigen_attention_plan(sweep, layers, error_budget=e)
        evaluate(f"Eigen Attention (own) at error {e:g}", plan_ranks(plan, keys), "activations", None,
                 dict(error_budget=e))

    # students in the fits' place: one trained per head at the plan's rank, its factors saved as it finishes
    students, student_runs = {}, []
    if args.students:
        heads_by_key = {(layer.index, t.head): t for layer in layers for t in layer.heads()}
        folder_s = Path(args.out) / "students"
        folder_s.mkdir(parents=True, exist_ok=True)
        for tol, plan in tol_plans.items():
            factors = {}
            for p in plan:
                key, rank = (int(p["layer"]), int(p["head"])), int(p["rank"])
                head = heads_by_key[key]
                if rank == 0:   # nothing to train: the head attends uniformly
                    factors[key] = (np.zeros((head.features().shape[-1], 0)),) * 2
                    continue
                info, factors[key] = student_step(journal, folder_s, tol, key, rank, heads_by_key.__getitem__,
                                                  args.student_epochs, args.student_validation)
                student_runs.append(info)
            students[tol] = factors
            W = sum(int(p["rank"]) for p in plan)
            total = dict(predicted_total=float(sum(p["predicted_excess"] for p in plan)))
            evaluate(f"rstar tolerance {tol:g} (students)", plan_ranks(plan, keys), "tokens", W, total, factors)

    # the smallest width whose budget split keeps 1 - mean cosine within each --target, the model measured at each
    # width the bisection tries (with the standard error of the mean over the windows)
    searches = []
    for target in targets:
        def measure(plan):
            ranks = plan_ranks(plan, keys)

            def compute():
                if "full" not in state:
                    state["full"] = _embed(model, held)
                with truncated_heads(model, [dict(layer=k[0], head=k[1], rank=int(r)) for k, r in zip(keys, ranks)],
                                     layers):
                    loss = 1 - np.sum(_embed(model, held) * state["full"], axis=1)
                return dict(width=int(sum(ranks)), loss=float(loss.mean()),
                            loss_se=float(loss.std(ddof=1) / np.sqrt(loss.size)))

            res = journal.step(f"search|{int(sum(ranks))}", compute)
            print(f"W {res['width']:5d}: rstar budget (search)   1 - cosine {res['loss']:.3e} ± {res['loss_se']:.1e}",
                  flush=True)
            return res["loss"], res["loss_se"]

        found = smallest_budget_plan(rows, measure, target=target)
        # the width was chosen on the held-out windows: its plan measured again on others (the next seed)
        def again():
            if "fresh" not in state:
                state["fresh"] = text_windows(tok, T, args.n_eval, random_state=args.seed + 1)
                state["fresh_full"] = _embed(model, state["fresh"])
            cut = [dict(layer=k[0], head=k[1], rank=int(r)) for k, r in zip(keys, plan_ranks(found["plan"], keys))]
            with truncated_heads(model, cut, layers):
                loss = 1 - np.sum(_embed(model, state["fresh"]) * state["fresh_full"], axis=1)
            return dict(excess=float(loss.mean()), se=float(loss.std(ddof=1) / np.sqrt(loss.size)))

        record_search(journal, searches, found, full_width, again, "1 - cosine")

    # predicted against realised, per head, for each tolerance plan
    heads_cmp = []
    for tol, plan in tol_plans.items():
        for what, factors in (("head's kernel", None), ("fit's model", fitted), ("student", students.get(tol))):
            if what != "head's kernel" and not factors:
                continue
            real = journal.step(f"realised|{tol:g}|{what}", lambda: {
                f"{k[0]},{k[1]}": v for k, v in realised_excess(model, plan, layers, held, collect_attention,
                                                               truncated_heads, factors,
                                                               floor=what == "fit's model").items()})
            heads_cmp += predicted_against_realised(plan, rows, real, tol, what)
    for tol, plan in own_plans.items():
        what = "fit's model at its width"
        real = journal.step(f"realised|{tol:g}|{what}", lambda: {
            f"{k[0]},{k[1]}": v for k, v in realised_excess(model, plan, layers, held, collect_attention,
                                                           truncated_heads, fitted, floor=False).items()})
        heads_cmp += predicted_against_realised(plan, rows, real, tol, what, "predicted_excess_fitted_model")
    elapsed = time.perf_counter() - t0
    # the width searches' steps (any --target's, this run's or an earlier one's) are not counted ahead
    counted = [key for key in journal.done if not key.startswith(("search|", "confirm|"))]
    if len(counted) != n_steps:
        raise RuntimeError(f"the run took {len(counted)} steps where {n_steps} were counted")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compress.json").write_text(json.dumps(dict(results=results, heads=heads_cmp, table=str(args.table),
                                                       n_eval=args.n_eval, seed=args.seed, n_calib=args.n_calib,
                                                       seconds=elapsed, fisher_seconds=t_fisher,
                                                       sweep_seconds=t_sweep, fisher_loss=fisher_loss,
                                                       students=student_runs, searches=searches), indent=1))
    lines = [f"Fidelity of MiniLM's sentence embeddings ({args.n_eval} held-out windows of {T} tokens), "
             f"{len(rows)} heads, full query–key width {full_width}.", "",
             "| W asked | allocation | truncation | width | 1 − mean cosine | min cosine | rstar predicted Σ excess |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        pred = f"{r['predicted_total']:.3f}" if "predicted_total" in r else ""
        lines.append(f"| {r['width_asked'] if r['width_asked'] is not None else '—'} | {r['allocation']} | "
                     f"{r['truncation']} | {r['width']} | {r['loss']:.2e} | {r['min_cosine']:.4f} | {pred} |")
    lines += [search_line(found, full_width, "1 − mean cosine") for found in searches]
    lines += [""] + PREDICTED_HEADER
    lines += predicted_rows(heads_cmp, tol_plans, ("head's kernel", "fit's model", "fit's model at its width",
                                                    "student"))
    lines += ["", "The same over the heads whose r*(ε) the table's row does not warn:", ""] + UNWARNED_HEADER
    lines += unwarned_rows(heads_cmp, tol_plans, ("head's kernel", "fit's model", "fit's model at its width",
                                                  "student"))
    lines.append(f"\n{elapsed:.0f} s in this process (steps read back from the journal cost nothing here; Fisher "
                 f"scores {t_fisher:.0f} s, their loss the {fisher_loss}; Eigen Attention's sweep {t_sweep:.0f} s).")
    if student_runs:
        secs = [r["seconds"] for r in student_runs]
        lines.append(f"{len(student_runs)} students trained ({student_runs[0]['device']}): {sum(secs):.0f} s in all, "
                     f"{min(secs):.0f}–{max(secs):.0f} s each (median {np.median(secs):.0f}); training R^2 median "
                     f"{np.median([r['train_r2'] for r in student_runs]):.4f}.")
    (out / "compress.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _figures(results, heads_cmp, full_width, out)


def _figures(results, heads_cmp, full_width, out):
    try:
        import matplotlib
    except ImportError:   # pragma: no cover - optional
        print("(matplotlib is not installed: no figures)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"rstar budget": ("C3", "o", "-"), "rstar budget (fit's models)": ("C3", "o", ":"),
              "uniform": ("C0", "s", "--"), "weight energy": ("C1", "^", "--"),
              "Eigen Attention": ("C2", "v", "--"), "Palu": ("C4", "D", "--"), "EVA": ("C5", "P", "--"),
              "Eigen Attention (own)": ("C2", "v", ":"), "SVD-LLM (own)": ("C7", "X", ":")}
    for name, (color, marker, line) in styles.items():
        pts = sorted((r["width"], r["loss"]) for r in results if r["allocation"] == name)
        if pts:
            ax.plot(*zip(*pts), color=color, marker=marker, linestyle=line, label=name)
    pts = sorted((r["width"], r["loss"]) for r in results if r["allocation"].startswith("Eigen Attention (own) at"))
    if pts:
        ax.plot(*zip(*pts), color="C2", marker="x", linestyle="none", label="Eigen Attention at its error budgets")
    for r in results:
        if r["allocation"].startswith("rstar tolerance"):
            own, student = r["allocation"].endswith("(fit's models)"), r["allocation"].endswith("(students)")
            at_width = r["allocation"].endswith("(fit's models at their widths)")
            ax.plot(r["width"], r["loss"], "P" if student else "p" if at_width else "*",
                    color="k" if student else "C3", markersize=11 if student or at_width else 14,
                    markerfacecolor="none" if own or at_width else None)
            if at_width:
                ax.annotate(f"fit's models at their r*({float(r['allocation'].split()[2]):.0%}) widths",
                            (r["width"], r["loss"]), textcoords="offset points", xytext=(-4, -14), fontsize=7,
                            ha="right")
            if not own and not at_width:
                what = ", students" if student else ""
                ax.annotate(f"r*({float(r['allocation'].split()[2]):.0%}){what}", (r["width"], r["loss"]),
                            textcoords="offset points", xytext=(6, -12 if student else 6))
    ax.set_yscale("log")
    ax.set_xlabel(f"total query–key width (sum of the heads' ranks; full = {full_width})")
    ax.set_ylabel("1 − mean cosine to the full model's embeddings")
    ax.set_title("MiniLM with every head's query–key map truncated: fidelity against width")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compress_pareto.png", dpi=100)

    tols = sorted({h["tolerance"] for h in heads_cmp})
    fig, axes = plt.subplots(1, len(tols), figsize=(5.5 * len(tols), 4.8), squeeze=False)
    for ax, tol in zip(axes[0], tols):
        top = 4 * tol   # realised excess beyond is drawn at the top edge (triangles)
        for what, color, shift in (("head's kernel", "C0", -0.12), ("fit's model", "C3", 0.12)):
            hs = [h for h in heads_cmp if h["tolerance"] == tol and h["truncated"] == what]
            if not hs:
                continue
            x = np.arange(len(hs)) + shift
            alone = np.array([h["alone"] for h in hs])
            inside = np.array([h["inside"] for h in hs])
            over = alone > top
            ax.errorbar(x[~over], alone[~over], yerr=2 * np.array([h["alone_se"] for h in hs])[~over], fmt="o",
                        ms=3, color=color, label=f"{what}: the head alone (± 2 se)")
            ax.plot(x[over], np.full(over.sum(), top), "^", color=color, ms=5)
            ax.plot(x, np.minimum(inside, top), "x", color=color, alpha=0.5, ms=4,
                    label=f"{what}: inside the truncated model")
            if what == "fit's model" and all(h.get("predicted_own_model") is not None for h in hs):
                ax.plot(x, np.minimum([h["predicted_own_model"] for h in hs], top), "_", color=color, ms=7, mew=1.5,
                        label="fit's model: predicted (the curve, floor in sample)")
        hs = [h for h in heads_cmp if h["tolerance"] == tol and h["truncated"] == "head's kernel"]
        ax.plot(np.arange(len(hs)), [h["predicted"] for h in hs], "_", color="k", ms=9, mew=2,
                label="predicted (risk curve at r*(ε))")
        ax.axhline(tol, color="k", lw=0.8, ls="--")
        for k in range(1, len(hs)):
            if hs[k]["layer"] != hs[k - 1]["layer"]:
                ax.axvline(k - 0.5, color="0.8", lw=0.8)
        ax.set_ylim(0, top * 1.05)
        ax.set_xlabel("head (layers left to right)")
        ax.set_ylabel("excess on held-out windows (share of the head's Var(Y))")
        ax.set_title(f"each head at r*({tol:.0%}); beyond {top:.0%}: triangles at the top")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "compress_predicted.png", dpi=100)


if __name__ == "__main__":
    main()
