"""What users reach for today to size a head, for comparison with r*: the SVD energy rank of the real kernel, an
activation-SVD rank in the style of EVA, and a WeightWatcher-style Marchenko–Pastur spike count of the weights.

Written from the papers' definitions (no code copied):

- Paischer, F. et al. (2024). One initialization to rule them all: fine-tuning via explained variance
  adaptation (EVA), arXiv:2410.07170 — ranks from the singular values of the activations entering a weight
  matrix, allotted by explained variance.
- Martin, C. H. and Mahoney, M. W. (2021). Implicit self-regularization in deep neural networks: evidence from
  random matrix theory and implications for learning. JMLR 22(165) — spikes of a weight matrix's empirical
  spectral density above the Marchenko–Pastur bulk edge fitted to it (the WeightWatcher tool's "num_spikes").
"""

import numpy as np

from ..marchenko_pastur import fit_mp_bulk, mp_edges
from ..spectral import energy_effective_rank_from_singular_values

__all__ = ["kernel_energy_rank", "activation_svd_rank", "weight_mp_spike_count"]


def kernel_energy_rank(head):
    """Energy effective rank (rounded) of the head's real kernel ``W~_Q W~_K^T`` (:mod:`rstar.spectral`)."""
    s = head.kernel_singular_values()
    return int(np.floor(energy_effective_rank_from_singular_values(s) + 0.5)) if s.size and s[0] > 0 else 0


def activation_svd_rank(X, explained=0.9):
    """EVA-style rank: the fewest right-singular directions of the activations (all tokens as rows, uncentred)
    that explain ``explained`` of their energy.

    Parameters
    ----------
    X : ndarray of shape (n, T, d)
    explained : float in (0, 1], default=0.9

    Returns
    -------
    int
    """
    A = np.asarray(X, dtype=float).reshape(-1, X.shape[-1])
    s2 = np.clip(np.linalg.eigvalsh(A.T @ A)[::-1], 0.0, None)
    if not s2.sum() > 0:
        return 0
    return int(np.searchsorted(np.cumsum(s2) / s2.sum(), explained) + 1)


def weight_mp_spike_count(W):
    """WeightWatcher-style spike count of a weight matrix W (N x M, N >= M after transposing): eigenvalues of
    ``W^T W / N`` above the upper edge of the Marchenko–Pastur law fitted to their bulk (:func:`fit_mp_bulk`,
    ratio ``M / N``)."""
    W = np.asarray(W, dtype=float)
    if W.shape[0] < W.shape[1]:
        W = W.T
    N, M = W.shape
    lam = np.sort(np.linalg.eigvalsh(W.T @ W / N))[::-1]
    sigma2, n_columns = fit_mp_bulk(lam, float(N))
    edge = mp_edges(min(M / n_columns, 1.0), sigma2)[1]
    return int(np.sum(lam > edge))
