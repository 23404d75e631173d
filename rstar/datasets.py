"""Task generators with a known intrinsic rank r* (theory §2).

In the style of :func:`sklearn.datasets.make_regression`: each returns
``(X, Y)`` and, with ``return_teacher=True``, a :class:`~sklearn.utils.Bunch`
describing the teacher (true r*, its operator, value map and noise floor).
"""

import numpy as np
from sklearn.utils import Bunch, check_random_state

from .inversions._numerics.rotary import RotaryPositions
from .inversions._numerics.softmax_factored import causal_mask, factored_outputs
from .inversions._numerics.softmax_ls import attention_weights
from ._validation import check_int, check_positive, check_rank_param

__all__ = ["make_linear_proxy", "make_attention_task", "sample_tokens", "softmax_attention"]

_TOKEN_DISTRIBUTIONS = ("gaussian", "student_t", "correlated")


def sample_tokens(n_samples, seq_len, n_features, *, distribution="gaussian", df=3.0,
                  feature_correlation=0.5, random_state=None):
    """Draw token matrices X of shape (n_samples, seq_len, n_features).

    Parameters
    ----------
    n_samples, seq_len, n_features : int
    distribution : {"gaussian", "student_t", "correlated"}, default="gaussian"
        ``"gaussian"``: i.i.d. N(0, 1) entries. ``"student_t"``: i.i.d.
        Student-t entries with ``df`` degrees of freedom, rescaled to unit
        variance (heavy tails). ``"correlated"``: token rows N(0, Sigma) with
        ``Sigma_ab = feature_correlation ** |a - b|``.
    df : float, default=3.0
        Degrees of freedom for ``"student_t"`` (> 2).
    feature_correlation : float in (-1, 1), default=0.5
    random_state : int, RandomState instance or None

    Returns
    -------
    X : ndarray of shape (n_samples, seq_len, n_features)

    Examples
    --------
    >>> from rstar.datasets import sample_tokens
    >>> sample_tokens(4, 3, 2, random_state=0).shape
    (4, 3, 2)
    """
    rng = check_random_state(random_state)
    shape = (n_samples, seq_len, n_features)
    if distribution == "gaussian":
        return rng.standard_normal(shape)
    if distribution == "student_t":
        df = check_positive(df, "df", allow_none=False)
        if df <= 2:
            raise ValueError(f"df must be > 2 so that tokens have finite variance, got {df!r}.")
        return rng.standard_t(df, size=shape) / np.sqrt(df / (df - 2))
    if distribution == "correlated":
        rho = float(feature_correlation)
        if not -1 < rho < 1:
            raise ValueError(f"feature_correlation must be in (-1, 1), got {feature_correlation!r}.")
        idx = np.arange(n_features)
        cov = rho ** np.abs(idx[:, None] - idx[None, :])
        chol = np.linalg.cholesky(cov)
        return rng.standard_normal(shape) @ chol.T
    raise ValueError(f"token_distribution must be one of {list(_TOKEN_DISTRIBUTIONS)}, got {distribution!r}.")


def _random_orthonormal(rng, n, k):
    """n x k matrix with orthonormal columns, Haar-distributed."""
    if k == 0:
        return np.zeros((n, 0))
    Q, R = np.linalg.qr(rng.standard_normal((n, k)))
    return Q * np.sign(np.diag(R))


def _spectrum(rank, singular_values, decay, total_scale):
    """Singular values of the teacher's low-rank operator."""
    if singular_values is not None:
        s = np.asarray(singular_values, dtype=np.float64).ravel()
        if s.size != rank:
            raise ValueError(f"singular_values must have length rank={rank}, got {s.size}.")
        if np.any(~np.isfinite(s)) or np.any(s <= 0):
            raise ValueError("singular_values must be finite and positive.")
        return np.sort(s)[::-1]
    decay = check_positive(decay, "decay", allow_none=False, upper=1.0 + 1e-12)
    s = decay ** np.arange(rank)
    if rank:
        s = s * total_scale / np.sqrt(np.sum(s**2))
    return s


