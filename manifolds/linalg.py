r"""Linear-algebra kernels: the ground floor every manifold and optimizer calls.

All kernels act on the last two dimensions of ``[..., m, n]`` tensors, so a stack of
same-shape matrices is one batched call.

Dtype contract
--------------
Every kernel returns the caller's dtype. The *compute* dtype is the input's dtype unless
``compute_dtype`` says otherwise: a float64 input gets float64 arithmetic (what the theory
tests rely on), a bfloat16 input gets bfloat16 matmuls. Optimizers choose bf16 explicitly
for directions and fp32 for retractions. :func:`inv_sqrt_psd` is the exception: a matrix
square root of a Gram matrix is too ill-conditioned for half precision, so it computes in
at least float32.
"""

from __future__ import annotations

import math
import numbers
import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

__all__ = [
    "NSSchedule",
    "KELLER_QUINTIC",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_5",
    "msign",
    "newton_schulz_step",
    "polar_express_steps",
    "ScratchBuffers",
    "inv_sqrt_psd",
    "largest_entry",
    "power_of_two_at_most",
    "unit_scale",
    "per_matrix",
    "coupled_newton_schulz_step",
    "power_iteration",
    "fixed_start",
    "nuclear_norm",
    "spectral_norm",
    "off_diagonal",
    "sym",
    "eigh",
    "in_one_thread_workers",
    "check_matrix",
    "fp32_or_fp64",
    "narrower_range",
    "as_real",
    "as_count",
    "as_positive",
    "check_real",
    "check_count",
    "check_compute_dtype",
    "rms_scale",
]


@dataclass(frozen=True)
class NSSchedule:
    r"""Coefficients of a quintic Newton–Schulz iteration for the polar factor.

    One step on the wide orientation ($m \le n$) is

    $$S = XX^\top,\qquad X \leftarrow aX + (bS + cS^2)X,$$

    i.e. the odd polynomial $p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5$ applied to every
    singular value. Step $k$ uses ``coefficients[k]``; past the end of the table the last
    tuple repeats. The input is first divided by ``input_scale`` $\cdot\|X\|_F$, which puts
    every singular value in $[0, 1/\text{input\_scale}]$.
    """

    name: str
    coefficients: tuple[tuple[float, float, float], ...]
    input_scale: float
    default_steps: int

    def step_coefficients(self, steps: int) -> list[tuple[float, float, float]]:
        table = list(self.coefficients)
        return [table[min(k, len(table) - 1)] for k in range(steps)]


#: Keller Jordan's quintic (Muon): maps $[10^{-3}, 1]$ into $\approx[0.47, 1.20]$ in 5 steps.
KELLER_QUINTIC = NSSchedule("newton_schulz", ((3.4445, -4.7750, 2.0315),), 1.0, 5)


def _with_safety(table, safety: float):
    """Divide step k's (a, b, c) by (s, s^3, s^5), all but the last (Polar Express recipe)."""
    out = [(a / safety, b / safety**3, c / safety**5) for a, b, c in table[:-1]]
    return tuple(out) + (table[-1],)


