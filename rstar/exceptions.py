"""Warnings raised when the data cannot identify r* reliably."""

__all__ = ["IllConditionedInversionWarning", "UnidentifiableRankWarning", "InversionFallbackWarning",
           "OperatorMisfitWarning"]


class IllConditionedInversionWarning(UserWarning):
    """The inversion amplifies noise (e.g. T close to d); see the message for the fallback used."""


class UnidentifiableRankWarning(UserWarning):
    """The spectrum cannot separate signal from noise (too few bulk eigenvalues, or
    more spikes than bulk); see the message for the fallback used."""


class InversionFallbackWarning(UserWarning):
    """The preferred inversion could not run (a cost budget, too few samples); the message names the
    inversion that ran instead and why (also recorded as ``inversion_`` and ``inversion_reason_``)."""


class OperatorMisfitWarning(UnidentifiableRankWarning):
    """The data do not follow the operator's model class (e.g. X and Y swapped, or softmax data fitted as
    linear query-key attention): the count is not a rank of that class. The message says which test rejected
    the class and what would fit; ``rank_interval_`` is widened to (0, d) and ``model_check_`` holds the
    tests' outcome (:mod:`rstar.model_check`)."""
