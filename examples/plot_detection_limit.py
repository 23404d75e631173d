"""
The detection limit around the BBP threshold
============================================

A direction of strength ``theta`` (in units of the noise variance) separates from a Marchenko–Pastur bulk of
ratio ``gamma`` only when ``theta > sqrt(gamma)``, the Baik–Ben Arous–Péché threshold: below it the top eigenvalue
of the second-moment statistic carries no trace of it. Here one spike of strength ``c sqrt(gamma)`` is planted in
the linear proxy at a range of ``c`` and the share of data sets where ``MPRankEstimator`` finds it is counted. At
finite n the test's Tracy–Widom margin (false-alarm level ``alpha``) puts the 50% point above the threshold.
"""

import matplotlib.pyplot as plt
import numpy as np

from rstar import MPRankEstimator
from rstar.datasets import make_linear_proxy

T, d, n, sigma = 16, 12, 400, 0.1
gamma = T / (n * d)          # p / m of the token statistic (p = T, m = n d_v with d_v = d)
levels = [0.5, 0.8, 1.0, 1.3, 1.6, 2.0, 3.0]
found = []
for c in levels:
    hits = 0
    for seed in range(12):
        # V* has unit-variance entries of X V*, so theta = s^2 / sigma^2 for a singular value s of A*
        s = sigma * np.sqrt(c * np.sqrt(gamma))
        X, Y = make_linear_proxy(n, seq_len=T, n_features=d, rank=1, singular_values=[s], noise=sigma,
                                 random_state=seed)
        hits += MPRankEstimator().fit(X, Y).rank_ >= 1
    found.append(hits / 12)
    print(f"c = {c:.1f} x BBP: spike found in {hits} of 12 data sets")

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(levels, found, "o-")
ax.axvline(1.0, color="0.5", ls=":", label="BBP threshold")
ax.set_xlabel("spike strength / BBP threshold")
ax.set_ylabel("detection rate")
ax.set_ylim(-0.05, 1.05)
ax.legend()
fig.tight_layout()
