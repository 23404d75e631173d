import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per worker: the workers already fill the cores (set before numpy, scipy or torch load their
    # thread pools; threadpoolctl below for any that loaded earlier)
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np
import pytest
from hypothesis import settings
from threadpoolctl import threadpool_limits

if os.environ.get("PYTEST_XDIST_WORKER"):
    threadpool_limits(limits=1)

# Property tests draw the same examples on every run and keep no example database: one unlucky draw can then
# neither fail a single run at random nor be replayed into every later run of a checkout. To explore with fresh
# random draws (and a local database), run with HYPOTHESIS_PROFILE=explore.
settings.register_profile("reproducible", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

from rstar.datasets import make_attention_task, make_linear_proxy

# Identifiability warnings are checked by class and structured fields (reason, bounds), not by their prose: the
# helpers reasons / assert_warned live in tests/_reasons.py (a conftest's functions cannot be imported by tests).


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread: as fast for these tiny models, and no OpenMP stalls on a busy machine.

    torch is imported here, lazily, so modules that request this fixture still run without torch.
    """
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def table1_task():
    """The paper's Table 1 task: T=16, d=12, r*=3, sharp gap, sigma=0.05, n=1000."""
    return make_linear_proxy(1000, seq_len=16, n_features=12, rank=3, noise=0.05, random_state=0,
                             return_teacher=True)


@pytest.fixture(scope="session")
def linear_qk_task():
    """Linear-QK teacher, unknown V: T=64, d=32, r*=4, n=2000."""
    return make_attention_task(2000, kind="linear_qk", seq_len=64, n_features=32, rank=4, random_state=1,
                               return_teacher=True)


@pytest.fixture(scope="session")
def softmax_task():
    """Softmax teacher: T=32, d=16, r*=3, logit scale 2, n=2000."""
    return make_attention_task(2000, kind="softmax", seq_len=32, n_features=16, rank=3, logit_scale=2.0,
                               random_state=2, return_teacher=True)


@pytest.fixture(scope="session")
def small_qk_task():
    return make_attention_task(400, kind="linear_qk", seq_len=24, n_features=8, rank=2, random_state=3,
                               return_teacher=True)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
