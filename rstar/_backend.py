"""Array back-ends of the heavy numerics: numpy on the CPU (the default) or torch on a device.

The chunk functions of the least-squares softmax fit (:mod:`rstar.inversions._numerics.softmax_ls`)
are written once against the few operations collected here, so the numpy and
torch paths compute the same thing. ``device="cpu"`` (the estimators' default)
is numpy; ``"auto"``, ``"cuda"``, ``"cuda:N"`` or any ``torch.device`` (a
``torch.device("cpu")`` included, which is how the torch path is tested on a
machine without a GPU) is torch, float64, imported only then
(:mod:`rstar._torch_backend`). Results come back as numpy float64; the
accumulated sums are small (``d x d``, ``d^2 x d^2``), so only they cross
between host and device.
"""

import contextlib

import numpy as np

__all__ = ["NumpyOps", "resolve_backend", "check_device"]


class NumpyOps:
    """The operations of the chunk functions, on numpy float64 arrays."""

    name = "numpy"
    device = "cpu"

    @staticmethod
    def asarray(a):
        return np.asarray(a, dtype=float)

    @staticmethod
    def to_numpy(a):
        return a

    @staticmethod
    def transposed(A):
        """``A_i^T`` for every sample, contiguous: numpy's stacked matmul is several times slower on a
        transposed view."""
        return np.ascontiguousarray(np.swapaxes(A, 1, 2))

    @staticmethod
    def softmax_rows(S):
        """Row-wise softmax of the last axis, in place (one array instead of scipy's temporaries)."""
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        return S

    @staticmethod
    def einsum(spec, *operands, optimize=True):
        return np.einsum(spec, *operands, optimize=optimize)

    @staticmethod
    def index(idx):
        return idx

    @staticmethod
    def zeros(shape):
        return np.zeros(shape)

    @staticmethod
    def scalar(a):
        return float(a)

    @staticmethod
    def sharing_the_cpu():
        """Nothing to share: numpy alone (see :meth:`rstar._torch_backend.TorchOps.sharing_the_cpu`)."""
        return contextlib.nullcontext()


NUMPY = NumpyOps()


def check_device(device):
    """Validate an estimator's ``device`` parameter without importing torch for ``"cpu"``.

    Returns the back-end's name: ``"numpy"`` for ``"cpu"``, ``"torch"`` otherwise.

    Raises
    ------
    ValueError
        A string torch cannot parse, or CUDA asked for where none is present.
    """
    if isinstance(device, str) and device == "cpu":
        return "numpy"
    resolve_backend(device)
    return "torch"


def resolve_backend(device):
    """The operations for ``device``: :data:`NUMPY` for ``"cpu"``, else the torch back-end on that device.

    Parameters
    ----------
    device : str or torch.device
        ``"cpu"`` (numpy), ``"auto"`` (CUDA when present, else torch on the CPU), ``"cuda"``, ``"cuda:N"`` or a
        ``torch.device``.

    Returns
    -------
    ops : NumpyOps or rstar._torch_backend.TorchOps
    """
    if isinstance(device, str) and device == "cpu":
        return NUMPY
    try:
        from ._torch_backend import TorchOps
    except ImportError as exc:   # pragma: no cover - torch is an optional extra
        raise ImportError(f"device={device!r} needs torch (pip install 'rstar[torch]'); device='cpu' runs on "
                          "numpy without it.") from exc
    return TorchOps(device)
