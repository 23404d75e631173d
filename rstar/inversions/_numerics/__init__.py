"""The inversions' numerics: pure functions on arrays, no estimator state and no rank decision.

- :mod:`.linalg` -- symmetric solves, PSD powers, the Kronecker rearrangement;
- :mod:`.lbfgs` -- L-BFGS with a reusable state (the factored fit's segments);
- :mod:`.bilinear` -- alternating and profiled least squares of bilinear (query-key) models;
- :mod:`.value_error` -- the linearised error of a fitted value map and its move of a kernel;
- :mod:`.softmax_ls` -- the full-rank softmax least squares and its information matrix;
- :mod:`.softmax_factored` -- the factored ``K = A B^T`` softmax least squares at real sizes.
"""
