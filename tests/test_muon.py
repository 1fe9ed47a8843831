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


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_momentum_is_torch_lerp_with_a_float_weight(nesterov):
    # The momentum B <- lerp(B, G, 1 - mu) of a bf16 parameter, bitwise torch.optim.Muon's
    # buf.lerp_(grad, 1 - mu): a tensor weight is rounded to bf16 (0.05 -> 0.05005; the
    # sharded path's float weight is not), which had moved 17 of 40 entries in 20 steps. A
    # skipped (non-finite) step leaves the buffer bitwise. Control: the tensor weight differs.
    # With nesterov=False the buffer itself is the map's input, and it stays the formula's:
    # torch.optim.Muon 2.13 divides a bf16 buffer by its norm in place there (its .bfloat16() is
    # no copy), the departure the module docstring names; control: that buffer differs.
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 8, generator=gen).bfloat16())
    opt = Muon([p], lr=0.02, momentum=0.95, nesterov=nesterov)
    reference = torch.zeros(5, 8, dtype=torch.bfloat16)
    rounded, normalized = reference.clone(), reference.clone()
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
                normalized.lerp_(g, 1 - 0.95)
                normalized.div_(normalized.norm().clamp(min=1e-7))
    assert torch.equal(opt.state[p]["momentum_buffer"], reference)
    assert not torch.equal(rounded, reference) and not torch.equal(normalized, reference)


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


# wide and square matrices, a same-shape pair among them: there msign's products are torch's
# (newton_schulz_step: a tall matrix iterates in its own orientation and sums in another order)
WIDE_AND_SQUARE = [(32, 64), (48, 48), (32, 64), (16, 96)]
# each documented option at a value of its own, with another value of it: the control
OPTION_AND_CONTROL = {
    "nesterov": ({"nesterov": False}, {"nesterov": True}),
    "momentum": ({"momentum": 0.8}, {"momentum": 0.95}),
    "momentum 0": ({"momentum": 0.0}, {"momentum": 0.95}),
    "weight_decay": ({"weight_decay": 0.5}, {"weight_decay": 0.1}),
    "ns_steps": ({"ns_steps": 3}, {"ns_steps": 5}),
    "ns_coefficients": ({"ns_coefficients": (2.0, -1.5, 0.5)}, {"ns_coefficients": (3.4445, -4.775, 2.0315)}),
    "eps": ({"eps": 1e3}, {"eps": 1e-7}),  # above every momentum's norm here: the floor divides
    "adjust_lr_fn original": ({"adjust_lr_fn": "original"}, {"adjust_lr_fn": "match_rms_adamw"}),
    "adjust_lr_fn match_rms_adamw": ({"adjust_lr_fn": "match_rms_adamw"}, {"adjust_lr_fn": None}),
    "tensor lr": ({"lr": torch.tensor(0.03)}, {"lr": 0.02}),
}


