"""The torch back-end of the heavy numerics (imported only when an estimator's ``device`` is not ``"cpu"``)."""

import contextlib

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from .factored import FactoredHalfLoss
from .log_attention import LogAttentionHalfLoss

__all__ = ["TorchOps", "resolve_torch_device"]


def resolve_torch_device(device):
    """``torch.device`` for ``"auto"`` (CUDA when present, else the CPU), a device string or a ``torch.device``.

    Raises
    ------
    ValueError
        A string torch cannot parse, or CUDA asked for where none is present.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'auto', 'cuda' or a torch device, got {device!r}.") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available; use device='auto' or 'cpu'.")
    return dev


#: The dtype of the factored softmax fit's per-sample work on torch (its sums are float64). One loss evaluation on
#: 250 random windows (T = 32, d = 385, q = 32) took 14 ms in float32 and 23 ms in float64 on torch's CPU threads,
#: 62 ms on numpy; float32 fits read the same ranks as numpy's float64 on planted real tokens (MiniLM d = 384,
#: SmolLM2 d = 576) and on two MiniLM heads (python benchmarks/speed.py --real-size), and
#: tests/inversions/test_softmax_factored.py checks the agreement. The rotary log-attention loss runs in it too:
#: over one SmolLM2 head a layer (python benchmarks/rotary_real_heads.py --heads diagonal) r*(1%) was numpy's on 26
#: of 30 heads and within 2 on the others; tests/inversions/test_log_attention.py checks planted widths.
FACTORED_FIT_DTYPE = torch.float32


class TorchOps:
    """The operations of the chunk functions (:mod:`rstar._backend`) on float64 torch tensors on one device."""

    name = "torch"
    fit_dtype = FACTORED_FIT_DTYPE

    def __init__(self, device):
        self.device = resolve_torch_device(device)

    def sharing_the_cpu(self):
        """A context in which numpy's BLAS runs on one thread while torch works on the CPU's threads: OpenBLAS's
        threads wait spinning after each call, and with torch's beside them every torch call ran several times
        slower (a MiniLM head's factored fit: 57 s, 28 s with one BLAS thread, on 2 cores). On CUDA, nothing."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        return threadpool_limits(limits=1, user_api="blas")

    def factored_half_loss(self, X, Y, mask, chunk_entries, rotary=None):
        """One half's factored loss on this device, in :attr:`fit_dtype`
        (:class:`rstar._torch_backend.factored.FactoredHalfLoss`; rotary heads with ``rotary``)."""
        return FactoredHalfLoss(X, Y, mask, self.device, self.fit_dtype, chunk_entries, rotary=rotary)

    def log_attention_half_loss(self, X, targets, chunk_entries, rotary=None):
        """One half's log-attention loss on this device, in :attr:`fit_dtype`
        (:class:`rstar._torch_backend.log_attention.LogAttentionHalfLoss`)."""
        return LogAttentionHalfLoss(X, targets, self.device, self.fit_dtype, chunk_entries, rotary=rotary)

    def asarray(self, a):
        return torch.as_tensor(np.asarray(a, dtype=float), dtype=torch.float64, device=self.device)

    @staticmethod
    def to_numpy(a):
        return a.detach().cpu().numpy()

    @staticmethod
    def transposed(A):
        return A.transpose(1, 2).contiguous()

    @staticmethod
    def softmax_rows(S):
        return torch.softmax(S, dim=-1)

    @staticmethod
    def einsum(spec, *operands, optimize=None):
        return torch.einsum(spec, *operands)

    def index(self, idx):
        return torch.as_tensor(idx, dtype=torch.long, device=self.device)

    def zeros(self, shape):
        return torch.zeros(shape, dtype=torch.float64, device=self.device)

    @staticmethod
    def scalar(a):
        return float(a)
