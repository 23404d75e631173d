"""What a fitted data-only estimator offers beyond its attributes: the statistic it read, the closed-form
operator at its rank, ``predict`` and ``score``, and its risk curve read at another tolerance."""

import warnings

import numpy as np
from sklearn.utils.validation import check_is_fitted

from ._backend import resolve_backend
from ._validation import check_tokens
from .metrics import token_r2_score
from .risk import held_out_reach, rank_read_again, tolerance_interval
from .rules import identifiability

__all__ = ["FittedOperatorMixin"]


class FittedOperatorMixin:
    """``statistic_``, ``operator_``, ``predict``, ``score`` and ``rank_at_tolerance`` of a fitted data-only
    estimator (which provides ``_whiten``, ``_choose`` and the fitted state)."""

    def rank_at_tolerance(self, tolerance, return_interval=False):
        """r*(tolerance) from the fitted curve without refitting (read as the fit reads it: ``risk_curve_upper_``,
        the curve's upper bound at ``tolerance_level``), through the same gates as the fit's own reading.

        Parameters
        ----------
        tolerance : float in [0, 1)
        return_interval : bool, default=False
            Also return the reading's interval, as ``rank_interval_`` is for the fit's tolerance: from the curve's
            rank at twice the tolerance to its upper bound's at half, widened to every rank the data leave open
            where a gate warns.

        Returns
        -------
        rank : int
            The smallest rank whose relative excess risk (its upper bound) is at most ``tolerance``; the number
            of features d where the curve reached the rank beyond which its models no longer change (the
            factored fit's q) without reaching ``tolerance``, as ``fit`` reads it. Never more than ``max_rank``
            where it is given (the class's bound: a reading beyond is warned and read at the bound).
        interval : tuple of int, only if ``return_interval``

        Warns
        -----
        UnidentifiableRankWarning
            Where the fit's gates hold at this tolerance: the curve is measured against a fit that did not identify
            its statistic (and the rank read does not hold the tolerance on its own held-out risk:
            :func:`rstar.risk.held_out_reach`), its halves disagree by more than the tolerance resolves, or the
            tolerance is finer than the noise (the same warnings ``fit`` gives at its own tolerance).

        Raises
        ------
        ValueError
            If the estimator was fitted without a ``tolerance`` (no curve), or the curve was computed only up to
            ranks that do not reach this tolerance (fit again with it).
        """
        check_is_fitted(self, "rank_")
        if "risk_curve_" not in self.__dict__:
            raise ValueError("no risk curve: fit with tolerance=... (any value) to compute risk_curve_.")
        curve, upper = self.risk_curve_, self.__dict__.get("risk_curve_upper_")
        rank = rank_read_again(curve, upper, self.__dict__.get("_risk_curve_full_rank"), tolerance)
        gates_in = self.__dict__.get("_tolerance_gates")
        if gates_in is None:   # pragma: no cover - every fit with a curve records its gates
            return (rank, (rank, rank)) if return_interval else rank
        interval = tolerance_interval(curve, upper, rank, tolerance, int(gates_in["dim"]))
        floor = self.__dict__.get("risk_curve_floor_")
        # with the floor's own margin at the curve's level, as the fit's reading counted it
        reach = None if floor is None else held_out_reach(upper if upper is not None else curve, floor,
                                                          self.__dict__.get("risk_curve_floor_in_sample_"), tolerance,
                                                          self.__dict__.get("_risk_curve_floor_margin", 0.0))
        gates = identifiability.tolerance_verdicts(tolerance=float(tolerance), rank=rank, held_out_reach=reach,
                                                   calibration=self._calibration(), **gates_in)
        for v in gates:
            if v.category is not None:
                warnings.warn(v.warning(), stacklevel=2)
        rank, interval = identifiability.within_class(rank, identifiability.covering(interval, gates),
                                                      gates_in["dim"])
        return (rank, interval) if return_interval else rank

    @property
    def statistic_(self):
        """The :class:`rstar.inversions.WhitenedStatistic` the rule read: the whitened eigen-decomposition
        (``spectrum_`` is its ``eigenvalues`` in Y units), its null model and any extra evidence (internal units:
        the data rescaled to unit RMS)."""
        check_is_fitted(self, "rank_")
        return self._whiten(self._choose())

    @property
    def operator_(self):
        """The closed-form operator used by ``predict`` (built on first access, then cached)."""
        check_is_fitted(self, "rank_")
        cache = self._operator_cache
        if "operator" not in cache:
            kw = {"ops": resolve_backend(self.device)} if self._inv.capabilities.reads_sample_passes else {}
            cache["operator"] = self._inv.fit_operator(self._stats, self.components_, **kw)
        return cache["operator"]

    def query_key_factors(self, rank=None):
        """Factors ``(A, B)`` of the fitted query–key map at rank ``rank``, in the units of the X given to fit.

        The model of ``predict`` at that rank: its logits are ``X_i A B^T X_i^T / sqrt(d)`` (rstar's convention,
        d = ``n_features_in_``; for a rotary fit, ``rotate(X_i A) rotate(X_i B)^T / sqrt(d)``). Its factors, not
        the d x d kernel, so that a rank-r head can be put into a model (:func:`rstar.heads.truncated_heads`).

        Parameters
        ----------
        rank : int or None
            0 ... ``n_features_in_``; None: ``rank_``. A rank beyond the fitted model's width gives that width's
            model (the factored fits model at most their width q).

        Returns
        -------
        A, B : ndarray of shape (n_features_in_, r)
            r the model's rank (``rank``, or less where the fit holds fewer directions). For a rotary fit, one
            column per rotated coordinate (the rotation of ``operator_.rotary`` acts on each plane's pair of
            columns), of rank ``rank``: the width is that of the projections.

        Raises
        ------
        ValueError
            A rank out of range, an operator without a query–key map (the linear proxy acts on tokens), or a fit
            without closed-form operators at its size.
        """
        check_is_fitted(self, "rank_")
        r = self.rank_ if rank is None else rank
        operator = self._operator_at(r)
        if operator is None:
            raise ValueError("no closed-form operator: its moment sums would exceed the memory budget at this size.")
        if hasattr(operator, "A") and hasattr(operator, "B") and hasattr(operator, "rotary"):
            A, B = np.asarray(operator.A, dtype=float), np.asarray(operator.B, dtype=float)
            return A / self._x_scale, B / self._x_scale
        K = getattr(operator, "K", None)
        if K is None:
            raise ValueError(f"{type(self).__name__} fitted a {self.inversion_} operator, which has no query–key "
                             "map (it acts on the tokens directly).")
        U, s, Wt = np.linalg.svd(np.asarray(K, dtype=float) / self._x_scale ** 2)
        k = min(int(r), int(np.sum(s > s[0] * 1e-12)) if s.size and s[0] > 0 else 0)
        return U[:, :k] * np.sqrt(s[:k]), Wt[:k].T * np.sqrt(s[:k])

    def _operator_at(self, rank):
        """The closed-form operator at ``rank`` (None: ``operator_``, cached), after checking the rank."""
        if rank is None:
            return self.operator_
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank <= self.n_features_in_:
            raise ValueError(f"rank must be a whole number in 0 ... {self.n_features_in_}, got {rank!r}.")
        kw = {"ops": resolve_backend(self.device)} if self._inv.capabilities.reads_sample_passes else {}
        return self._inv.fit_operator(self._stats, self.statistic_.components(int(rank)), **kw)

    # -- prediction -----------------------------------------------------------
    def predict(self, X, rank=None):
        """Ŷ from the operator fitted in closed form at rank ``rank_`` (or at ``rank``).

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d) or (n_samples, d)
        rank : int or None
            None: ``rank_``. Another rank, 0 ... ``n_features_in_``: the model at that rank from the same fit
            (e.g. at ``rank_at_tolerance(0.05)``), without refitting; the model :meth:`query_key_factors` gives
            the factors of.

        Returns
        -------
        Y_pred : ndarray of shape (n_samples, T, d_v)
            (or ``(n_samples, d_v)`` / ``(n_samples,)`` matching the ``Y`` given to fit).
        """
        check_is_fitted(self, "rank_")
        X = check_tokens(X, "X")
        n, T, d = X.shape
        if d != self.n_features_in_:
            raise ValueError(f"X has {d} features, but {type(self).__name__} is expecting "
                             f"{self.n_features_in_} features as input.")
        if self._inv.space == "tokens" and T != self._dims[0]:
            raise ValueError(f"X has T={T} tokens, but the linear-proxy operator A is {self._dims[0]} x "
                             f"{self._dims[0]} (fitted on T={self._dims[0]}).")
        operator = self._operator_at(rank)
        if operator is None:
            raise ValueError("predict is not available: the moment sums for the closed-form operator were not "
                             "accumulated because they would exceed the memory budget for this T, d and d_v "
                             "(rank_ and the spectrum are unaffected).")
        Y = operator.predict(X / self._x_scale) * self._y_scale
        return Y.reshape((n,) if self._y_ndim == 1 else (n, -1)) if self._y_ndim in (1, 2) else Y

    def score(self, X, y, sample_weight=None):
        """Token-wise R² of ``predict(X)`` (same as ``r2_score`` on ``(n*T, d_v)``).

        Parameters
        ----------
        X : array-like of shape (n_samples, T, d)
        y : array-like of shape (n_samples, T, d_v)
            The targets Y (named ``y`` as scikit-learn passes it by keyword).
        sample_weight : None
            Not supported; must be None.

        Returns
        -------
        float
        """
        if sample_weight is not None:
            raise ValueError("sample_weight is not supported by the token-wise R² score.")
        Y_pred = self.predict(X)
        Y = np.asarray(y, dtype=np.float64)
        if Y.shape != Y_pred.shape:
            raise ValueError(f"Y has shape {Y.shape}, but predict(X) has shape {Y_pred.shape}.")
        return token_r2_score(Y, Y_pred)
