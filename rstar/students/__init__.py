"""Trained attention students B0–B3 (theory §6), fitted with PyTorch.

``import rstar.students`` does not import torch: the torch modules are loaded
the first time a student is fitted (or unpickled). Without torch, fitting
raises an ImportError that says ``pip install "rstar[torch]"``.

The numpy helpers that measure a learned operator (its noise threshold and
MP-corrected rank) need no torch.

Examples
--------
>>> from rstar.students import AttentionStudent
>>> AttentionStudent(kind="softmax", rank=3).get_params()["kind"]
'softmax'
"""

from ._rank import kronecker_entry_variance, mp_corrected_rank, operator_entry_variance, operator_noise_threshold
from ._student import KINDS, AttentionStudent

__all__ = ["AttentionStudent", "KINDS", "kronecker_entry_variance", "mp_corrected_rank", "operator_entry_variance",
           "operator_noise_threshold"]
