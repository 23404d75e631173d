"""Input validation shared by every public entry point (API glue, no numerics)."""

import numbers

import numpy as np
from sklearn.utils.validation import check_random_state  # noqa: F401  (re-export)

_OPERATORS = ("linear_proxy", "linear_qk", "softmax")


def _as_real_array(a, name, dtype=np.float64):
    """Array-like -> finite float array; clear errors for bad dtypes."""
    if a is None:
        raise ValueError(f"{name} is required, got None.")
    if hasattr(a, "toarray") or type(a).__module__.startswith("scipy.sparse"):
        raise TypeError(f"{name}: sparse input is not supported; pass a dense array of shape (n_samples, T, d).")
    try:
        arr = np.asarray(a)
    except Exception as exc:  # ragged nested lists
        raise ValueError(f"{name} could not be converted to an array: {exc}") from exc
    kind = arr.dtype.kind
    if kind == "c":
        raise ValueError(f"Complex data not supported: {name} must be real-valued (got dtype {arr.dtype}).")
    if kind in "OUSV" or kind not in "biuf":
        if kind == "O":
            try:
                arr = arr.astype(np.float64)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"{name} must be a numeric array; got an object array that is not numeric ({exc})."
                ) from exc
        else:
            raise TypeError(f"{name} must be a numeric array, got dtype {arr.dtype}.")
    if kind == "b":
        arr = arr.astype(np.float64)
    arr = arr.astype(dtype, copy=False) if arr.dtype != dtype else arr
    return arr


def check_tokens(X, name="X", *, allow_2d=True):
    """Validate a token array; a 2-D ``(n, d)`` array is read as ``(n, 1, d)``.

    Returns a C-contiguous float64 array of shape ``(n, T, d)``.
    """
    X = _as_real_array(X, name)
    shape = X.shape
    feat = "d" if name == "X" else "d_v"
    if X.ndim == 2 and allow_2d:
        X = X[:, None, :]
    if X.ndim != 3:
        hint = " Reshape your data: a single sample needs a leading axis of length 1." if X.ndim < 2 else ""
        raise ValueError(
            f"{name} must have shape (n_samples, T, {feat}) (or (n_samples, {feat}), read as T=1); got an "
            f"array with {X.ndim} dimension(s) and shape {shape}.{hint}"
        )
    n, T, d = X.shape
    if n == 0:
        raise ValueError(f"{name} has 0 sample(s) (shape={shape}) while a minimum of 1 is required.")
    if T == 0:
        raise ValueError(f"{name} has 0 tokens per sample (shape={shape}) while a minimum of 1 is required.")
    if d == 0:
        raise ValueError(f"{name} has 0 feature(s) (shape={shape}) while a minimum of 1 is required.")
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{name} contains NaN or infinity.")
    return np.ascontiguousarray(X)


def check_X_Y_and_y_ndim(X, Y):
    """``(X, Y, y_ndim)``: X and Y as 3-D float arrays (a 2-D X read as T = 1, a 1-D Y with a 2-D X as one output)
    and the number of dimensions of the Y given (what ``predict`` returns; 3 for 3-D)."""
    if Y is not None and not hasattr(Y, "ndim"):
        Y = np.asarray(Y)
    if X is not None and not hasattr(X, "ndim"):
        X = np.asarray(X)
    y_ndim = None if Y is None else np.asarray(Y).ndim
    if y_ndim == 1 and np.asarray(X).ndim == 2:
        Y = np.asarray(Y)[:, None]
    X, Y = check_X_Y(X, Y)
    return X, Y, 3 if y_ndim == 3 else y_ndim


def check_X_Y(X, Y):
    """Validate a pair ``(X, Y)``: shapes ``(n, T, d)`` and ``(n, T, d_v)``."""
    try:
        x_2d = np.ndim(X) == 2   # a 2-D X is read as T = 1 below
    except Exception:   # ragged nested lists: check_tokens says so
        x_2d = False
    X = check_tokens(X, "X")
    x_ndim = 3 if X.shape[1] != 1 else None  # a 2-D X was read as T = 1
    if Y is None:
        raise ValueError("this estimator requires y to be passed, but the target y is None: fit it on pairs (X, Y).")
    Y = _as_real_array(Y, "Y")
    if Y.ndim == 1:
        raise ValueError(
            f"Y must have shape (n_samples, T, d_v) or (n_samples, d_v); got a 1-D array of shape {Y.shape}. "
            "Reshape a single output with Y.reshape(-1, 1)."
        )
    if x_ndim == 3 and Y.ndim == 2 and Y.shape[0] == X.shape[0]:
        raise ValueError(
            f"Y must have shape (n_samples, T, d_v) = ({X.shape[0]}, {X.shape[1]}, d_v) to match X of shape "
            f"{X.shape}; got a 2-D array of shape {Y.shape} (2-D Y goes with 2-D X only)."
        )
    Y = check_tokens(Y, "Y")
    if X.shape[0] != Y.shape[0]:
        raise ValueError(
            f"X and Y have different numbers of samples: X has {X.shape[0]}, Y has {Y.shape[0]}."
        )
    if X.shape[1] != Y.shape[1]:
        if x_2d:
            raise ValueError(
                f"X is 2-D, shape {(X.shape[0], X.shape[2])} (read as T = 1 token per sample), but Y has "
                f"T = {Y.shape[1]} tokens, shape {Y.shape}: expected X of shape (n_samples, T, d) and Y of shape "
                "(n_samples, T, d_v), or both 2-D for T = 1."
            )
        raise ValueError(
            f"X and Y have different numbers of tokens T: X has shape {X.shape}, Y has shape {Y.shape}; "
            "expected X of shape (n_samples, T, d) and Y of shape (n_samples, T, d_v)."
        )
    return X, Y


def check_operator(operator, allowed=_OPERATORS):
    if not isinstance(operator, str) or operator not in allowed:
        raise ValueError(f"operator must be one of {list(allowed)}, got {operator!r}.")
    return operator


def check_int(value, name, minimum, allow_none=False):
    """An integer ``>= minimum`` (``None`` too when ``allow_none``); bools are refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        extra = "None or " if allow_none else ""
        raise ValueError(f"{name} must be {extra}an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_rank_param(rank, name="rank", allow_none=True):
    if rank is None and allow_none:
        return None
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
        raise ValueError(f"{name} must be None or a non-negative integer, got {rank!r}.")
    return int(rank)


def check_positive(value, name, allow_none=True, strict=True, upper=None):
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and np.isfinite(value)
    ok = ok and (value > 0 if strict else value >= 0)
    if ok and upper is not None:
        ok = value < upper
    if not ok:
        rng = f"({0 if strict else '[0'}, {upper if upper is not None else 'inf'})"
        raise ValueError(f"{name} must be a finite number in {rng}, got {value!r}.")
    return float(value)


def check_value_map(value_map, d, d_v):
    """A known value matrix V of shape (d, d_v), or None."""
    if value_map is None:
        return None
    V = _as_real_array(value_map, "value_map")
    if V.ndim != 2 or V.shape != (d, d_v):
        raise ValueError(
            f"value_map must have shape (d, d_v) = ({d}, {d_v}) to match X and Y, got shape {V.shape}."
        )
    if not np.all(np.isfinite(V)):
        raise ValueError("value_map contains NaN or infinity.")
    return V
