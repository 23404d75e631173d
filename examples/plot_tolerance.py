"""
r*(ε): the tolerance rank and the risk curve
============================================

The noise-floor r* counts every direction of the kernel that the data can tell from noise. A user sizing a model
may accept a little more risk for a smaller rank: ``tolerance=ε`` asks for r*(ε), the smallest rank r whose
rank-r model's risk is within ``ε Var(Y)`` of the full-rank model's (theory §2, paper eq. 4). The fit reads it off
a data-only curve, ``risk_curve_``: for each rank r, the relative excess risk

``risk_curve_[r] = (RSS(r) - RSS(full)) / TSS``

of the inversion's rank-r model, with TSS the sum of squares of Y about its column means (:mod:`rstar.risk`).
No model is trained.

Here the planted kernel has rank 6 with geometrically decaying singular values (``decay=0.6``), so its weak
directions carry little of the output: the noise floor resolves all six, and a tolerance of 5% needs fewer. At
d = 96 the full-rank least squares' ``d² x d²`` information exceeds half the default memory budget, so
``RStarEstimator`` runs the factored least squares (``K = A Bᵀ`` on each half of the samples), whose curve is
cross-fitted (each half's rank-r model measured on the other half) and measured per sample: it comes with a
standard error, ``risk_curve_se_``.
"""

import warnings

import matplotlib.pyplot as plt
import numpy as np

from rstar import RStarEstimator
from rstar.datasets import make_attention_task

X, Y, teacher = make_attention_task(600, seq_len=8, n_features=96, value_dim=8, rank=6, decay=0.6, noise=0.05,
                                    random_state=0, return_teacher=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    est = RStarEstimator(tolerance=0.05).fit(X, Y)      # V unknown: fitted with the factors
print(f"planted rank {teacher.rank}; inversion_ = {est.inversion_!r}")
print(f"noise-floor rank {est.noise_floor_rank_}, interval {est.noise_floor_interval_}")
print(f"r*(0.05) = rank_ = {est.rank_}, rank_interval_ = {est.rank_interval_} (r(2 eps), r(eps / 2))")
print(f"warnings: {[w.category.__name__ for w in caught] or 'none'}")

# %%
# The curve, its standard error and its upper bound
# -------------------------------------------------
# ``rank_`` is read off ``risk_curve_upper_``, the curve plus the normal quantile at ``1 - tolerance_level``
# (default 0.05) times its standard error, so that a rank read is sufficient with about 95% confidence rather
# than by the luck of the samples; for this fit the bound also covers ``predict``'s own rank-r model
# (``risk_curve_distance_``, see the :doc:`user guide <../user_guide/real_models>`). The curve is computed up to
# the noise-floor interval's upper end at least, and on until the bound reaches half the tolerance (the
# interval's upper end). The standard errors are small here (at most about 5% of each point), so the bars barely show
# at this scale.
np.set_printoptions(precision=4, suppress=True)
print("risk_curve_       ", est.risk_curve_)
print("risk_curve_se_    ", est.risk_curve_se_)
print("risk_curve_upper_ ", est.risk_curve_upper_)

ranks = np.arange(len(est.risk_curve_))
fig, ax = plt.subplots(figsize=(6.5, 4))
ax.errorbar(ranks, est.risk_curve_, yerr=est.risk_curve_se_, fmt="o-", capsize=3,
            label="risk_curve_ ± risk_curve_se_")
ax.plot(ranks, est.risk_curve_upper_, "v--", color="C1", ms=4, label="risk_curve_upper_ (read at ε)")
ax.axhline(est.tolerance, color="C3", ls=":", label=f"tolerance ε = {est.tolerance:g}")
ax.axvline(est.rank_, color="C3", ls="--", label=f"rank_ = r*(ε) = {est.rank_}")
ax.axvline(est.noise_floor_rank_, color="0.4", ls="-.", label=f"noise-floor rank = {est.noise_floor_rank_}")
ax.set_yscale("symlog", linthresh=1e-3)   # logarithmic above 1e-3, linear down to the curve's 0 at full rank
ax.set_ylim(0, 1)
ax.set_xlabel("rank r")
ax.set_ylabel("relative excess risk (units of Var(Y))")
ax.set_xticks(ranks)
ax.legend(fontsize=8)
fig.tight_layout()

# %%
# Other tolerances without a refit
# --------------------------------
# ``rank_at_tolerance(eps)`` reads the same bound at another ε. It answers for any ε the computed curve reaches;
# a finer one than the curve reaches raises (fit again with that tolerance). Each ε trades rank for risk: a
# looser tolerance drops the weak directions first.
for eps in (0.3, 0.1, 0.05, 0.01):
    print(f"r*({eps:g}) = {est.rank_at_tolerance(eps)}")

# %%
# Below the factored fit's sizes (here d = 16), ``RStarEstimator`` runs the full-rank least squares, whose curve
# is measured in sample on all the samples at once: it has no standard error (``risk_curve_se_`` is None) and
# ``rank_`` is read off the curve itself.
X16, Y16 = make_attention_task(2000, seq_len=16, n_features=16, rank=6, decay=0.6, random_state=0)
small = RStarEstimator(tolerance=0.05).fit(X16, Y16)
print(f"d = 16: inversion_ = {small.inversion_!r}, risk_curve_se_ = {small.risk_curve_se_}, "
      f"r*(0.05) = {small.rank_}, noise-floor rank {small.noise_floor_rank_}")
print("risk_curve_", small.risk_curve_)