def _low_rank(rng, n_out, n_in, s):
    U = _random_orthonormal(rng, n_out, s.size)
    W = _random_orthonormal(rng, n_in, s.size)
    return (U * s) @ W.T


def _common_checks(n_samples, seq_len, n_features, value_dim, rank, noise, max_rank, what):
    n_samples = check_int(n_samples, "n_samples", 1)
    seq_len = check_int(seq_len, "seq_len", 1)
    n_features = check_int(n_features, "n_features", 1)
    value_dim = n_features if value_dim is None else check_int(value_dim, "value_dim", 1)
    rank = check_rank_param(rank, allow_none=False)
    if rank > max_rank:
        raise ValueError(f"rank must be <= {max_rank} ({what}), got {rank}.")
    noise = check_positive(noise, "noise", allow_none=False, strict=False)
    return n_samples, seq_len, n_features, value_dim, rank, noise


def _draw_teacher(rng, n_op, s, n_samples, T, d, d_v, **tokens):
    """The teacher's rank-r operator (``n_op x n_op``, singular values ``s``), V* and the tokens X.

    Drawn from ``rng`` in this order, which fixes the data of every ``random_state``.
    """
    M = _low_rank(rng, n_op, n_op, s)
    V = rng.standard_normal((d, d_v)) / np.sqrt(d)
    X = sample_tokens(n_samples, T, d, random_state=rng, **tokens)
    return M, V, X


def make_linear_proxy(n_samples=1000, *, seq_len=16, n_features=12, value_dim=None, rank=3, noise=0.05,
                      scale=1.0, decay=1.0, singular_values=None, token_distribution="gaussian", df=3.0,
                      feature_correlation=0.5, random_state=None, return_teacher=False):
    """Linear-proxy task ``Y = A* X V* + E`` with ``rank(A*) = r*`` (class B0).

    ``A*`` is ``seq_len x seq_len`` with ``rank`` equal singular values (a sharp
    spectral gap) unless ``decay`` or ``singular_values`` says otherwise; ``V*``
    has i.i.d. N(0, 1/n_features) entries so ``X V*`` has unit-variance entries.

    Parameters
    ----------
    n_samples : int, default=1000
    seq_len : int, default=16
        T, tokens per sample.
    n_features : int, default=12
        d, features per token.
    value_dim : int or None, default=None
        d_v, output features; ``None`` means ``n_features``.
    rank : int, default=3
        r* = rank(A*), 0 <= rank <= seq_len. ``rank=0`` gives pure noise.
    noise : float, default=0.05
        sigma, standard deviation of the i.i.d. Gaussian noise E.
    scale : float, default=1.0
        Each of the ``rank`` singular values of ``A*`` equals ``scale`` when
        ``decay=1`` (the Frobenius norm is ``scale * sqrt(rank)``).
    decay : float in (0, 1], default=1.0
        Geometric decay of the singular values (Frobenius norm kept).
    singular_values : array-like of shape (rank,) or None
        Explicit singular values of ``A*`` (overrides ``scale`` and ``decay``).
    token_distribution : {"gaussian", "student_t", "correlated"}, default="gaussian"
        See :func:`sample_tokens`.
    df : float, default=3.0
    feature_correlation : float, default=0.5
    random_state : int, RandomState instance or None
    return_teacher : bool, default=False

    Returns
    -------
    X : ndarray of shape (n_samples, seq_len, n_features)
    Y : ndarray of shape (n_samples, seq_len, value_dim)
    teacher : Bunch, only if ``return_teacher``
        ``rank`` (r*), ``operator`` (A*, T x T), ``value_map`` (V*, d x d_v),
        ``noise`` (sigma), ``noise_floor`` (sigma**2 T d_v, the Bayes risk per
        sample), ``kind`` ("linear_proxy").

    Examples
    --------
    >>> from rstar.datasets import make_linear_proxy
    >>> X, Y, teacher = make_linear_proxy(200, random_state=0, return_teacher=True)
    >>> X.shape, Y.shape, teacher.rank, round(teacher.noise_floor, 2)
    ((200, 16, 12), (200, 16, 12), 3, 0.48)
    """
    n_samples, T, d, d_v, rank, noise = _common_checks(
        n_samples, seq_len, n_features, value_dim, rank, noise, seq_len, "A* is T x T")
    scale = check_positive(scale, "scale", allow_none=False)
    rng = check_random_state(random_state)
    s = _spectrum(rank, singular_values, decay, scale * np.sqrt(rank))
    A, V, X = _draw_teacher(rng, T, s, n_samples, T, d, d_v, distribution=token_distribution, df=df,
                            feature_correlation=feature_correlation)
    Y = np.einsum("st,ntd,dv->nsv", A, X, V, optimize=True) + noise * rng.standard_normal((n_samples, T, d_v))
    if not return_teacher:
        return X, Y
    return X, Y, Bunch(kind="linear_proxy", rank=rank, operator=A, value_map=V, singular_values=s,
                       noise=noise, noise_floor=noise**2 * T * d_v)


