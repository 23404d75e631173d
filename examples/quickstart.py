"""Estimate r* from data alone on the three task classes, and sweep the rank.

    python examples/quickstart.py
"""

import numpy as np
from sklearn.model_selection import GridSearchCV, KFold

from rstar import MPRankEstimator, NumericalRankEstimator, RStarEstimator
from rstar.datasets import make_attention_task, make_linear_proxy
from rstar.metrics import token_r2_scorer


def main():
    # The paper's Table 1 task: T=16 tokens, d=12 features, r*=3, sigma=0.05.
    X, Y, teacher = make_linear_proxy(1000, random_state=0, return_teacher=True)
    for est in (NumericalRankEstimator(), MPRankEstimator(), RStarEstimator(operator="linear_proxy")):
        est.fit(X, Y)
        print(f"linear proxy   r*={teacher.rank}  {type(est).__name__:24s} rank_={est.rank_}  "
              f"R_eff={est.effective_rank_:.2f}  noise_variance_={est.noise_variance_:.5f}")

    # Attention-native teachers: linear QK with an unknown value map, and softmax.
    for kind, kw in (("linear_qk", dict(seq_len=64, n_features=32, rank=4)),
                     ("softmax", dict(seq_len=32, n_features=16, rank=3, logit_scale=2.0))):
        X, Y, teacher = make_attention_task(2000, kind=kind, random_state=0, return_teacher=True, **kw)
        est = RStarEstimator().fit(X, Y)
        top = np.round(est.spectrum_[: teacher.rank + 2] / est.noise_variance_, 1)
        print(f"{kind:14s} r*={teacher.rank}  RStarEstimator()          rank_={est.rank_}  "
              f"spectrum/noise={top}")

    # A data-only rank sweep: cross-validated token-wise R^2 against the forced rank.
    X, Y = make_linear_proxy(1000, random_state=1)
    search = GridSearchCV(RStarEstimator(operator="linear_proxy"), {"rank": range(1, 7)},
                          scoring=token_r2_scorer, cv=KFold(3, shuffle=True, random_state=0)).fit(X, Y)
    for r, s in zip(search.cv_results_["param_rank"], search.cv_results_["mean_test_score"]):
        print(f"rank {r}: CV token R^2 = {s:.4f}")


if __name__ == "__main__":
    main()
