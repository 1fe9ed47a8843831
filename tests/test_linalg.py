"""Kernels of geomuon.manifolds.linalg against SVD/eigendecomposition references.

Kernel tests run in the kernel's real dtype (float32 for msign); references in float64.
"""

import pytest
import torch

import threading
import time

from geomuon.manifolds import linalg
from geomuon.optimizers import maps
from geomuon.manifolds.linalg import (eigh, in_one_thread_workers, inv_sqrt_psd, msign, nuclear_norm, off_diagonal,
                                      fixed_start, power_iteration, spectral_norm)


def synthesized(shape, singular_values, seed=0):
    """U diag(s) V^T with Haar U, V (float64) and the given singular values (short side)."""
    *batch, m, n = shape
    k = min(m, n)
    gen = torch.Generator().manual_seed(seed)
    frames = []
    for rows in (m, n):
        q, r = torch.linalg.qr(torch.randn(*batch, rows, k, generator=gen, dtype=torch.float64))
        frames.append(q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2))
    left, right = frames
    return (left * singular_values) @ right.mT


def exact_polar(X):
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


@pytest.mark.parametrize("shape", [(256, 128), (128, 512), (4, 96, 64), (2, 3, 48, 80)])
def test_polar_express_fp32_matches_the_polar_factor_at_condition_1e3(shape):
    k = min(shape[-2:])
    shuffle = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    sigma = torch.logspace(0, -3, k, dtype=torch.float64)[shuffle]
    X = synthesized(shape, sigma)
    out = msign(X.float(), method="polar_express")
    assert out.dtype == torch.float32
    # The bound: 1e-3 in spectral norm at condition number 1e3 in float32.
    error = torch.linalg.matrix_norm(out.double() - exact_polar(X), ord=2).max().item()
    assert error <= 1e-3, error


def _spectrum_at_the_bound(k):
    """k - 1 unit singular values and one at exactly 0.003 * |X|_F (the claim's boundary)."""
    small = 0.003 * ((k - 1) / (1 - 0.003**2)) ** 0.5
    return torch.tensor([1.0] * (k - 1) + [small], dtype=torch.float64)


@pytest.mark.parametrize(
    "shape,spectrum",
    [
        ((128, 64), "log"),
        ((64, 256), "log"),
        ((3, 32, 48), "log"),
        ((96, 48), "boundary"),
    ],
)
def test_newton_schulz_five_steps_lands_in_its_band(shape, spectrum):
    # Quintic (3.4445, -4.7750, 2.0315) x 5 maps normalized singular values >= 0.003 into
    # [0.6, 1.25] (scalar oracle: [0.68, 1.13] from 1e-2, 0.47 only near 1e-3).
    k = min(shape[-2:])
    if spectrum == "log":
        sigma = torch.logspace(0, -2, k, dtype=torch.float64)
    else:
        sigma = _spectrum_at_the_bound(k)
    X = synthesized(shape, sigma, seed=1)
    normalized = sigma / X.norm(dim=(-2, -1), keepdim=True).squeeze(-1)
    assert normalized.min() >= 0.003 * (1 - 1e-12)  # the claim's hypothesis holds
    out = msign(X.float(), method="newton_schulz")
    assert out.dtype == torch.float32
    s = torch.linalg.svdvals(out.double())
    assert s.min() >= 0.6 and s.max() <= 1.25, (s.min().item(), s.max().item())


def test_newton_schulz_band_fails_below_its_hypothesis():
    # Negative control: normalized singular values of 1e-5 are outside the claim and are
    # not lifted to 0.6 in 5 steps, so the band check above is able to fail.
    sigma = torch.tensor([1.0] * 8 + [4e-5] * 8, dtype=torch.float64)
    X = synthesized((32, 16), sigma, seed=2)
    assert (sigma / X.norm()).min() < 0.003
    s = torch.linalg.svdvals(msign(X.float(), method="newton_schulz").double())
    assert s.min() < 0.6