def softmax_attention(X, kernel, value_map):
    """``softmax(X K X^T / sqrt(d)) X V`` for every sample (row-wise softmax).

    Parameters
    ----------
    X : ndarray of shape (n_samples, T, d)
    kernel : ndarray of shape (d, d)
    value_map : ndarray of shape (d, d_v)

    Returns
    -------
    ndarray of shape (n_samples, T, d_v)

    Examples
    --------
    >>> import numpy as np
    >>> from rstar.datasets import softmax_attention
    >>> X = np.ones((1, 2, 3))
    >>> softmax_attention(X, np.zeros((3, 3)), np.eye(3)).shape
    (1, 2, 3)
    """
    return attention_weights(X, kernel) @ (X @ value_map)


def make_attention_task(n_samples=2000, *, kind="softmax", seq_len=32, n_features=16, value_dim=None, rank=3,
                        noise=0.05, logit_scale=2.0, decay=1.0, singular_values=None, normalizer=None,
                        token_distribution="gaussian", df=3.0, feature_correlation=0.5, causal=False, rotary=None,
                        random_state=None, return_teacher=False):
    """Attention-native task whose query–key kernel has rank r* (classes B1, B2).

    - ``kind="linear_qk"``: ``Y = (X K* X^T) X V* / c + E`` with
      ``c = normalizer`` (default ``sqrt(T d)``, so the
      signal has entries of order ``logit_scale``).
    - ``kind="softmax"``: ``Y = softmax(X K* X^T / sqrt(d)) X V* + E``; with ``causal=True`` each token attends
      to itself and the tokens before it (a decoder head); with ``rotary`` positions the head is a rotary one of
      width r*, ``logit_ts = rot_t(x_t W_Q) . rot_s(x_s W_K) / sqrt(d)`` with ``W_Q W_K^T = K*`` (the query and
      key factors of rank r* spread over the ``2 P`` rotated coordinates by a random orthonormal map;
      :mod:`rstar.inversions.softmax_rotary`).

    ``K* = W_Q W_K^T`` is ``d x d`` of rank ``rank``, scaled so that the
    logits ``X K* X^T / sqrt(d)`` have standard deviation ``logit_scale`` for
    Gaussian tokens (``||K*||_F = logit_scale * sqrt(d)``).

    Parameters
    ----------
    n_samples : int, default=2000
    kind : {"softmax", "linear_qk"}, default="softmax"
    seq_len : int, default=32
    n_features : int, default=16
    value_dim : int or None, default=None
        d_v (may differ from d); ``None`` means ``n_features``.
    rank : int, default=3
        r* = rank(K*), 0 <= rank <= n_features.
    noise : float, default=0.05
    logit_scale : float, default=2.0
    decay : float in (0, 1], default=1.0
        Geometric decay of the singular values of K* (Frobenius norm kept).
    singular_values : array-like of shape (rank,) or None
        Explicit singular values of K* (overrides ``logit_scale`` and ``decay``).
    normalizer : float or None, default=None
        c for ``linear_qk``; ignored for softmax.
    token_distribution : {"gaussian", "student_t", "correlated"}, default="gaussian"
    df : float, default=3.0
    feature_correlation : float, default=0.5
    causal : bool, default=False
        Softmax only: the causal mask.
    rotary : rstar.RotaryPositions or None, default=None
        Softmax only: rotary positions of length ``seq_len`` (``rank <= rotary.width``).
    random_state : int, RandomState instance or None
    return_teacher : bool, default=False

    Returns
    -------
    X : ndarray of shape (n_samples, seq_len, n_features)
    Y : ndarray of shape (n_samples, seq_len, value_dim)
    teacher : Bunch, only if ``return_teacher``
        ``rank``, ``kernel`` (K*), ``value_map`` (V*), ``noise``,
        ``noise_floor`` (sigma**2 T d_v), ``kind``, ``logit_scale``,
        ``normalizer`` (c, linear_qk only), ``causal``, and with ``rotary`` the
        query and key factors ``query_factors``, ``key_factors`` (d, 2 P).

    Examples
    --------
    >>> from rstar.datasets import make_attention_task
    >>> X, Y, t = make_attention_task(100, seq_len=8, n_features=4, rank=2,
    ...                               random_state=0, return_teacher=True)
    >>> Y.shape, t.rank, t.kernel.shape
    ((100, 8, 4), 2, (4, 4))
    """
    if kind not in ("softmax", "linear_qk"):
        raise ValueError(f"kind must be 'softmax' or 'linear_qk', got {kind!r}.")
    n_samples, T, d, d_v, rank, noise = _common_checks(
        n_samples, seq_len, n_features, value_dim, rank, noise, n_features, "K* is d x d")
    logit_scale = check_positive(logit_scale, "logit_scale", allow_none=False)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}.")
    if rotary is not None:
        if kind != "softmax":
            raise ValueError("rotary positions are a softmax head's: kind must be 'softmax' with rotary.")
        if not isinstance(rotary, RotaryPositions):
            raise TypeError(f"rotary must be a RotaryPositions, got {type(rotary).__name__}.")
        if rotary.length != T:
            raise ValueError(f"rotary has {rotary.length} positions, but seq_len={T}.")
        if rank > rotary.width:
            raise ValueError(f"rank must be <= rotary.width={rotary.width} (the rotated coordinates), got {rank}.")
    if causal and kind != "softmax":
        raise ValueError("causal is a softmax head's mask: kind must be 'softmax' with causal=True.")
    rng = check_random_state(random_state)
    s = _spectrum(rank, singular_values, decay, logit_scale * np.sqrt(d))
    K, V, X = _draw_teacher(rng, d, s, n_samples, T, d, d_v, distribution=token_distribution, df=df,
                            feature_correlation=feature_correlation)
    teacher = Bunch(kind=kind, rank=rank, kernel=K, value_map=V, singular_values=s, noise=noise,
                    noise_floor=noise**2 * T * d_v, logit_scale=logit_scale, causal=bool(causal))
    if kind == "softmax" and (causal or rotary is not None):
        if rotary is None:
            A, B = K, np.eye(d)
        else:
            U, sv, Wt = np.linalg.svd(K)
            spread = np.linalg.qr(rng.standard_normal((rotary.width, max(rank, 1))))[0][:, :rank].T
            A = (U[:, :rank] * np.sqrt(sv[:rank])) @ spread
            B = (Wt[:rank].T * np.sqrt(sv[:rank])) @ spread
            teacher.query_factors, teacher.key_factors = A, B
        clean = factored_outputs(X, X @ V, A, B, causal_mask(T) if causal else None, rotary=rotary)
    elif kind == "softmax":
        clean = softmax_attention(X, K, V)
    else:
        c = np.sqrt(T * d) if normalizer is None else check_positive(normalizer, "normalizer", allow_none=False)
        teacher.normalizer = c
        clean = np.einsum("nta,ab,nsb,nsc,cv->ntv", X, K, X, X, V, optimize=True) / c
    Y = clean + noise * rng.standard_normal((n_samples, T, d_v))
    if not return_teacher:
        return X, Y
    return X, Y, teacher
