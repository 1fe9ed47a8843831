"""Shared test configuration.

Hypothesis profiles: ``ci`` (default; bounded and derandomized so CI on 2 cores is
reproducible and fast) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``, or
``make test-thorough``, for local runs hunting rare counterexamples).
"""

import os

# Spinning OpenMP workers steal the other core from concurrent processes (DDP tests,
# subprocess CLI tests); passive waiting costs nothing measurable here. Must be set
# before torch initializes OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# geoopt's own Stiefel tests (vendored, Apache-2.0) patch geoopt for the whole process; they
# run in a subprocess of tests/test_geoopt_suite.py, never collected into this one.
collect_ignore = ["geoopt_suite"]

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests share 2 cores with nothing else in CI; more threads than cores only thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))
