"""Warnings raised when the data cannot identify r* reliably."""

__all__ = ["IllConditionedInversionWarning", "UnidentifiableRankWarning", "InversionFallbackWarning"]


class IllConditionedInversionWarning(UserWarning):
    """The inversion amplifies noise (e.g. T close to d); see the message for the fallback used."""


class UnidentifiableRankWarning(UserWarning):
    """The spectrum cannot separate signal from noise (too few bulk eigenvalues, or
    more spikes than bulk); see the message for the fallback used."""


class InversionFallbackWarning(UserWarning):
    """The preferred inversion could not run (a cost budget, too few samples); the message names the
    inversion that ran instead and why (also recorded as ``inversion_`` and ``inversion_reason_``)."""
