"""Shared test configuration.

Hypothesis profiles: ``ci`` (default; bounded and derandomized so CI on 2 cores is
reproducible and fast) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``, or
``make test-thorough``, for local runs hunting rare counterexamples).
"""

import contextlib
import os
import threading

# Spinning OpenMP workers steal the other core from concurrent processes (DDP tests,
# subprocess CLI tests); passive waiting costs nothing measurable here. Must be set
# before torch initializes OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
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


_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
_ORIGINAL_READS = {name: getattr(torch.Tensor, name) for name in _READS}
# The guard patches torch.Tensor for the whole process, and optimizer steps enter it from
# several worker threads at once (ManifoldMuon's batches on a multi-threaded CPU): a count
# of the threads inside, under a lock, so the last one out restores the true methods.
_guard_lock = threading.Lock()
_guard_depth = 0


@contextlib.contextmanager
def _no_host_reads():
    global _guard_depth

    def refuse(self, *args, **kwargs):
        raise RuntimeError("host read of a tensor's value where none is allowed")

    with _guard_lock:
        if _guard_depth == 0:
            for name in _READS:
                setattr(torch.Tensor, name, refuse)
        _guard_depth += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard_depth -= 1
            if _guard_depth == 0:
                for name, method in _ORIGINAL_READS.items():
                    setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def _torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Every test leaves torch's thread count as it found it: a benchmark script's ``main``,
    run in-process by its tests, sets its ``--threads``, and a later test comparing an
    in-process run bit for bit with a subprocess of the suite's thread count had then failed."""
    with _torch_threads(torch.get_num_threads()):
        yield


@pytest.fixture
def unreadable_data_files(monkeypatch):
    """Called, it makes every file ``geomuon.pretrain.data`` opens refuse to be read
    (``PermissionError``) until the test ends: root reads a chmod-000 file, so the refusal is
    simulated where ``read_text`` opens it."""
    from geomuon.pretrain import data as data_module

    def refused(name, *args, **kwargs):
        raise PermissionError(13, "Permission denied", name)

    return lambda: monkeypatch.setattr(data_module, "open", refused, raising=False)


@pytest.fixture
def torch_threads():
    """``with torch_threads(k):`` runs torch on ``k`` intra-op threads, restoring the count
    after (an optimizer step with ``parallel_batches`` uses worker threads only at ``k > 1``)."""
    return _torch_threads


@pytest.fixture
def one_thread():
    """The test runs torch on one intra-op thread (no optimizer step uses worker threads)."""
    with _torch_threads(1):
        yield


@pytest.fixture
def no_host_reads():
    """A context manager under which every read of a tensor's value into Python
    (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``) raises ``RuntimeError``
    ("host read ..."): the CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``,
    where each of these is a device sync."""
    return _no_host_reads
