"""
A data-only estimate beside a trained student
=============================================

rstar's estimators read r* without training; an attention student trained by gradient descent gives the
reference it is validated against. Here an over-parameterised linear-proxy student (``rank=None``, small
initialisation) is trained on the same data, and the Marchenko–Pastur-corrected rank of its learned operator is
compared with the data-only ``rank_``: the student counts singular values above its finite-sample noise
threshold (``noise_threshold_``). (Needs the ``torch`` extra.)
"""

import time

import matplotlib.pyplot as plt
import numpy as np

from rstar import RStarEstimator
from rstar.datasets import make_linear_proxy
from rstar.students import AttentionStudent

X, Y, teacher = make_linear_proxy(1000, random_state=0, return_teacher=True)

t0 = time.perf_counter()
data_only = RStarEstimator(operator="linear_proxy").fit(X, Y)
t_data = time.perf_counter() - t0

t0 = time.perf_counter()
student = AttentionStudent(kind="linear_proxy", rank=None, max_epochs=400, lr=0.05, device="cpu",
                           random_state=0).fit(X, Y)
t_student = time.perf_counter() - t0
print(f"r* = {teacher.rank}: data-only rank_ = {data_only.rank_} in {t_data:.2f} s; "
      f"student rank_ = {student.rank_} (R_eff {student.effective_rank_:.2f}) in {t_student:.1f} s")

# %%
# The learned operator's singular values against the teacher's, and the data-only spectrum.
s_student = np.linalg.svd(student.kernel_, compute_uv=False)
s_teacher = np.linalg.svd(teacher.operator, compute_uv=False)
fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
index = np.arange(1, s_student.size + 1)
axes[0].semilogy(index[: teacher.rank], s_teacher[: teacher.rank], "s", label=f"teacher A* (rank {teacher.rank})")
axes[0].semilogy(index, s_student, "o", mfc="none", label="trained student")
axes[0].axhline(student.noise_threshold_, color="C3", ls="--", label="student's noise threshold")
axes[0].set_xlabel("index")
axes[0].set_title("operator singular values")
axes[0].legend(fontsize=8)
axes[1].semilogy(index, data_only.spectrum_ / data_only.noise_variance_, "o")
axes[1].set_xlabel("index")
axes[1].axhline(data_only.threshold_ / data_only.noise_variance_, color="C3", ls="--", label="threshold_")
axes[1].set_title("data-only spectrum / noise")
axes[1].legend(fontsize=8)
fig.tight_layout()
