"""scikit-learn's own estimator checks on every data-only estimator.

2-D input is read as (n, 1, d): the linear proxy is then ordinary multi-output
linear regression, so its checks are meaningful; the attention operators with
a single token degenerate (softmax of one logit is 1; linear QK is cubic), so
they carry the ``poor_score`` tag.
"""

from sklearn.utils.estimator_checks import parametrize_with_checks

from rstar import (
    EnergyRankEstimator,
    MPRankEstimator,
    NumericalRankEstimator,
    RStarEstimator,
    SoftmaxInversionEstimator,
)

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
