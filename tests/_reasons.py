"""Check identifiability warnings by their class and structured fields, not their prose.

The warnings that say r* is not identified are decided in :mod:`rstar.rules.identifiability`: each carries a
stable ``reason`` (a key of ``REASONS``) and ``bounds``. So do the verdicts a rule returns
(``RuleResult.warnings``) and those an estimator records (``est.verdicts_``). Tests assert those, so that
rewording a message breaks no test::

    from _reasons import assert_warned, reasons

    with pytest.warns(UnidentifiableRankWarning) as caught:
        est.fit(X, Y)
    assert_warned(caught, "single_token", bounds=(0, 6))
    assert "bulk_exhausted" in reasons(res.warnings)

(Not in conftest.py: its functions cannot be imported by the test modules.)
"""

from rstar.rules.identifiability import REASONS

__all__ = ["assert_warned", "reasons", "with_reason"]


def _items(caught):
    """``(category, reason, bounds)`` of caught warnings (``warnings.WarningMessage``: ``pytest.warns`` records,
    ``warnings.catch_warnings(record=True)``) or of verdicts (``RuleResult.warnings``, ``est.verdicts_``)."""
    for w in caught:
        source = w.message if hasattr(w, "message") and not isinstance(w.message, str) else w
        category = getattr(w, "category", None)
        yield category, getattr(source, "reason", None), getattr(source, "bounds", None), w


def reasons(caught):
    """The set of ``reason`` of caught warnings or verdicts (those without a reason are left out)."""
    return {reason for _, reason, _, _ in _items(caught) if reason is not None}


def with_reason(caught, reason):
    """The caught warnings (or verdicts) of ``reason``."""
    assert reason in REASONS, f"unknown reason {reason!r}"
    return [w for _, r, _, w in _items(caught) if r == reason]


def assert_warned(caught, reason, bounds=None, category=None):
    """Assert that ``caught`` holds a warning (or verdict) of ``reason`` -- with ``bounds`` and of ``category``
    (a subclass) where given -- and return the first such."""
    hits = with_reason(caught, reason)
    assert hits, f"no {reason!r} among {sorted(reasons(caught))}"
    if category is not None:
        for w in hits:
            got = getattr(w, "category", None)
            assert got is not None and issubclass(got, category), f"{reason!r} is a {got}, not a {category}"
    if bounds is not None:
        got = [b for _, r, b, _ in _items(caught) if r == reason]
        assert tuple(bounds) in [tuple(b) for b in got if b is not None], f"{reason!r} bounds {got}, not {bounds}"
    return hits[0]
