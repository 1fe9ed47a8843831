"""Our Muon against the real ``torch.optim.Muon``: numerics, arguments, refusals, batching."""

import pytest
import torch
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum,
    optim_error_inputs_func_muon,
    optim_inputs_func_muon,
)

import geomuon.optimizers.muon as muon_module
from geomuon.optimizers import Muon

SHAPES = [(64, 32), (32, 64), (48, 48), (64, 32), (96, 16)]


def _train(cls, steps=50, seed=0, **kwargs):
    """``steps`` of a least-squares fit; same data for every optimizer."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in SHAPES]
    targets = [torch.randn(s, generator=gen) for s in SHAPES]
    opt = cls(params, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        sum(((p - t) ** 2).sum() for p, t in zip(params, targets)).backward()
        opt.step()
    return [p.detach() for p in params]


def _max_relative_difference(xs, ys):
    return max(((x - y).norm() / x.norm()).item() for x, y in zip(xs, ys))


def test_matches_torch_muon_in_the_same_dtype():
    reference = _train(torch.optim.Muon, lr=0.02)
    ours = _train(Muon, lr=0.02)
    # Both run Newton-Schulz in bf16 on the same inputs; our batched baddbmm may sum in
    # another order than torch's per-matrix addmm, which can flip a bf16 rounding
    # (2^-8 relative) in one entry of one update; over 50 steps of lr 0.02 that moves a
    # weight of norm ~10 by far less than 1e-3 relative. (Measured: bit-identical.)
    assert _max_relative_difference(reference, ours) <= 1e-3


def test_matches_torch_muon_within_bf16_roundoff_when_we_compute_in_fp32():
    reference = _train(torch.optim.Muon, lr=0.02)
    ours = _train(Muon, lr=0.02, compute_dtype=torch.float32)
    # torch's bf16 Newton-Schulz differs from an fp32 one by bf16 round-off (~4e-3 per
    # update entry, random in sign); accumulated over 50 steps this stays below 1e-2.
    difference = _max_relative_difference(reference, ours)
    assert difference <= 1e-2
    assert difference > 0  # the two dtypes really differ (the check is not vacuous)


def test_bf16_momentum_is_torch_lerp_with_a_float_weight():
    # The momentum B <- lerp(B, G, 1 - mu) of a bf16 parameter, bitwise torch.optim.Muon's
    # buf.lerp_(grad, 1 - mu): a tensor weight is rounded to bf16 (0.05 -> 0.05005; the
    # sharded path's float weight is not), which had moved 17 of 40 entries in 20 steps. A
    # skipped (non-finite) step leaves the buffer bitwise. Control: the tensor weight differs.
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 8, generator=gen).bfloat16())
    opt = Muon([p], lr=0.02, momentum=0.95)
    reference = torch.zeros(5, 8, dtype=torch.bfloat16)
    rounded = reference.clone()
    with pytest.warns(RuntimeWarning, match="non-finite"):  # the skip, reported at the next step
        for step in range(20):
            g = torch.randn(5, 8, generator=gen).bfloat16()
            p.grad = g.clone()
            if step == 10:
                p.grad[0, 0] = float("nan")  # skipped: nothing moves
            opt.step()
            if step != 10:
                reference.lerp_(g, 1 - 0.95)
                rounded.lerp_(g, torch.tensor(1 - 0.95))
    assert torch.equal(opt.state[p]["momentum_buffer"], reference)
    assert not torch.equal(rounded, reference)


@pytest.mark.parametrize("optim_input", optim_inputs_func_muon("cpu"), ids=lambda o: o.desc)
def test_torch_conformance_inputs_agree(optim_input):
    kwargs = dict(optim_input.kwargs)
    reference = _train(torch.optim.Muon, steps=5, **kwargs)
    ours = _train(Muon, steps=5, **kwargs)
    # same dtype (bf16 NS) as above: bounded by a flipped bf16 rounding
    assert _max_relative_difference(reference, ours) <= 1e-3


@pytest.mark.parametrize("error_input", optim_error_inputs_func_muon("cpu", torch.float32),
                         ids=lambda e: e.optimizer_error_input.desc)
def test_torch_conformance_refusals(error_input):
    optim_input = error_input.optimizer_error_input
    params = optim_input.params
    if params is None:
        params = [torch.nn.Parameter(torch.randn(2, 3))]
    expect = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
    if error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
        opt = Muon(params, **optim_input.kwargs)
        with expect(error_input.error_type, match=error_input.error_regex):
            opt.step()
    else:
        with expect(error_input.error_type, match=error_input.error_regex):
            Muon(params, **optim_input.kwargs)


class WholeBatchMuon(Muon):
    """Muon stacking whole same-shape batches on the CPU too, as it does on an accelerator."""

    cpu_stack_size = None
    parallel_batches = False


def _counting_msign(monkeypatch):
    calls = []
    original = muon_module.msign

    def counting(X, *args, **kwargs):
        calls.append(tuple(X.shape))
        return original(X, *args, **kwargs)

    monkeypatch.setattr(muon_module, "msign", counting)
    return calls


def test_same_shape_matrices_share_one_newton_schulz_call(monkeypatch):
    calls = _counting_msign(monkeypatch)
    _train(WholeBatchMuon, steps=1, lr=0.02)
    # five matrices, four distinct shapes: (64, 32) twice in one stack
    assert sorted(calls) == sorted([(2, 64, 32), (1, 32, 64), (1, 48, 48), (1, 96, 16)])


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_steps_one_matrix_at_a_time_bitwise_as_whole_batches(threads, monkeypatch, torch_threads):
    """On the CPU Muon stacks one matrix at a time (``cpu_stack_size``), in one-thread workers
    at 2 threads (``parallel_batches``), and lands bit for bit where whole-batch stacking on
    one thread lands: msign's CPU kernel iterates one matrix at a time either way. Controls:
    the whole-batch run did stack, and the points moved."""
    import geomuon.optimizers.base as base

    workers = []
    real = base.in_one_thread_workers
    monkeypatch.setattr(base, "in_one_thread_workers", lambda calls: workers.append(len(calls)) or real(calls))
    calls = _counting_msign(monkeypatch)

    def train(optimizer, threads):
        with torch_threads(threads):
            return _train(optimizer, steps=3, lr=0.02)

    whole = train(WholeBatchMuon, 1)
    assert (2, 64, 32) in calls and workers == []
    calls.clear()
    ours = train(Muon, threads)
    assert set(calls) == {(1, *s) for s in SHAPES}
    assert workers == ([len(SHAPES)] * 3 if threads > 1 else [])
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(whole, ours))
    start = _train(Muon, steps=0)
    assert not any(torch.equal(a, w) for a, w in zip(ours, start))


def test_cpu_step_reuses_its_temporaries_and_copies_leave_them_behind(one_thread):
    """On the CPU a step's stacked momentum, sanitized gradient and Newton–Schulz iterates
    live in the thread's scratch buffers: a second step adds none and moves none (fresh
    memory each step costs page faults); they are not state: ``state_dict`` and a deep copy
    do not carry them; each thread has its own, freed with it. Off the CPU a temporary is
    fresh memory (control: two calls give two tensors there, one here)."""
    import copy

    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = Muon(params, lr=0.02)

    def step():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()

    def memory():
        return {key: t.data_ptr() for key, t in opt._scratch()._tensors.items()}

    step()  # on one thread (the fixture), so one set of buffers: workers each keep their own
    first = memory()
    step()
    roles = {key[0] for key in first}
    assert {"stack", "gradient", "gram", "polynomial", "input", "iterate0"} <= roles
    assert memory() == first
    assert "_scratch_local" not in vars(copy.deepcopy(opt))
    # another thread gets its own buffers, freed with it (control: this thread's stay)
    import gc
    import threading
    import weakref

    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(weakref.ref(opt._scratch())))
    worker.start()
    worker.join()
    gc.collect()
    assert theirs and theirs[0]() is None
    assert opt._scratch() is opt._scratch() and memory() == first
    assert all(isinstance(v, (torch.Tensor, int, float)) for state in opt.state_dict()["state"].values()
               for v in state.values())
    cpu = [opt._temporary("probe", (2, 3), torch.float32, torch.device("cpu")) for _ in range(2)]
    assert cpu[0] is cpu[1]
    meta = [opt._temporary("probe", (2, 3), torch.float32, torch.device("meta")) for _ in range(2)]
    assert meta[0] is not meta[1]


def test_batched_step_equals_one_matrix_at_a_time():
    batched = _train(WholeBatchMuon, steps=3, lr=0.02, compute_dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in SHAPES]
    targets = [torch.randn(s, generator=gen) for s in SHAPES]
    opts = [Muon([p], lr=0.02, compute_dtype=torch.float64) for p in params]
    for _ in range(3):
        for p, t, opt in zip(params, targets, opts):
            opt.zero_grad()
            ((p - t) ** 2).sum().backward()
            opt.step()
    # fp64 Newton-Schulz: batched and single calls agree to fp64 round-off
    assert _max_relative_difference(batched, [p.detach() for p in params]) < 1e-12


def test_adjust_lr_and_weight_decay_semantics():
    gen = torch.Generator().manual_seed(3)
    W0 = torch.randn(40, 10, generator=gen)
    G = torch.randn(40, 10, generator=gen)
    for adjust, scale in ((None, 2.0), ("original", 2.0), ("match_rms_adamw", 0.2 * 40**0.5)):
        p = torch.nn.Parameter(W0.clone())
        p.grad = G.clone()
        Muon([p], lr=0.1, weight_decay=0.5, momentum=0.0, nesterov=False, adjust_lr_fn=adjust,
             compute_dtype=torch.float64, ns_steps=5).step()
        X = G.double() / G.double().norm()
        for _ in range(5):
            a, b, c = muon_module.DEFAULT_NS_COEFFICIENTS
            S = X.T @ X
            X = a * X + X @ (b * S + c * S @ S)
        step = 0.1 * scale * X
        expected = W0.double() * (1 - 0.1 * 0.5) - step
        # float32 weights, float64 Newton-Schulz (its round-off, ~1e-15, is far below the float32
        # terms): the decay factor and its product round once each (u |W0| apiece), the update once
        # (u |lr s U|) and the sum once (u |W'|), u = 2^-24; measured 1.5 u max|W'|
        u = torch.finfo(torch.float32).eps / 2
        bound = u * (2 * W0.abs().max() + step.abs().max() + p.detach().abs().max()).item()
        assert (p.detach().double() - expected).abs().max().item() <= bound, adjust


def test_three_dimensional_parameters():
    stacked = torch.nn.Parameter(torch.randn(3, 16, 8))
    with pytest.raises(ValueError, match="only supports 2D parameters.*matrix_view"):
        Muon([stacked])
    # matrix_view="batch": a stack of experts is a batch of matrices
    stacked.grad = torch.randn(3, 16, 8)
    singles = [torch.nn.Parameter(stacked.detach()[i].clone()) for i in range(3)]
    for i, p in enumerate(singles):
        p.grad = stacked.grad[i].clone()
    Muon([{"params": [stacked], "matrix_view": "batch"}], lr=0.1, compute_dtype=torch.float64).step()
    Muon(singles, lr=0.1, compute_dtype=torch.float64).step()
    # bitwise: on the CPU each matrix of a batch goes through msign's kernel on its own, as a
    # single matrix does (cpu_stack_size = 1; see test_cpu_steps_one_matrix_at_a_time_bitwise_...)
    assert torch.equal(stacked.detach(), torch.stack([p.detach() for p in singles]))
    # matrix_view="flatten": a conv kernel [out, in, kh, kw] is one [out, in*kh*kw] matrix
    conv = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    conv.grad = torch.randn(8, 4, 3, 3)
    flat = torch.nn.Parameter(conv.detach().reshape(8, 36).clone())
    flat.grad = conv.grad.reshape(8, 36).clone()
    Muon([{"params": [conv], "matrix_view": "flatten"}], lr=0.1, compute_dtype=torch.float64).step()
    Muon([flat], lr=0.1, compute_dtype=torch.float64).step()
    assert torch.equal(conv.detach().reshape(8, 36), flat.detach())  # the same matrix, the same kernel


def test_lr_tensor_and_scheduler():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = Muon([p], lr=torch.tensor(0.05))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    p.grad = torch.randn(8, 4)
    opt.step()
    sched.step()  # lr -> 0: the next step changes nothing (weight decay is lr-coupled)
    before = p.detach().clone()
    p.grad = torch.randn(8, 4)
    opt.step()
    assert torch.equal(p.detach(), before)


def test_ns_steps_limit_and_bad_coefficients():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([p], ns_steps=100)
    with pytest.raises(ValueError, match="exactly 3"):
        Muon([p], ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="momentum"):
        Muon([p], momentum=-0.1)


def test_a_tensor_learning_rate_is_never_read_back(no_host_reads):
    # lr as a 1-element tensor (a schedule on the device) with weight decay: no host read in
    # step() (the old lr.item() fails the guard), and the step of the float lr up to the
    # rounding of -lr*s*U formed as a product instead of foreach_add's alpha (1 eps of
    # |lr s U| plus 1 of the sum: 4 eps of the largest entry)
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen) for s in [(16, 8), (8, 16), (8, 8)]]
    grads = [torch.randn(w.shape, generator=gen) for w in start]
    results = []
    for lr in (0.02, torch.tensor([0.02])):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = Muon(params, lr=lr, weight_decay=0.1)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with no_host_reads():
            opt.step()
        results.append([p.detach() for p in params])
    eps = torch.finfo(torch.float32).eps
    for p, q, w in zip(*results, start):
        assert torch.allclose(p, q, atol=4 * eps * p.abs().max().item(), rtol=0)
        assert not torch.equal(p, w)


@pytest.mark.parametrize("options, match", [
    ({"ns_steps": 2.7}, r"group 0: ns_steps must be a whole number >= 0, got 2\.7"),
    ({"ns_steps": "5"}, r"group 0: ns_steps must be a whole number >= 0, got '5'"),
    ({"ns_steps": True}, r"group 0: ns_steps must be a whole number >= 0, got True"),
    ({"ns_coefficients": (float("nan"), -4.775, 2.0315)}, r"group 0: ns_coefficients \(a\) must be a finite number"),
    ({"ns_coefficients": (3.4445, "b", 2.0315)}, r"group 0: ns_coefficients \(b\) must be a finite number"),
])
def test_newton_schulz_options_are_refused_by_name_before_any_step(options, match):
    # ns_steps=2.7 had run 2 steps ("5" five, True one); a NaN coefficient had written NaN into
    # the weights with no skip reported (the gradient was finite); a string one failed inside addmm
    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=match):
        Muon([p], lr=0.02, **options)
    # the same options edited into a built optimizer's group are refused at the step, before it moves
    opt = Muon([p], lr=0.02)
    opt.param_groups[0].update(options)
    p.grad = torch.randn(8, 4)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("empty_shape", [(4, 0), (0, 4)])
def test_a_group_with_an_empty_matrix_steps_the_others_as_without_it(empty_shape):
    # A (4, 0) weight (a layer of width 0) had raised ZeroDivisionError in the shape factor m/n
    # inside the step, after the other matrices of the group had moved. Now the group steps:
    # the other matrices land bitwise where a Muon without the empty one puts them (same
    # kernels on the same inputs), and the empty one keeps its shape and gets its momentum.
    gen = torch.Generator().manual_seed(4)
    start, grad = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    full, alone = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    empty = torch.nn.Parameter(torch.zeros(empty_shape))
    with_empty = Muon([full, empty], lr=0.02, regulate="soft_cap")
    without = Muon([alone], lr=0.02, regulate="soft_cap")
    full.grad, alone.grad, empty.grad = grad.clone(), grad.clone(), torch.zeros(empty_shape)
    with_empty.step()
    without.step()
    assert torch.equal(full.detach(), alone.detach()) and not torch.equal(full.detach(), start)
    assert empty.shape == empty_shape and with_empty.state[empty]["momentum_buffer"].shape == empty_shape
