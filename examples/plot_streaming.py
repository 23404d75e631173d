"""
Streaming: partial_fit over batches equals fit
==============================================

Every inversion accumulates sums over samples, so an estimator can be fitted batch by batch with ``partial_fit``
(data that do not fit in memory) and ends with the same fitted attributes as ``fit`` on all the data. The
sequence of estimates shows r* settling as samples arrive: weak directions are detected once there are enough
samples to lift them above the noise, and ``rank_interval_`` is wide while one sits near the detection edge.
"""

import matplotlib.pyplot as plt
import numpy as np

from rstar import RStarEstimator
from rstar.datasets import make_attention_task

# one strong direction and two weak ones: the weak ones become detectable as samples accumulate
X, Y, teacher = make_attention_task(3000, kind="linear_qk", seq_len=24, n_features=8, rank=3, noise=0.5,
                                    singular_values=[1.0, 0.04, 0.025], random_state=0, return_teacher=True)
stream = RStarEstimator(operator="linear_qk")
seen, ranks, intervals = [], [], []
for start in range(0, len(X), 250):
    stream.partial_fit(X[start:start + 250], Y[start:start + 250])
    seen.append(stream.n_samples_seen_)
    ranks.append(stream.rank_)
    intervals.append(stream.rank_interval_)
full = RStarEstimator(operator="linear_qk").fit(X, Y)
print(f"r* = {teacher.rank}; streamed rank_ = {stream.rank_}, fit on all = {full.rank_}; spectra equal: "
      f"{np.allclose(stream.spectrum_, full.spectrum_, rtol=1e-8)}; inversion_ = {stream.inversion_!r}")

# %%
lo, hi = np.array(intervals).T
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.fill_between(seen, lo, hi, color="C0", alpha=0.2, step="mid", label="rank_interval_")
ax.step(seen, ranks, where="mid", label="rank_")
ax.axhline(teacher.rank, color="0.5", ls=":", label="r*")
ax.set_xlabel("samples seen")
ax.set_ylabel("estimated rank")
ax.set_yticks(range(0, teacher.rank + 2))
ax.legend()
fig.tight_layout()