@pytest.mark.parametrize("method", ["polar_express", "polar_express_5", "newton_schulz", "svd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_msign_of_zero_is_zero_and_keeps_dtype(method, dtype):
    out = msign(torch.zeros(3, 7, 5, dtype=dtype), method=method)
    assert out.dtype == dtype and out.shape == (3, 7, 5)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("shape", [(0, 12, 5), (1, 12, 5), (3, 12, 5), (3, 5, 12)],
                         ids=["empty", "one", "tall", "wide"])
def test_msign_of_a_stack_is_each_matrixs_own(shape):
    """On the CPU a stack is iterated one matrix at a time and stacked again: every entry is
    bitwise its matrix's own msign, in order, an empty stack stays empty; control: the first
    entry is not the second matrix's msign."""
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = msign(X, method="newton_schulz")
    assert out.shape == shape and out.dtype == X.dtype
    for x, o in zip(X, out):
        assert torch.equal(o, msign(x, method="newton_schulz"))
    if shape[0] > 1:
        assert not torch.equal(out[0], msign(X[1], method="newton_schulz"))


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (8, 8), (3, 12, 5), (2, 5, 12)],
                         ids=["tall", "wide", "square", "tall-stack", "wide-stack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_msign_with_scratch_buffers_is_bitwise_msign_and_returns_fresh_memory(shape, dtype):
    """With :class:`ScratchBuffers` msign runs the same kernels into reused memory: bitwise the
    result without them, the buffers reused by a second call (none added, none moved), and
    nothing returned aliases them: the first result is untouched by the second call (a last
    step written into a buffer breaks exactly this). Control: the second input's msign differs."""
    gen = torch.Generator().manual_seed(7)
    X, X2 = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    buffers = linalg.ScratchBuffers()
    first = msign(X, method="polar_express", buffers=buffers)
    kept = first.clone()
    assert torch.equal(first, msign(X, method="polar_express"))
    memory = {key: t.data_ptr() for key, t in buffers._tensors.items()}
    assert memory  # the iterations did use the buffers
    second = msign(X2, method="polar_express", buffers=buffers)
    assert torch.equal(second, msign(X2, method="polar_express"))
    assert {key: t.data_ptr() for key, t in buffers._tensors.items()} == memory
    assert torch.equal(first, kept)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_msign_keeps_dtype_with_a_compute_dtype(dtype):
    X = torch.randn(16, 8, dtype=dtype)
    out = msign(X, compute_dtype=torch.float32)
    assert out.dtype == dtype
    # bf16 storage rounds to 2^-8 relative; the fp32 iteration itself is far more accurate.
    error = torch.linalg.matrix_norm(out.double() - exact_polar(X.double()), ord=2).item()
    assert error <= 3 * 2**-8 * 8**0.5


def test_msign_svd_zeroes_null_directions():
    X = synthesized((12, 6), torch.tensor([3.0, 1.0, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64))
    s = torch.linalg.svdvals(msign(X, method="svd"))
    # Exactly three singular values at 1, the null space mapped to 0 (round-off 1e-15).
    assert torch.allclose(s, torch.tensor([1.0, 1, 1, 0, 0, 0], dtype=torch.float64), atol=1e-12)


def test_inv_sqrt_psd_matches_the_eigendecomposition():
    eigenvalues = torch.logspace(0, -4, 20, dtype=torch.float64)
    Q = synthesized((20, 20), torch.ones(20, dtype=torch.float64), seed=3)
    A = (Q * eigenvalues) @ Q.mT
    reference = (Q * eigenvalues.rsqrt()) @ Q.mT
    out = inv_sqrt_psd(A)
    # Condition 1e4: the default shift k*eps*|A| perturbs the smallest eigenvalue by a relative
    # 20*2.2e-16*1/1e-4 = 4e-11; Newton-Schulz converges to round-off well within 25 steps.
    spectral = torch.linalg.matrix_norm
    error = (spectral(out - reference, ord=2) / spectral(reference, ord=2)).item()
    assert error <= 1e-8, error
    assert inv_sqrt_psd(A.float()).dtype == torch.float32


def test_power_iteration_matches_the_top_singular_value_and_warm_starts():
    sigma = torch.tensor([5.0, 2.5] + [1.0] * 30, dtype=torch.float64)
    X = synthesized((3, 48, 32), sigma, seed=4)
    # Gap 2: the error of the Rayleigh estimate shrinks like (2.5/5)^(4k); 16 steps: 1e-19.
    value, v = power_iteration(X, steps=16)
    assert torch.allclose(value, spectral_norm(X), rtol=1e-12)
    warm, _ = power_iteration(X, steps=1, v0=v)
    assert torch.allclose(warm, spectral_norm(X), rtol=1e-12)
    cold, _ = power_iteration(X, steps=1)
    assert not torch.allclose(cold, spectral_norm(X), rtol=1e-12)  # the warm start matters


def test_power_iteration_draws_its_default_start_once_per_shape_and_device(monkeypatch):
    # a regulator calls power_iteration without v0 at every step: the start is drawn (on the CPU,
    # then copied: a host sync on a GPU) once, and every later call reuses it, the same vector
    X = synthesized((2, 40, 31), torch.logspace(0, -1, 31, dtype=torch.float64), seed=8)
    fixed_start.cache_clear()  # the control below needs a shape no earlier test cached
    first, v = power_iteration(X, steps=3)

    def no_draw(*args, **kwargs):
        raise AssertionError("power_iteration drew a new start vector")

    monkeypatch.setattr(torch, "randn", no_draw)
    again, v_again = power_iteration(X, steps=3)
    assert torch.equal(first, again) and torch.equal(v, v_again)
    with pytest.raises(AssertionError, match="drew a new start"):  # a new shape draws (the control)
        power_iteration(X[..., :30], steps=3)


@pytest.mark.parametrize("method,rtol", [("svd", 1e-12), ("polar_express", 1e-6)])
def test_nuclear_norm_matches_the_sum_of_singular_values(method, rtol):
    X = synthesized((2, 40, 24), torch.logspace(0, -2, 24, dtype=torch.float64), seed=5)
    reference = torch.linalg.svdvals(X).sum(-1)
    # polar_express in float64: 12 steps leave msign accurate to ~1e-9 at condition 1e2,
    # and the nuclear norm is first-order insensitive to polar errors along X.
    assert torch.allclose(nuclear_norm(X, method=method), reference, rtol=rtol)


@pytest.mark.parametrize(
    "kernel", [msign, nuclear_norm, spectral_norm, power_iteration, inv_sqrt_psd]
)
def test_kernels_reject_vectors_and_integers(kernel):
    with pytest.raises(ValueError, match="1-D|matrix"):
        kernel(torch.randn(5))
    with pytest.raises(TypeError, match="floating"):
        kernel(torch.ones(4, 4, dtype=torch.int64))


def test_msign_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        msign(torch.randn(4, 3), method="qr")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _symmetric_stack(batch, n, dtype, seed=0):
    A = torch.randn(batch, n, n, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return A @ A.mT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eigh_at_two_threads_is_bitwise_the_one_thread_result(dtype, two_threads):
    """The split stack (odd, so the parts differ in size; batch dims kept) equals LAPACK on
    one thread bit for bit, and each matrix equals its own decomposition alone. Control: the
    stack's matrices are distinct, so a misordered reassembly fails the comparison."""
    S = _symmetric_stack(5, 96, dtype).reshape(5, 1, 96, 96)
    values, vectors = eigh(S)
    torch.set_num_threads(1)
    one_values, one_vectors = torch.linalg.eigh(S)
    torch.set_num_threads(2)
    assert values.shape == (5, 1, 96) and vectors.shape == (5, 1, 96, 96)
    assert torch.equal(values, one_values) and torch.equal(vectors, one_vectors)
    for i in range(5):
        alone_values, alone_vectors = eigh(S[i])
        assert torch.equal(alone_values, values[i]) and torch.equal(alone_vectors, vectors[i])
    assert not torch.equal(values.flip(0), values)


def _count_in_new_thread():
    counts = []
    thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return counts[0]


def test_workers_run_one_thread_each_in_the_callers_grad_mode_and_leave_the_thread_count(two_threads):
    """At 2 threads the calls run in the workers, one intra-op thread each, with the caller's
    grad mode; the caller keeps 2 threads and a thread started afterwards gets 2. Control:
    the hazard is real — a worker's torch.set_num_threads(1) alone hands a later thread 1."""
    def report():
        return threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()

    with torch.no_grad():
        seen = in_one_thread_workers([report, report, report])
    assert all(name.startswith("geomuon-worker") and count == 1 and not grad for name, count, grad in seen)
    assert in_one_thread_workers([report])[0][2] is True
    assert torch.get_num_threads() == 2 and _count_in_new_thread() == 2
    worker = threading.Thread(target=lambda: torch.set_num_threads(1))
    worker.start()
    worker.join()
    assert _count_in_new_thread() == 1  # the control: what the restore prevents


def test_workers_finish_every_call_then_raise_the_first_failure_and_restore_the_count(two_threads):
    """A failing call does not leave others running behind the caller's back, its error
    reaches the caller, and later threads still get the caller's count."""
    finished = []

    def slow():
        time.sleep(0.2)
        finished.append("slow")

    def failing():
        raise torch.linalg.LinAlgError("worker failed")

    with pytest.raises(torch.linalg.LinAlgError, match="worker failed"):
        in_one_thread_workers([failing, slow])
    assert finished == ["slow"]
    assert _count_in_new_thread() == 2


def test_eigh_takes_one_call_at_one_thread(monkeypatch):
    """No workers at one thread (control: at two threads a lone matrix does go to one, so
    that its result is the one-thread result there too)."""
    calls = []

    def spy(batch):
        calls.append(len(batch))
        return [call() for call in batch]

    monkeypatch.setattr(linalg, "in_one_thread_workers", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        eigh(_symmetric_stack(3, 16, torch.float64))
        assert calls == []
        torch.set_num_threads(2)
        eigh(_symmetric_stack(1, 16, torch.float64))
        assert calls == [1]
    finally:
        torch.set_num_threads(before)


def test_off_diagonal_is_exactly_the_subtraction_of_the_diagonal():
    """The one-pass select equals S - Diag(S) bit for bit on a batch (float32: the
    subtraction is exact, x - x = +0). Control: the diagonal was nonzero, so a map that kept
    it would fail."""
    S = torch.randn(3, 7, 7, generator=torch.Generator().manual_seed(1))
    reference = S - torch.diag_embed(torch.diagonal(S, dim1=-2, dim2=-1))
    out = off_diagonal(S)
    assert torch.equal(out.view(torch.int32), reference.view(torch.int32))
    assert torch.diagonal(S, dim1=-2, dim2=-1).abs().min() > 0


def _polar_factor(X: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


def test_fp16_msign_normalizes_in_fp32_range_and_is_scale_invariant():
    # fp16's norm overflows at 65504: a 256 x 256 gradient with entries ~300 (norm 7.7e4) had
    # been normalized to zero; and fp16's sqrt(tiny) floor (7.8e-3) had distorted a matrix
    # of norm 1e-3 (error 0.28 against 0.005 at norm 1). Bounds: 12 Polar Express steps in
    # fp16 (u = 4.9e-4) leave errors of a few 1e-3 on well-conditioned inputs (measured
    # 6.4e-3 and 5.0e-3); 2e-2 is 4x that, and a zero output errs by 1.
    gen = torch.Generator().manual_seed(0)
    big = (torch.randn(256, 256, generator=gen) * 300).half()
    assert big.float().norm() > 65504
    assert torch.linalg.matrix_norm(msign(big).double() - _polar_factor(big), ord=2) < 2e-2
    X = torch.randn(64, 64, generator=gen)
    errors = [torch.linalg.matrix_norm(msign((X * s / X.norm()).half()).double() - _polar_factor(X), ord=2).item()
              for s in (1.0, 1e-3)]
    assert max(errors) < 2e-2, errors


def test_msign_edge_cases_keep_their_contract():
    assert torch.equal(msign(torch.zeros(3, 4), eps=0.0), torch.zeros(3, 4))  # eps = 0 had given 0/0 = NaN
    for shape in ((2, 0, 5), (0, 3, 4)):  # empty: reshape(-1, ...) had raised
        assert msign(torch.zeros(shape)).shape == shape
    X = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)  # buffers are for no-grad work only
    msign(X, buffers=linalg.ScratchBuffers()).sum().backward()
    assert X.grad is not None and torch.isfinite(X.grad).all()


@pytest.mark.parametrize("scale", [1e-25, 1e-12, 1.0, 1e12, 1e25])
def test_inv_sqrt_psd_and_power_iteration_at_any_scale(scale):
    # Frobenius norms of a Gram square its entries: in fp32 a Gram of order 1e-25 had a zero
    # norm (NaN result), and power iteration's sigma^2 overflowed from sigma ~ 4e9 (sigma = 0,
    # v = 0). Both now scale by the largest entry first. Tolerances: fp32 (eps 1.2e-7) with
    # condition ~1e2 and 25 Newton-Schulz steps: 1e-4 relative (measured 5e-5).
    gen = torch.Generator().manual_seed(1)
    B = torch.randn(16, 16, generator=gen, dtype=torch.float64)
    A = B @ B.T + torch.eye(16, dtype=torch.float64)
    reference = inv_sqrt_psd(A)
    result = inv_sqrt_psd((A * scale).float()).double() * scale**0.5
    assert torch.linalg.matrix_norm(result - reference) <= 1e-4 * torch.linalg.matrix_norm(reference)
    X = torch.randn(20, 30, generator=gen)
    sigma, v = linalg.power_iteration(X * scale, steps=50)
    top = torch.linalg.matrix_norm(X.double(), ord=2).item() * scale
    assert sigma.item() == pytest.approx(top, rel=1e-5) and v.norm().item() == pytest.approx(1.0, rel=1e-6)


_NAN = float("nan")
_X = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("call, match", [
    (lambda: msign(_X, steps=2.7), "msign: steps must be a whole number"),
    (lambda: msign(_X, steps=True), "msign: steps must be a whole number"),
    (lambda: msign(_X, eps=_NAN), "msign: eps must be a finite number >= 0"),
    (lambda: msign(_X, eps=-1.0), "msign: eps must be a finite number >= 0"),
    (lambda: msign(_X, compute_dtype=torch.int32), "msign: compute_dtype must be a real floating"),
    (lambda: msign(_X, compute_dtype=torch.complex64), "msign: compute_dtype must be a real floating"),
    (lambda: inv_sqrt_psd(_X.mT @ _X, steps=-1), "inv_sqrt_psd: steps must be a whole number"),
    (lambda: inv_sqrt_psd(_X.mT @ _X, eps=_NAN), "inv_sqrt_psd: eps must be a finite number"),
    (lambda: power_iteration(_X, steps=1.5), "power_iteration: steps must be a whole number"),
    (lambda: power_iteration(_X, v0=torch.ones(7)), "power_iteration: v0 of shape"),
    (lambda: maps.row_norm(_X, eps=-1.0), "row_norm: eps must be a finite number >= 0"),
    (lambda: maps.right_polar(_X, alpha=_NAN), "right_polar: alpha must be a finite number"),
    (lambda: maps.hybrid(_X, alpha=float("inf")), "hybrid: alpha must be a finite number"),
])
def test_kernel_options_are_refused_by_name(call, match):
    # each had been taken: 2.7 steps ran 2, True one, NaN gave NaN results, a negative floor
    # divided rows of norm ~1 by ~0, an int compute dtype failed inside torch.finfo
    with pytest.raises(ValueError, match=match):
        call()


def test_sound_kernel_options_are_accepted():
    msign(_X, steps=0, eps=0.0, compute_dtype=torch.bfloat16)  # 0 steps: the normalization alone
    inv_sqrt_psd(_X.mT @ _X, steps=3, eps=torch.tensor(1e-6))
    power_iteration(_X, steps=0, v0=torch.ones(2, 4))
    maps.right_polar(_X, alpha=0.5, eps=0.0)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1e-45, 1e40])
def test_msign_narrows_a_float64_matrix_after_normalizing_it(compute, scale):
    # fp32 and bf16 hold neither 1e-45 X (it had come out 0) nor 1e40 X (NaN); msign is
    # scale-invariant, so the result is the polar factor of X. Tolerance: the compute dtype's
    # Polar Express result, 10 eps_compute on entries of order 1/sqrt(4) (bf16: 0.08).
    X = _X.double()
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    out = msign(X * scale, compute_dtype=compute)
    assert out.dtype == torch.float64
    assert (out - U @ Vh).abs().max() <= 10 * torch.finfo(compute).eps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_spectral_norm_takes_half_precision(dtype):
    # torch's matrix_norm refuses half precision ("Low precision dtypes not supported"); the
    # reference computes in float32. Tolerance: the input's own rounding, eps of the dtype.
    X = _X.to(dtype)
    out = spectral_norm(X)
    assert out.dtype == dtype
    assert abs(float(out) - float(torch.linalg.matrix_norm(X.float(), ord=2))) <= torch.finfo(dtype).eps * float(out)