#: Polar Express, the authors' 8-step table (arXiv 2505.16932) with the 1.01 safety factor;
#: the last tuple $(15/8, -5/4, 3/8)$ repeats. The default 12 steps reach
#: $\|\operatorname{msign}(X) - UV^\top\|_2 \le 2\cdot10^{-4}$ in fp32 at condition number
#: $10^3$ when the normalized $\sigma_{\min}$ is $10^{-3}/\sqrt{k}$ up to $k = 512$; beyond, the
#: schedule itself leaves that singular value short (exact arithmetic, 12 steps:
#: $6.6\cdot10^{-9}$ at $k = 256$, $2.9\cdot10^{-5}$ at 512, $2.7\cdot10^{-3}$ at 1024, $0.13$ at
#: 4096; 10 steps: $8.4\cdot10^{-2}$ already at 256, $3\cdot10^{-5}$ for log-spaced spectra).
POLAR_EXPRESS = NSSchedule(
    "polar_express",
    _with_safety(
        (
            (8.28721201814563, -23.595886519098837, 17.300387312530933),
            (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
            (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
            (3.3184196573706015, -2.488488024314874, 0.51004894012372),
            (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
            (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
            (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
            (1.875, -1.25, 0.375),
        ),
        1.01,
    ),
    1.01,
    12,
)

#: The 5-step Polar Express table used by modded-nanogpt and Dion (input $\div 1.02\|X\|_F$).
POLAR_EXPRESS_5 = NSSchedule(
    "polar_express_5",
    (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    1.02,
    5,
)

_SCHEDULES = {s.name: s for s in (KELLER_QUINTIC, POLAR_EXPRESS, POLAR_EXPRESS_5)}
MSIGN_METHODS = tuple(_SCHEDULES) + ("svd",)


def check_matrix(X, what: str, vector_hint: str = "1-D tensors (biases, gains) have no polar factor") -> None:
    """Raise ``TypeError``/``ValueError`` naming ``what`` unless ``X`` is a floating
    ``[..., m, n]`` tensor; ``vector_hint`` tells the caller what to do with a 1-D one."""
    # Tensor-like objects (``__torch_function__``) pass: geomuon.theory.symbolic runs the
    # library's maps on sympy-valued tensors to certify them exactly.
    if not torch.overrides.is_tensor_like(X):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(X).__name__}")
    if X.dim() < 2:
        raise ValueError(
            f"{what}: expected a matrix or a batch of matrices [..., m, n], got shape "
            f"{tuple(X.shape)}; {vector_hint}"
        )
    if not X.is_floating_point():
        raise TypeError(f"{what}: expected a floating-point tensor, got {X.dtype}")


def fp32_or_fp64(dtype: torch.dtype) -> torch.dtype:
    r"""The dtype of the accurate computations (retractions, inverse square roots, polar
    maps, regulators, manifold checks): float64 for float64 input, float32 otherwise.

    Half precision is upcast: a bf16 retraction or inverse root adds round-off comparable
    to the optimizer step itself (bf16 has an 8-bit significand, $\varepsilon = 2^{-7}$).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def narrower_range(dtype: torch.dtype, than: torch.dtype) -> bool:
    r"""Whether ``dtype``'s exponent range is narrower than ``than``'s, so that a value of
    ``than`` may overflow or underflow in it: float16 (normal numbers from $6.1\cdot10^{-5}$
    to 65504, where a realistic gradient or momentum overflows) against float32 and
    bfloat16, and every other dtype against float64 (up to $10^{308}$). bfloat16 has
    float32's range."""
    return torch.finfo(dtype).tiny > torch.finfo(than).tiny


def as_real(where: str, name: str, value) -> float:
    """``value`` as a float, refusing (``TypeError`` naming ``where`` and ``name``) what
    ``float()`` takes only by accident (a bool: ``True`` had counted as 1; a string: ``"4"``
    as 4) or not at all (``None``: a raw ``float()`` error that named no option)."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}") from None


def check_real(where: str, name: str, value, admissible: Callable[[float], bool] = lambda x: True,
               what: str = "a finite number") -> None:
    """Refuse option ``name`` of ``where`` (``ValueError`` naming both and ``what`` it must
    be) unless ``value`` is a finite real number with ``admissible(value)``; a bool or a
    string is not one (NaN had given NaN results, ``True`` had been taken as 1)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and admissible(value)):
        raise ValueError(f"{where}: {name} must be {what}, got {value!r}")


def shape_on_meta(expected, *meta_inputs: torch.Tensor) -> torch.Size | None:
    """The shape of ``expected(*inputs)``, computed on ``meta`` copies of ``meta_inputs`` (shapes
    only, no arithmetic, nothing read back); ``None`` for a map that cannot run on meta tensors (a
    user manifold holding a tensor of its own, on a real device)."""
    try:
        return expected(*(torch.empty_like(t, device="meta") for t in meta_inputs)).shape
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def check_shape_of(who: str, name: str, given: torch.Tensor, expected, *meta_inputs: torch.Tensor,
                   what_to_do: str = "") -> None:
    r"""Refuse (``ValueError`` naming ``name``, then ``what_to_do``) a tensor ``given`` whose shape
    is not that of ``expected(*inputs)`` (:func:`shape_on_meta`). A map that cannot run on meta
    tensors is not checked: its own products then decide."""
    shape = shape_on_meta(expected, *meta_inputs)
    if shape is not None and given.shape != shape:
        raise ValueError(f"{who}: {name} {tuple(given.shape)} must have the multiplier's shape {tuple(shape)}"
                         + (f"; {what_to_do}" if what_to_do else ""))


def check_count(where: str, name: str, value, least: int = 0) -> int:
    """``value``, refused as option ``name`` of ``where`` unless it is a whole number ``>= least``
    (an ``int``, not a bool: ``steps=2.7`` had run 2 steps, ``True`` one)."""
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least):
        raise ValueError(f"{where}: {name} must be a whole number >= {least}, got {value!r}")
    return value


def as_count(where: str, name: str, value, least: int = 0) -> int:
    """``value`` as an ``int`` where a whole number of any real type is meant (a 0-dim tensor,
    ``4.0`` read from a file), refused as :func:`check_count` refuses it unless it is integral
    and ``>= least`` (2.7 had become 2)."""
    number = as_real(where, name, value)
    whole = math.isfinite(number) and number == int(number)
    return check_count(where, name, int(number) if whole else value, least)


def as_positive(where: str, name: str, value, *, zero: bool = False) -> float:
    """``value`` as a float (:func:`as_real`), refused as option ``name`` of ``where``
    (``ValueError``) unless finite and ``> 0`` (``>= 0`` with ``zero``)."""
    number = as_real(where, name, value)
    if not (math.isfinite(number) and (number > 0 or (zero and number == 0))):
        raise ValueError(f"{where}: {name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")
    return number


def check_compute_dtype(where: str, name: str, value, *, float16: bool = True) -> None:
    """Refuse option ``name`` of ``where`` unless ``value`` is ``None`` or a real floating
    ``torch.dtype`` (an int dtype had lost a warm start to integer products, a complex one
    the imaginary parts); with ``float16=False`` not float16 either, for a computation on
    unnormalized values that fp16's range (normal numbers from 6.1e-5 to 65504) cannot hold
    (a gradient of entries 1e5 had failed inside an SVD)."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{where}: {name} must be a real floating torch.dtype (e.g. torch.bfloat16) or None, "
                         f"got {value!r}")
    if value == torch.float16 and not float16:
        raise ValueError(f"{where}: {name}=torch.float16 cannot hold the unnormalized values computed in it (its "
                         "range ends at 65504); use torch.bfloat16 (float32's range) or None")


def rms_scale(shape: tuple[int, ...] | torch.Size) -> float:
    r"""$\sqrt{\text{fan\_in}/\text{fan\_out}}$ for a ``[..., fan_out, fan_in]`` shape: the
    factor from the spectral norm to the RMS→RMS operator norm (Bernstein & Newhouse 2024,
    "Modular duality in deep learning", arXiv:2410.21265)."""
    fan_out, fan_in = shape[-2], shape[-1]
    return math.sqrt(fan_in / fan_out)


def off_diagonal(S: torch.Tensor) -> torch.Tensor:
    r"""$\operatorname{Off}(S)$: square matrices ``[..., n, n]`` with the diagonal set to zero: a
    copy whose $n$ diagonal entries are then zeroed in place (a select against the identity's
    pattern read a mask and cost 5× as much, 2 % of a DGram step; subtracting
    $\operatorname{Diag}(S)$ took three passes). Every entry is copied or zeroed, so the result
    is exactly that of the subtraction, which symbolic arrays (:mod:`geomuon.theory.symbolic`:
    free matrices have no in-place writes) take instead."""
    if not isinstance(S, torch.Tensor):
        return S - torch.diag_embed(torch.diagonal(S, dim1=-2, dim2=-1))
    out = S.clone()
    out.diagonal(dim1=-2, dim2=-1).zero_()
    return out


def in_one_thread_workers(calls: list[Callable[[], T]]) -> list[T]:
    r"""Run ``calls`` in worker threads that run torch on one intra-op thread each, $k$ at a
    time for the caller's $k$ threads; their results in order.

    For independent work whose torch ops scale poorly across threads (LAPACK's eigensolver
    at transformer sizes; the many small elementwise ops of an optimizer step): one thread
    per call scales almost linearly instead, and each call computes exactly what it computes
    on one thread, so its result is the same at every thread count. The workers take the
    caller's grad mode. Every call finishes before this returns; the first failure is then
    raised. ``torch.set_num_threads(1)`` in a worker sets its own OpenMP and MKL counts but
    also ATen's process-wide count, which threads started later inherit, so the caller's
    count is restored. The pool is per process (a forked child has none of its parent's
    threads) and thread count. Profilers of the caller's thread do not see the workers' ops.
    """
    threads = torch.get_num_threads()
    grad = torch.is_grad_enabled()

    def one_thread(call):
        torch.set_num_threads(1)
        with torch.set_grad_enabled(grad):
            return call()

    key = (os.getpid(), threads)
    if key not in _WORKERS:
        _WORKERS[key] = ThreadPoolExecutor(threads, thread_name_prefix="geomuon-worker")
    futures = [_WORKERS[key].submit(one_thread, call) for call in calls]
    try:
        wait(futures)
        return [future.result() for future in futures]
    finally:
        torch.set_num_threads(threads)


_WORKERS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def eigh(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``torch.linalg.eigh`` of symmetric ``S`` ``[..., n, n]``: eigenvalues ``[..., n]``
    (ascending) and eigenvectors ``[..., n, n]``, in ``S.dtype``.

    On the CPU with $k > 1$ intra-op threads, the stack is split into up to $k$ parts
    decomposed by :func:`in_one_thread_workers`. LAPACK's eigensolver scales poorly across
    threads at transformer sizes while independent matrices scale almost linearly (a stack
    of 12 matrices $384\times384$, fp32, 2 threads: 58 ms in one call, 39 ms split; 80 ms
    on one thread), and every matrix's result is then bitwise its one-thread result: the
    same at every thread count and whatever its batch-mates (a lone matrix too goes to a
    worker, though LAPACK's threads would be faster for it). On one thread, on CUDA and
    inside ``torch.compile`` (whose graph holds the one op) it is one call.
    """
    if torch.compiler.is_compiling():
        return torch.linalg.eigh(S)
    threads = torch.get_num_threads()
    batch = S.shape[:-2].numel()
    if S.device.type != "cpu" or threads < 2 or batch == 0:
        return torch.linalg.eigh(S)
    parts = S.reshape(batch, *S.shape[-2:]).tensor_split(min(threads, batch))
    results = in_one_thread_workers([partial(torch.linalg.eigh, part) for part in parts])
    values = torch.cat([values for values, _ in results]).reshape(S.shape[:-1])
    return values, torch.cat([vectors for _, vectors in results]).reshape(S.shape)


def sym(X: torch.Tensor) -> torch.Tensor:
    r"""Symmetric part $\operatorname{sym}(X) = \tfrac12(X + X^\top)$ of square matrices."""
    return 0.5 * (X + X.mT)


class ScratchBuffers:
    r"""Memory one thread reuses across calls, one tensor per role, shape, dtype and device
    (:func:`msign`'s Newton–Schulz iterations on the CPU: the normalized input, the Gram $S$,
    the polynomial $bS + cS^2$ and two iterates written in turn; an optimizer's sanitized
    gradient).

    Without it every product lands in freshly allocated memory, which glibc maps and
    zero-fills page by page once earlier temporaries have been handed back to the system: a
    Muon step on the 6 x 384 GPT stack (AMD EPYC, one thread) took 17-26k page faults and
    1.16-1.20x torch.optim.Muon's time, under 1k with its temporaries reused. Nothing
    :func:`msign` returns aliases a buffer: each matrix's last step is written fresh. A caller
    keeps one per thread (an optimizer, one per worker thread) and holds its memory, about
    four matrices' worth per shape, for as long as it keeps it.
    """

    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}

    def __call__(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer for ``role`` of ``shape``, ``dtype`` and ``device`` (a ``torch.device``);
        its content is undefined."""
        key = (role, tuple(shape), dtype, device)
        if key not in self._tensors:
            self._tensors[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._tensors[key]


def newton_schulz_step(Y: torch.Tensor, a: float, b: float, c: float, *, tall: bool = False,
                       buffers: ScratchBuffers | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    r"""One quintic Newton–Schulz step on ``[B, m, n]`` or ``[m, n]`` matrices,
    $Y \leftarrow aY + b\,YY^\top Y + c\,YY^\top YY^\top Y$, with the Gram matrix on the short side:

    $$\text{wide } (m \le n):\ S = YY^\top,\ Y \leftarrow aY + (bS + cS^2)Y;\qquad
      \text{tall } (\texttt{tall=True}):\ S = Y^\top Y,\ Y \leftarrow aY + Y(bS + cS^2).$$

    Both are the same polynomial of $Y$ ($Y(Y^\top Y)^k = (YY^\top)^kY$); iterating a tall
    matrix in its own orientation needs no transposed operand and leaves the result
    contiguous (on one AMX Xeon thread a bf16 $1536\times384$ polar factor, 5 steps: 6.39 ms,
    against 7.00 ms through the transposed wide form, whose products copy their strided
    operands).
    ``tall`` is the caller's choice, not read off the shape: the symbolic certificates
    (:mod:`geomuon.theory.symbolic`) run this very function on matrices of symbolic size.

    Fused products, one kernel each ($bS + cS^2$, then $aY + (\cdot)$): on wide matrices
    torch.optim.Muon's form, so a bf16 step of a wide or square matrix rounds exactly as
    torch's (a tall one sums in another order). A stack takes one batched kernel per product
    (:func:`msign` hands the CPU one matrix at a time: see there). Computed in ``Y.dtype``.

    ``buffers`` (a 2-D ``Y``) holds $S$ and the polynomial; ``out`` receives the new iterate.
    The same kernels either way, so the same bits.
    """
    # a 2-D matrix takes addmm; a stack (and the symbolic stand-ins) baddbmm
    fma = torch.addmm if isinstance(Y, torch.Tensor) and Y.dim() == 2 else torch.baddbmm
    left, right = (Y.mT, Y) if tall else (Y, Y.mT)
    if buffers is None:
        S = left @ right
        polynomial = fma(S, S, S, beta=b, alpha=c)
    else:
        side = Y.size(-1) if tall else Y.size(-2)
        S = torch.mm(left, right, out=buffers("gram", (side, side), Y.dtype, Y.device))
        polynomial = torch.addmm(S, S, S, beta=b, alpha=c, out=buffers("polynomial", (side, side), Y.dtype, Y.device))
    factors = (Y, polynomial) if tall else (polynomial, Y)
    return fma(Y, *factors, beta=a) if out is None else fma(Y, *factors, beta=a, out=out)


def polar_express_steps(Y: torch.Tensor, steps: int, *, tall: bool = False) -> torch.Tensor:
    r"""The first ``steps`` steps of :data:`POLAR_EXPRESS` (:func:`newton_schulz_step`, its
    ``tall`` form or the wide one) on ``Y`` that the caller has normalized ($\|Y\|_2 \le 1$,
    e.g. by :attr:`NSSchedule.input_scale` times a spectral bound), in ``Y.dtype``: the sign of a
    symmetric matrix or the polar factor of a Gram-space one, where :func:`msign`'s Frobenius
    normalization would resolve up to $\sqrt n$ times less."""
    for a, b, c in POLAR_EXPRESS.step_coefficients(steps):
        Y = newton_schulz_step(Y, a, b, c, tall=tall)
    return Y


def msign(
    X: torch.Tensor,
    method: str = "polar_express",
    steps: int | None = None,
    *,
    coefficients: NSSchedule | None = None,
    compute_dtype: torch.dtype | None = None,
    eps: float | None = None,
    buffers: ScratchBuffers | None = None,
) -> torch.Tensor:
    r"""Matrix sign (polar factor) $\operatorname{msign}(X) = UV^\top$ for $X = U\Sigma V^\top$.

    Zero singular values map to zero, so ``msign(0) == 0`` (never NaN).

    Methods:

    * ``"polar_express"`` (default, accurate): per-step optimal quintics, 12 steps.
    * ``"polar_express_5"``: the 5-step table of modded-nanogpt / Dion.
    * ``"newton_schulz"``: Keller Jordan's quintic $(3.4445, -4.7750, 2.0315)$, 5 steps;
      normalized singular values in $[10^{-3}, 1]$ land in about $[0.47, 1.20]$ — cheap, not exact.
    * ``"svd"``: reference, exact up to round-off; singular values below
      $\max(m, n)\,\varepsilon_{\text{dtype}}\,\sigma_{\max}$ are treated as zero.

    The iterative methods normalize by ``input_scale`` $\cdot\max(\|X\|_F, \text{eps})$ and
    iterate with the Gram matrix on the short side ($\min(m,n)\times\min(m,n)$), each matrix
    in its own orientation (:func:`newton_schulz_step`).

    Args:
        X: ``[..., m, n]`` floating tensor.
        method: one of :data:`MSIGN_METHODS`; ignored when ``coefficients`` is given.
        steps: iteration count (default: the schedule's own).
        coefficients: a custom :class:`NSSchedule`.
        compute_dtype: dtype of the matmuls (default: ``X.dtype``). One of narrower range
            than ``X``'s (:func:`narrower_range`: fp16 for fp32 input, anything but fp64 for
            fp64 input) receives ``X`` normalized in ``X``'s dtype, so neither a large nor a
            small matrix leaves its range on the way in. Within one dtype the Frobenius norm
            squares the entries: in fp32 and bf16 a matrix of norm above about $10^{19}$ comes
            out as 0 (an optimizer counts such a gradient as non-finite and skips it).
        eps: floor of the Frobenius norm in the normalization; default
            $\sqrt{\text{tiny}}$ of the norm's dtype (the compute dtype's; fp32 for fp16,
            whose range ends at 65504; ``X``'s own where ``X`` is narrowed, e.g.
            $1.5\cdot10^{-154}$ for fp64 input), so only an (almost) exact zero is floored and
            ``msign`` is scale-invariant down to $10^{-19}$ in fp32 and fp16 (an absolute
            floor such as Muon's $10^{-7}$ would distort small matrices).
        buffers: the calling thread's :class:`ScratchBuffers`, for the iterations on
            the CPU (ignored elsewhere: an accelerator's caching allocator reuses memory).

    Returns:
        ``[..., m, n]`` tensor of ``X.dtype``.
    """
    check_matrix(X, "msign")
    check_compute_dtype("msign", "compute_dtype", compute_dtype)
    if steps is not None:
        check_count("msign", "steps", steps)
    if eps is not None:
        check_real("msign", "eps", eps, lambda x: x >= 0, "a finite number >= 0 (or None)")
    out_dtype = X.dtype
    narrowing = compute_dtype is not None and narrower_range(compute_dtype, X.dtype)
    work = X.to(compute_dtype) if compute_dtype is not None and not narrowing else X
    if coefficients is None and method == "svd":
        # torch has no half-precision SVD; the reference runs in at least float32.
        if work.dtype in (torch.float16, torch.bfloat16):
            work = work.float()
        return _msign_svd(work).to(out_dtype)
    schedule = coefficients or _SCHEDULES.get(method)
    if schedule is None:
        raise ValueError(f"msign: unknown method {method!r}; choose one of {MSIGN_METHODS}")
    n_steps = schedule.default_steps if steps is None else steps

    shape = work.shape
    if isinstance(work, torch.Tensor) and work.numel() == 0:  # empty: reshape(-1, ...) is ambiguous
        return work.to(out_dtype, copy=True)
    tall = shape[-2] > shape[-1]
    Y = work.reshape(-1, *shape[-2:])
    # fp16's norm in fp32: its range ends at 65504, and a larger (realistic) gradient norm had
    # overflowed and normalized the matrix to zero; the floor is the norm dtype's
    norm_dtype = torch.float32 if Y.dtype == torch.float16 else Y.dtype
    # (an eps of 0 still keeps 0/0 out: msign(0) = 0)
    floor = torch.finfo(norm_dtype).tiny ** 0.5 if eps is None else max(eps, torch.finfo(norm_dtype).tiny)
    on_cpu = isinstance(Y, torch.Tensor) and Y.device.type == "cpu" and Y.size(0) > 0
    buffers = buffers if on_cpu and n_steps and not Y.requires_grad else None
    norm = Y.norm(dim=(-2, -1), keepdim=True) if norm_dtype == Y.dtype else \
        torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    scale = norm.clamp_min(floor) * schedule.input_scale
    iterate_dtype = compute_dtype if narrowing else Y.dtype
    if buffers is not None:
        Y = torch.div(Y, scale, out=buffers("input", Y.shape, iterate_dtype, Y.device))
    else:
        Y = (Y / scale).to(iterate_dtype)
    coefficients = schedule.step_coefficients(n_steps)

    def iterate(Y):
        for k, (a, b, c) in enumerate(coefficients):
            if buffers is None:  # (the symbolic certificates substitute a step of this signature)
                Y = newton_schulz_step(Y, a, b, c, tall=tall)
            else:  # every last step written fresh: the result never aliases a buffer
                out = None if k == len(coefficients) - 1 else buffers(f"iterate{k % 2}", Y.shape, Y.dtype, Y.device)
                Y = newton_schulz_step(Y, a, b, c, tall=tall, buffers=buffers, out=out)
        return Y

    if not on_cpu:
        Y = iterate(Y)  # one batched kernel per product (and an empty stack stays one)
    elif Y.size(0) == 1:
        Y = iterate(Y[0])  # (reshaped back to the batch below: no copy)
    else:
        # One matrix at a time on the CPU, then one stacking copy: batched bf16 baddbmm is
        # slower there than a loop of addmm (a profiled Muon step, 6 x 384 GPT stack, AMD
        # EPYC with bf16 4.4x fp32: 147 ms of baddbmm against torch.optim.Muon's 127 ms of
        # addmm; a batch of one's Gram Y Y^T through bmm is ~35% slower than mm at 768x3072
        # on an Intel Xeon).
        Y = torch.stack([iterate(y) for y in Y])
    return Y.reshape(shape).to(out_dtype)


def _msign_svd(X: torch.Tensor) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    tol = max(X.shape[-2:]) * torch.finfo(X.dtype).eps * S[..., :1]
    keep = (S > tol).to(X.dtype)
    return (U * keep.unsqueeze(-2)) @ Vh


def inv_sqrt_psd(
    A: torch.Tensor, steps: int = 25, *, eps: float | None = None
) -> torch.Tensor:
    r"""Inverse square root $(A + \epsilon I)^{-1/2}$ of symmetric PSD matrices by coupled
    Newton–Schulz.

    With $A \leftarrow \operatorname{sym}(A) + \epsilon I$, $Y_0 = A/\|A\|_F$, $Z_0 = I$:

    $$T = \tfrac12(3I - Z_kY_k),\quad Y_{k+1} = Y_kT,\quad Z_{k+1} = TZ_k,$$

    $Y_k \to (A/\|A\|_F)^{1/2}$ and $Z_k \to (A/\|A\|_F)^{-1/2}$, so the result is
    $Z/\sqrt{\|A\|_F}$. Convergence is quadratic once the eigenvalues of $Y_0$ are near 1 and
    linear (factor 1.5 per step) for tiny ones, so 25 steps cover eigenvalue ratios down to
    about $10^{-8}$. (The one-sided polar maps take Polar Express on $D$ itself: through
    the Gram matrix the condition number squares.)

    Args:
        A: ``[..., k, k]`` symmetric positive semi-definite.
        steps: Newton–Schulz iterations.
        eps: diagonal shift $\epsilon$ (a float, or a tensor broadcasting to ``[..., 1, 1]``);
            default $k\,\varepsilon_{\text{compute}}\|A\|_F$, enough to make a rank-deficient
            $A$ invertible without visibly biasing it.

    Returns:
        ``[..., k, k]`` in ``A.dtype``; computed in float32, or float64 for float64 input.
    """
    check_matrix(A, "inv_sqrt_psd")
    if A.size(-1) != A.size(-2):
        raise ValueError(f"inv_sqrt_psd: expected square matrices, got {tuple(A.shape)}")
    check_count("inv_sqrt_psd", "steps", steps)
    if eps is not None and not isinstance(eps, torch.Tensor):
        check_real("inv_sqrt_psd", "eps", eps, lambda x: x >= 0, "a finite number >= 0 (or None)")
    out_dtype = A.dtype
    compute = fp32_or_fp64(A.dtype)
    A = sym(A.to(compute))
    k = A.size(-1)
    eye = torch.eye(k, dtype=compute, device=A.device)
    tiny = torch.finfo(compute).tiny
    # by the largest entry first: the Frobenius norms below square the entries, and in fp32 an
    # A of order 1e-25 had a zero norm (a NaN result), one of order 1e19 an infinite one
    magnitude = largest_entry(A)
    A = A / magnitude
    fro = A.norm(dim=(-2, -1), keepdim=True)
    shift = k * torch.finfo(compute).eps * fro if eps is None else eps / magnitude
    A = A + shift * eye
    scale = A.norm(dim=(-2, -1), keepdim=True).clamp_min(tiny)
    Y = A / scale
    Z = eye.expand_as(A).clone()
    for _ in range(steps):
        Y, Z = coupled_newton_schulz_step(Y, Z, eye)
    return (Z / (scale.sqrt() * magnitude.sqrt())).to(out_dtype)


def largest_entry(X: torch.Tensor, dim: int | tuple[int, ...] = (-2, -1)):
    """The largest absolute entry of each matrix (``[..., 1, 1]``; of each slice along ``dim``
    with another ``dim``), at least the dtype's ``tiny``, to divide by before a norm squares the
    entries (no overflow or underflow there); ``1`` for the exact matrices of the symbolic
    certificates, where the division is an identity."""
    if not isinstance(X, torch.Tensor):
        return 1
    return X.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny)


def power_of_two_at_most(largest: torch.Tensor) -> torch.Tensor:
    r"""$2^e$ with $2^e \le$ ``largest`` $< 2^{e+1}$, elementwise, for positive normal ``largest``
    (what :func:`largest_entry` returns): the scale the regulators (and the row maps) divide by before
    any product squares its entries. Dividing and multiplying by a power of two is exact, so
    the scaled computation is the unscaled one bit for bit wherever the latter neither over-
    nor underflows, and stays finite beyond (entries of the scaled weight lie in $(-2, 2)$).
    ``largest`` $= m\,2^{e+1}$ with $m \in [\tfrac12, 1)$ (``frexp``), so the quotient by $2m$
    is exactly $2^e$ (a correctly rounded division of a representable result)."""
    mantissa, _ = torch.frexp(largest)
    return largest / (2 * mantissa)


def unit_scale(X: torch.Tensor) -> torch.Tensor:
    r"""Per matrix (``[..., 1, 1]``, ``X.dtype``): the power of two $s$ with $1 \le \max_{ij}|X_{ij}/s| < 2$
    (for a largest entry below the dtype's ``tiny``, $s$ = ``tiny`` and the quotient stays below 1),
    and $s = 1$ for a zero or non-finite matrix (nothing to scale; a non-finite one is refused or
    propagated by the caller, not hidden by the scale).

    A solver that is homogeneous in its input (the steepest direction of $G$ is that of $G/s$, its
    multiplier and dual value scale with $s$) runs on $X/s$, whose Gram matrices and Frobenius norms
    neither overflow nor underflow in fp32 for any finite $X$ (an fp32 momentum of entries $10^{21}$
    had squared to infinity and taken no step, one of $10^{-20}$ had squared to zero). Division by $s$
    is exact (short of subnormal quotients, below $2^{-126}$ of the largest entry), so equivariance and
    bitwise reproducibility survive it. Computed on the device; no value is read back."""
    largest = X.abs().amax(dim=(-2, -1), keepdim=True)
    scalable = (largest > 0) & torch.isfinite(largest)
    scale = power_of_two_at_most(torch.where(scalable, largest, 1).clamp_min(torch.finfo(X.dtype).tiny))
    return torch.where(scalable, scale, 1)


def per_matrix(values: torch.Tensor, like: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-matrix ``values`` (shape ``like.shape[:batch]``) reshaped to broadcast against ``like
    [*batch_shape, *item]`` (a matrix stack, a multiplier, a correction)."""
    return values.reshape(tuple(values.shape) + (1,) * (like.dim() - batch))


def coupled_newton_schulz_step(Y: torch.Tensor, Z: torch.Tensor, eye: torch.Tensor):
    r"""One coupled Newton–Schulz step of :func:`inv_sqrt_psd`:
    $T = \tfrac12(3I - ZY)$, $(Y, Z) \leftarrow (YT, TZ)$, in the inputs' dtype (the
    symbolic certificates run this very function on non-commuting matrix symbols)."""
    T = 0.5 * (3.0 * eye - Z @ Y)
    return Y @ T, T @ Z


@lru_cache(maxsize=64)
def fixed_start(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fixed pseudo-random start of ``shape`` for power and subspace iterations (never write
    to it: it is cached). Deterministic across runs, and (unlike a constant vector) not
    orthogonal to the top singular vectors of structured matrices such as centered routers.
    Drawn in float64 on the CPU once and cached per ``(shape, dtype, device)``: a host-to-device
    copy waits for the device, so a step that drew it every time would synchronize."""
    gen = torch.Generator(device="cpu").manual_seed(0x5EED)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def _default_start(X: torch.Tensor) -> torch.Tensor:
    return fixed_start((X.size(-1),), X.dtype, X.device).expand(*X.shape[:-2], X.size(-1)).clone()


def power_iteration(
    X: torch.Tensor, steps: int = 16, v0: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Largest singular value by power iteration on $X^\top X$.

    $v \leftarrow X^\top X v / \|X^\top X v\|$, then $\sigma = \|Xv\|$, a lower bound on
    $\sigma_{\max}$ that is exact when $v$ is the top right singular vector. Pass the
    returned ``v`` as ``v0`` next time to warm-start (a few steps then suffice for a
    slowly moving weight).

    Args:
        X: ``[..., m, n]``.
        steps: iterations.
        v0: ``[..., n]`` start vector (default: fixed pseudo-random).

    Returns:
        ``(sigma [...], v [..., n])`` in ``X.dtype``; computed in ``X.dtype``.
    """
    check_matrix(X, "power_iteration")
    check_count("power_iteration", "steps", steps)
    if v0 is not None and tuple(v0.shape[-1:]) != tuple(X.shape[-1:]):
        raise ValueError(f"power_iteration: v0 of shape {tuple(v0.shape)} must be [..., {X.size(-1)}] (a vector per "
                         f"matrix of X {tuple(X.shape)})")
    v = _unit(_default_start(X) if v0 is None else v0.to(X.dtype))
    for _ in range(steps):
        # X v normalized before X^T: X^T X v is of order sigma^2, whose norm overflowed in fp32
        # from sigma ~ 4e9 (sigma = 0, v = 0, then NaN)
        v = _unit((X.mT @ _unit((X @ v.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).squeeze(-1))
    return _scaled_norm((X @ v.unsqueeze(-1)).squeeze(-1)).squeeze(-1), v


def _scaled_norm(x: torch.Tensor) -> torch.Tensor:
    """``||x||`` along the last dimension (keepdim), by the largest entry first: the norm squares
    the entries, which must neither overflow nor underflow."""
    largest = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return (x / largest).norm(dim=-1, keepdim=True) * largest


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x / ||x||`` along the last dimension (:func:`_scaled_norm`); a zero vector stays zero."""
    return x / _scaled_norm(x).clamp_min(torch.finfo(x.dtype).tiny)


def spectral_norm(X: torch.Tensor) -> torch.Tensor:
    r"""Exact $\sigma_{\max}(X)$ of each matrix (SVD-based reference), ``[...]`` in ``X.dtype``;
    computed in float32 (float64 for float64 input: torch has no half-precision SVD)."""
    check_matrix(X, "spectral_norm")
    return torch.linalg.matrix_norm(X.to(fp32_or_fp64(X.dtype)), ord=2).to(X.dtype)


def nuclear_norm(X: torch.Tensor, method: str = "polar_express") -> torch.Tensor:
    r"""Nuclear norm $\|X\|_* = \sum_i \sigma_i = \langle X, \operatorname{msign}(X)\rangle$.

    This is the dual of the spectral norm, so it is the *dual value* of the steepest-descent
    certificate. ``method`` is passed to :func:`msign` (``"svd"`` for the exact value).

    Returns:
        ``[...]`` in ``X.dtype``.
    """
    check_matrix(X, "nuclear_norm")
    return (X * msign(X, method=method)).sum(dim=(-2, -1))
