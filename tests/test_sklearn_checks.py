"""scikit-learn's own estimator checks on every estimator: the data-only ones and the trained students.

2-D input is read as (n, 1, d): the linear proxy is then ordinary multi-output
linear regression, so its checks are meaningful; the attention operators with
a single token degenerate (softmax of one logit is 1; linear QK is cubic), so
they carry the ``poor_score`` tag.
"""

import pytest
from sklearn.utils.estimator_checks import check_param_validation, parametrize_with_checks

from rstar import (
    EnergyRankEstimator,
    MPRankEstimator,
    NumericalRankEstimator,
    RStarEstimator,
    SoftmaxInversionEstimator,
)
from rstar.students import AttentionStudent

ESTIMATORS = [
    NumericalRankEstimator(),
    MPRankEstimator(),
    EnergyRankEstimator(),
    MPRankEstimator(operator="linear_qk"),
    SoftmaxInversionEstimator(),
    RStarEstimator(),
    RStarEstimator(operator="linear_proxy"),
]

# Each expected failure, with the reason it cannot pass.
EXPECTED_FAILED_CHECKS = {}


def _expected_failed_checks(estimator):
    return EXPECTED_FAILED_CHECKS.get(type(estimator).__name__, {})


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=_expected_failed_checks)
def test_sklearn_compatible_estimator(estimator, check):
    check(estimator)


# Trained with torch on the checks' small arrays (2-D: one token a sample). The query-key students carry the
# poor_score tag there (attention of one token degenerates) and train a few epochs; the linear proxy is then linear
# regression and trains until it fits.
STUDENTS = [
    AttentionStudent(kind="linear_proxy", max_epochs=300, random_state=0),
    AttentionStudent(kind="linear_qk", max_epochs=5, random_state=0),
    AttentionStudent(kind="softmax", max_epochs=5, random_state=0),
    AttentionStudent(kind="softmax", causal=True, max_epochs=5, random_state=0),
]


@parametrize_with_checks(STUDENTS)
def test_sklearn_compatible_student(estimator, check):
    pytest.importorskip("torch")
    check(estimator)


# scikit-learn runs check_param_validation on its own estimators only: every parameter a constraint names, and each
# constraint refusing what it should, with InvalidParameterError before any work.
@pytest.mark.parametrize("estimator", ESTIMATORS + STUDENTS, ids=lambda est: type(est).__name__)
def test_parameter_constraints_cover_every_parameter(estimator):
    if isinstance(estimator, AttentionStudent):
        pytest.importorskip("torch")
    check_param_validation(type(estimator).__name__, estimator)