def _displacements(cls, dtype, steps=3, **kwargs):
    """``W_T - W_0`` (float64) of ``steps`` least-squares steps on :data:`WIDE_AND_SQUARE`."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in WIDE_AND_SQUARE]
    start = [p.detach().double() for p in params]
    targets = [torch.randn(s, generator=gen).to(dtype) for s in WIDE_AND_SQUARE]
    opt = cls(params, **{"lr": 0.02, **kwargs})
    for _ in range(steps):
        opt.zero_grad()
        sum(((p - t) ** 2).sum() for p, t in zip(params, targets)).backward()
        opt.step()
    return [p.detach().double() - w for p, w in zip(params, start)]


# bf16 weights with nesterov=False are the departure the docstring names: torch.optim.Muon
# normalizes its bf16 momentum in place there (test_bf16_momentum_is_torch_lerp_with_a_float_weight
# checks that ours is the formula's)
@pytest.mark.parametrize("name, dtype", [(name, dtype) for dtype in (torch.float32, torch.bfloat16)
                                         for name in OPTION_AND_CONTROL
                                         if not (dtype == torch.bfloat16 and name == "nesterov")])
def test_each_documented_option_steps_bitwise_as_torch_muon_and_changes_the_step(name, dtype):
    """The drop-in claim, option by option, for float32 and bf16 weights: the same arguments give
    torch.optim.Muon's steps bit for bit (the momentum lerp, the bf16 quintic with torch's
    products, the shape factor and the decoupled decay, each in torch's dtype). Control: another
    value of the option moves the weights elsewhere (the option is read, not defaulted)."""
    option, control = OPTION_AND_CONTROL[name]
    ours = _displacements(Muon, dtype, **option)
    assert all(torch.equal(a, b) for a, b in zip(ours, _displacements(torch.optim.Muon, dtype, **option)))
    assert any(not torch.equal(a, b) for a, b in zip(ours, _displacements(Muon, dtype, **control)))


@pytest.mark.parametrize("option, value, match", [
    ("lr", "0.1", r"group 0: lr must be a finite number >= 0, got '0\.1'"),
    ("lr", None, r"group 0: lr must be a finite number >= 0, got None"),
    ("lr", float("nan"), r"group 0: lr must be a finite number >= 0, got nan"),
    ("momentum", "0.9", r"group 0: momentum must be a number in \[0, 1\), got '0\.9'"),
    ("weight_decay", None, r"group 0: weight_decay must be a finite number >= 0, got None"),
])
def test_an_option_that_is_no_number_is_refused_by_name(option, value, match):
    # lr="0.1" had raised TypeError from torch.optim.Muon's comparison 0.0 <= lr ("'<=' not
    # supported between instances of 'float' and 'str'", naming no option), and lr=nan had been
    # "should be >= 0"; torch's own messages stay for a negative number (control, compared with
    # the message torch.optim.Muon raises)
    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match=match):
        Muon([p], **{option: value})
    for negative in ("lr", "momentum", "weight_decay"):
        messages = []
        for cls in (torch.optim.Muon, Muon):
            with pytest.raises(ValueError) as caught:
                cls([p], **{negative: -0.5})
            messages.append(str(caught.value))
        assert messages[0] == messages[1] and "-0.5" in messages[1]


def test_a_muon_with_aux_adam_group_is_refused_and_its_translation_steps():
    # KellerJordan/Muon's MuonWithAuxAdam marks its groups use_muon=True/False; here the key was kept
    # and never read, so its use_muon=False group of 2-D weights (embedding, head) took Muon steps at
    # the lr meant for Adam. Refused at construction, in add_param_group and on load, naming the key
    # and the translation; control: the translated groups build and their head takes an AdamW step.
    gen = torch.Generator().manual_seed(6)
    head, hidden = (torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((10, 4), (4, 4)))
    adam = dict(params=[head], lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    match = r"group 0: use_muon=False is a key of KellerJordan/Muon's MuonWithAuxAdam.*update='adamw'"
    with pytest.raises(ValueError, match=match):
        Muon([{**adam, "use_muon": False}, dict(params=[hidden], lr=0.02, use_muon=True)])
    opt = Muon([{**adam, "update": "adamw"}, dict(params=[hidden], lr=0.02)])
    with pytest.raises(ValueError, match=r"group 2: use_muon=True"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(3, 3))], use_muon=True))
    saved = opt.state_dict()
    saved["param_groups"][1]["use_muon"] = True
    with pytest.raises(ValueError, match=r"load_state_dict: the saved group 1: use_muon=True"):
        opt.load_state_dict(saved)
    assert len(opt.param_groups) == 2 and "use_muon" not in opt.param_groups[1]
    twin = torch.nn.Parameter(head.detach().clone())
    reference = torch.optim.AdamW([twin], lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    head.grad, hidden.grad = torch.randn(10, 4, generator=gen), torch.randn(4, 4, generator=gen)
    twin.grad = head.grad.clone()
    opt.step()
    reference.step()
    # AdamW's first step moves each entry by lr * sign(g) up to eps / |g|: the same ops on the
    # same inputs, except the bias corrections (expm1 on the device against torch's host float64),
    # 1 ulp of the fp32 step: 4 eps of the weight's entries bounds it
    torch.testing.assert_close(head.detach(), twin.detach(), rtol=0,
                               atol=4 * torch.finfo(torch.float32).eps * head.detach().abs().max().item())
    assert "exp_avg" in opt.state[head] and "momentum_buffer" not in opt.state[head]


@pytest.mark.parametrize("dtype, entry, momentum", [(torch.float32, 3.4e38, 0.0), (torch.float32, 3.4e38, 5e-4),
                                                    (torch.float64, 1e300, 0.95)])
def test_a_skipped_matrix_whose_momentum_leaves_bf16s_range_keeps_its_weights(dtype, entry, momentum):
    # A finite gradient entry whose square overflows (3.4e38 in fp32, 1e300 in fp64) overflows the
    # Frobenius norm, so the step is skipped (its momentum must enter the map as exactly 0). Its
    # Nesterov momentum (1 - mu) G + mu B then lies above bf16's largest finite number (3.39e38):
    # in fp32 with momentum < 0.002, in fp64 at the default 0.95. Rounded into the bf16 stack
    # before the skip's 0 mask, it had become inf and 0 * inf = NaN, which the update then wrote
    # into the weights it was to leave alone.
    # Control: that momentum, formed in the weights' dtype as the step forms it, is inf once in bf16.
    p = torch.nn.Parameter(torch.eye(4, 3, dtype=dtype))
    p.grad = torch.zeros(4, 3, dtype=dtype)
    p.grad[0, 0] = entry
    assert torch.isfinite(p.grad).all()
    opt = Muon([{"params": [("w", p)]}], lr=0.02, momentum=momentum)  # Nesterov, bf16 Newton-Schulz: the defaults
    opt.step()
    with pytest.warns(RuntimeWarning, match="overflows.*'w'"):
        assert opt.check_finite() == {"'w'": 1}
    assert torch.equal(p.detach(), torch.eye(4, 3, dtype=dtype))
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(4, 3, dtype=dtype))
    assert torch.isinf(torch.tensor(entry, dtype=dtype).lerp(torch.tensor(0.0, dtype=dtype), momentum).bfloat16())
