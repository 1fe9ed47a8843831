"""The sharded (FSDP2 / DTensor) step refuses what it cannot take, on every rank and before
any collective, and never leaves a rank waiting; whole-matrix state (chained regulators' warm
starts), manifolds with constructor arguments and the polar maps' out-of-range guard step, save and
resume as one process does: 2 gloo processes, tiny matrices (float64 unless a case is about a dtype).

One spawn runs every case (``worker``) and saves, per rank, what each case returned or
raised; the tests read it. Run as a script (``python tests/test_distributed_checks.py OUT``)
it is the worker. The process group's timeout is short (``PG_TIMEOUT``), so a rank left in
a collective shows up as a timeout error in the results, not as a hung test.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import socket
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch

from geomuon.manifolds import LPRO, MatrixManifold, Stiefel
from geomuon.manifolds.capabilities import OrthonormalGram
from geomuon.optimizers import HybridPolarGradM, ManifoldMuon, Muon, RightPolarGradM, RowNormM
from test_packaging_manifold_spec import WeightedSphere  # a user's manifold with a tensor argument
from test_distributed import outputs_of  # kills the ranks past its timeout

PG_TIMEOUT = 30  # seconds; a case that waits for it has failed
SHAPE = (6, 4)  # 3 rows per rank


FP16_STEPS = 2
PROJECTED_STEPS = 3
#: (case, optimizer over the params, fp16 points, gradient of a point): each matrix alone in
#: its same-shape batch, so the sharded step runs the one-process kernels on the same operands.
#: "polar": RightPolarGradM's first update ||M||_*^3 msign(M) of M = 0.05 G, G = 56 I_16 (momentum
#: 0.95, no Nesterov) is (0.05 * 56 * 16)^3 I = 9.0e4 I, past fp16's 65504 (a float32 update,
#: finite once lr = 1e-5 scales it).
#: "muon": Muon's bf16 update added to fp16 weights, which had been rounded to fp16 first: the
#: add then ran in fp16, with lr rounded to fp16 too (1 ulp off the one-process weights). With
#: weight decay: the one-process (masked) decay had rounded its factor 1 - lr wd to fp16, the
#: sharded one had not.
#: "finite_norm": a finite gradient 6000 I_64 (norm 48000 < 65504) whose shards' squared norms
#: (32 * 6000^2 = 1.15e9 each) overflow fp16: the sharded check had combined them in fp16,
#: called the gradient non-finite and skipped the matrix (one process steps it).
FP16_CASES = (
    ("polar", lambda params: RightPolarGradM(params, lr=1e-5, alpha=3.0), [torch.zeros(16, 16, dtype=torch.float16)],
     lambda w: torch.eye(16, dtype=torch.float16) * 56),
    ("finite_norm", lambda params: Muon(params, lr=0.02), [torch.zeros(64, 64, dtype=torch.float16)],
     lambda w: torch.eye(64, dtype=torch.float16) * 6000),
    ("muon", lambda params: Muon(params, lr=0.02, weight_decay=0.1),
     [torch.randn(shape, generator=torch.Generator().manual_seed(3)).half() for shape in ((6, 4), (3, 4))],
     lambda w: torch.randn(w.shape, generator=torch.Generator().manual_seed(w.shape[0])).half()),
)


class _HalfStepGram(OrthonormalGram):
    dual_steps = 2.5  # a declared default ManifoldMuon refuses (it had run as 2 steps)


class HalfStepStiefel(Stiefel):
    """Stiefel whose Gram form declares a fractional ``dual_steps``."""

    name = "HalfStepStiefel"
    gram_form = _HalfStepGram()


#: (case: the options of rank r's Muon group); "same_tensor_lr" agrees (a tensor option is compared
#: by its bits on the device), the others differ in the option their case names
OPTION_CASES = {
    "same_tensor_lr": lambda rank: dict(lr=torch.tensor(0.02, dtype=torch.float64)),
    "lr": lambda rank: dict(lr=0.02 if rank == 0 else 0.05),
    "tensor_lr": lambda rank: dict(lr=torch.tensor(0.02 if rank == 0 else 0.05, dtype=torch.float64)),
    "compute_dtype": lambda rank: dict(compute_dtype=None if rank == 0 else torch.bfloat16),
}


#: (case, optimizer class, rank 0 appends the extra parameter before the first step rather than
#: after it), in the order they run
EXTRA_PARAMETER_CASES = (
    ("extra_parameter", Muon, False),
    # rank 0 alone then has a weight to check on its manifold (an appended one)
    ("extra_parameter:manifold_muon", ManifoldMuon, False),
    ("extra_parameter:manifold_muon_first_step", ManifoldMuon, True),
)


#: (case, shapes of the group's parameters, their param_names or None): rank 1 lists them reversed
REORDERED_CASES = (
    ("unnamed_same_shape", (SHAPE, SHAPE), None),
    ("named_same_shape", (SHAPE, SHAPE), ["a", "b"]),
    ("shapes", (SHAPE, (3, 4)), None),
)


def _column_weights() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)


#: steps before the distributed checkpoint, and after it (the resumed run's and the uninterrupted one's)
RESUME_STEPS = 2
#: the two matrices of a whole-matrix case: different shapes, so each is alone in its batch (the
#: owner runs the one-process kernels on the same operands: bit for bit) and each rank owns one
#: (the first of each batch is owned by rank position % 2: 0 and 1)
WHOLE_SHAPES = ((8, 4), (6, 4))
TINY = 1e-43  # a float32 subnormal: ||M||_* ~ 1e-42, whose power -1 (~1e42) is past float32's 3.4e38


def _whole_case_points(dtype: torch.dtype, manifold=None, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    points = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in WHOLE_SHAPES]
    return [(manifold.projx(w) if manifold is not None else w).to(dtype) for w in points]


def _whole_case_gradients(step: int, dtype: torch.dtype, tiny_second: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    gradients = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in WHOLE_SHAPES]
    if tiny_second:
        gradients[1] = gradients[1] * TINY
    return [x.to(dtype) for x in gradients]


#: (case, optimizer class, group options, weights' dtype, manifold the points start on, tiny second gradient).
#: "chain": two power-iteration regulators, each with its own warm start (regulate_v, regulate_v.1),
#: kept whole by the owner; bf16 weights keep them in fp32. "lpro", "user_manifold": manifolds with
#: constructor arguments (a float; a tensor). "*_tiny": the polar maps' zero update where
#: ||M||_*^alpha leaves float32 (alpha = -1 on a 1e-43 gradient had written inf weights).
WHOLE_CASES = (
    ("chain", Muon, dict(regulate=[{"name": "spectral_hammer", "block": 4}, "spectral_normalize"],
                         compute_dtype=None), torch.float64, None, False),
    ("chain_bf16", Muon, dict(regulate=[{"name": "spectral_hammer", "block": 4}, "spectral_normalize"]),
     torch.bfloat16, None, False),
    ("lpro", ManifoldMuon, dict(manifold=LPRO(radius=2.0), compute_dtype=None), torch.float64, LPRO(radius=2.0),
     False),
    ("user_manifold", ManifoldMuon, dict(manifold=WeightedSphere(1.5, _column_weights()), compute_dtype=None),
     torch.float64, WeightedSphere(1.5, _column_weights()), False),
    ("right_polar_tiny", RightPolarGradM, dict(alpha=-1.0, weight_decay=0.1), torch.float32, None, True),
    ("hybrid_tiny", HybridPolarGradM, dict(alpha=-1.0, weight_decay=0.1), torch.float32, None, True),
    ("row_norm_tiny", RowNormM, dict(weight_decay=0.1), torch.float32, None, True),
)


class CopiedChecksMuon(ManifoldMuon):
    """ManifoldMuon whose ``_pending_checks`` answers with a copy of ManifoldMuon's answer (an
    override may build its answer as it likes): the base had added the weights other ranks check to
    the set that hook returned, ManifoldMuon's own, so a copy had lost them."""

    def _pending_checks(self, group, params):
        return copy.copy(super()._pending_checks(group, params))


class UnpairedChecksMuon(Muon):
    """Muon that answers ``_pending_checks`` (so it checks weights) but defines no ``_add_checks``."""

    def _pending_checks(self, group, params):
        return [False] * len(params)


class ShortChecksMuon(Muon):
    """Muon whose ``_pending_checks`` answers one flag fewer than the parameters it was given (its
    ``_add_checks`` defined, checking nothing: only the length is out of contract)."""

    def _pending_checks(self, group, params):
        return [False] * (len(params) - 1)

    def _add_checks(self, group, params):
        pass


def _stiefel_muon(params, opt_class=ManifoldMuon) -> ManifoldMuon:
    """ManifoldMuon (or ``opt_class``) on Stiefel over the two matrices ``a``, ``b``, its dual
    iterations in the points' dtype (``compute_dtype=None``: no bf16 rounding between the compared steps)."""
    return opt_class([dict(params=params, param_names=["a", "b"])], lr=0.02, manifold="stiefel",
                     compute_dtype=None)


def _points(count: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.linalg.qr(torch.randn(SHAPE, generator=g, dtype=torch.float64))[0] for _ in range(count)]


def _gradients(count: int = 2, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(count)]


def _outcome(call) -> dict:
    """What ``call()`` did: ``{"ok": value}`` or ``{"error": type name, "message": text}``, and the seconds."""
    start = time.monotonic()
    try:
        result = {"ok": call()}
    except Exception as err:  # recorded for the test to judge
        result = {"error": type(err).__name__, "message": str(err), "cause": repr(err.__cause__)}
    result["seconds"] = time.monotonic() - start
    return result


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from geomuon.optimizers.assign import Assignment
    from geomuon.optimizers.distributed import matrix_owner, sharding_stats
    from geomuon.pretrain.parallel import load_distributed, save_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(world)))
    results: dict = {}

    def save():  # after every case: a case that kills the process leaves the earlier ones
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))

    def sharded(full, placement=None, on=None):
        return torch.nn.Parameter(distribute_tensor(full.clone(), on or mesh, [placement or Shard(0)]))

    def step(opt, params, gradients):
        for p, g in zip(params, gradients):
            p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements) if hasattr(p, "placements") \
                else g.clone()
        opt.step()

    def whole(params):
        return [p.detach().full_tensor() if hasattr(p, "placements") else p.detach().clone() for p in params]

    # D6: groups the sharded step cannot take, refused by name before any collective
    def grouped(params, opt_class=Muon):  # (on Stiefel for ManifoldMuon) one group of params w0, w1, ...
        options = dict(manifold="stiefel") if opt_class is ManifoldMuon else {}
        return opt_class([dict(params=params, param_names=[f"w{i}" for i in range(len(params))])], lr=0.02,
                         compute_dtype=None, **options)

    def refused(params, opt_class=Muon):
        step(grouped(params, opt_class), params, _gradients(len(params)))

    a, b = _points()
    results["mixed_plain"] = _outcome(lambda: refused([sharded(a), torch.nn.Parameter(b.clone())]))
    results["mixed_meshes"] = _outcome(lambda: refused([sharded(a), sharded(b, on=DeviceMesh("cpu", [1, 0]))]))
    results["shard1_alone"] = _outcome(lambda: refused([sharded(a, Shard(1))]))
    # D2: a same-shape batch whose second matrix is Shard(1) (its column shard has the bytes of a
    # row shard: Muon had stepped a scrambled matrix) or Replicate (a gloo collective mismatch)
    results["batch_shard1"] = _outcome(lambda: refused([sharded(a), sharded(b, Shard(1))]))
    results["batch_shard1_manifold"] = _outcome(lambda: refused([sharded(a), sharded(b, Shard(1))], ManifoldMuon))
    # fully_shard replaces a geoopt.ManifoldParameter by a plain DTensor parameter: the refusal had
    # told the user to pass the ManifoldParameter they had passed
    results["sharded_without_manifold"] = _outcome(lambda: ManifoldMuon([sharded(a)], lr=0.02))

    # a group of a sharded w0 without a gradient (on every rank) and a plain w1 with one: the step
    # had read the group's finiteness (a collective) and then failed on w1 with a KeyError. A
    # trainable w0 is refused by name, as it is where it has a gradient; a frozen one is no
    # sharded work, and w1 steps as a plain matrix
    def plain_with_gradient(frozen):
        params = [sharded(a), torch.nn.Parameter(b.clone())]
        params[0].requires_grad_(not frozen)
        opt = grouped(params)
        params[1].grad = _gradients(1)[0]
        opt.step()
        return not torch.equal(params[1].detach(), b)

    results["mixed_plain_trainable_without_gradient"] = _outcome(lambda: plain_with_gradient(False))
    results["mixed_plain_frozen"] = _outcome(lambda: plain_with_gradient(True))

    # ManifoldMuon's first sharded step checks its weights whole, on the host (check_on_manifold):
    # a weight off Stiefel had raised a plain ValueError there, where one process raises
    # OffManifoldError (the error a training loop catches to project the weights back)
    def off_manifold():
        params = [sharded(2 * a)]
        opt = ManifoldMuon(params, lr=0.02, manifold="stiefel", compute_dtype=None)
        out = {"step": _outcome(lambda: step(opt, params, _gradients(1)))}
        out["moved"] = not torch.equal(whole(params)[0], 2 * a)
        return out

    results["off_manifold_first_step"] = _outcome(off_manifold)

    # a weight c appended to the group's params between steps (on every rank) had not been checked
    # on its manifold: one off Stiefel was stepped. Control: the same weight on Stiefel steps
    def appended(scale):
        params = [sharded(w) for w in (*_points(), scale * _points(1, seed=2)[0])]
        opt = _stiefel_muon(params[:2])
        step(opt, params[:2], _gradients())
        opt.param_groups[0]["params"].append(params[2])
        opt.param_groups[0]["param_names"].append("c")
        before = whole(params)
        out = {"step": _outcome(lambda: step(opt, params, _gradients(3, seed=2)))}
        out["moved"] = [not torch.equal(x, y) for x, y in zip(before, whole(params))]
        return out

    results["appended_off_manifold"] = _outcome(lambda: appended(2.0))
    results["appended_on_manifold"] = _outcome(lambda: appended(1.0))

    # an optimizer's weight-check hooks out of contract (_pending_checks without _add_checks: a rank
    # would check alone the weights it wants checked; an answer of the wrong length: its flags paired
    # with other weights): refused by name on every rank, before any weight moves, an earlier group's
    # included (the refusals had come once earlier groups had stepped)
    def hooked(case, opt_class):
        first = torch.nn.Parameter(torch.ones(3, 3, dtype=torch.float64))
        first.grad = torch.ones_like(first)
        params = [sharded(w) for w in _points()]
        opt = opt_class([dict(params=[first], update="adamw", param_names=["first"]),
                         dict(params=params, param_names=["a", "b"])],
                        lr=0.02, compute_dtype=None)
        before = [first.detach().clone(), *whole(params)]
        results[f"hooks:{case}"] = _outcome(lambda: step(opt, params, _gradients()))
        after = [first.detach(), *whole(params)]
        results[f"hooks:{case}:moved"] = [not torch.equal(x, y) for x, y in zip(before, after)]

    hooked("unpaired", UnpairedChecksMuon)
    hooked("short", ShortChecksMuon)
    save()

    # D3: save_distributed on a sub-mesh, where a rank's number is not its global one: global
    # rank 1 is rank 0 of the mesh [1] (as on the dp dimension of a larger mesh); global rank 0
    # has a model of its own. The whole-matrix state of every matrix reaches the checkpoint
    def checkpoint():
        sub_mesh = DeviceMesh("cpu", [1])
        model = torch.nn.Module()
        if rank == 1:
            model.a, model.b = (sharded(w, on=sub_mesh) for w in _points())
            params = [model.a, model.b]
        else:
            model.z = torch.nn.Parameter(_points(1)[0])
            params = [model.z]
        opt = ManifoldMuon([dict(params=params)], lr=0.02, manifold="stiefel", compute_dtype=None)
        for seed in (1, 2):
            step(opt, params, _gradients(len(params), seed=seed))
        save_distributed(os.path.join(out_dir, "dcp-step00000002"), model,
                         types.SimpleNamespace(optimizers={"mm": opt}), {"step": 2})

    results["submesh_checkpoint"] = _outcome(checkpoint)
    save()

    # D5: optimizer.state_dict() under FSDP2 (rank 0 saves it for the test process), and a
    # one-process state dict loaded into a sharded optimizer
    def state_dicts():
        params = [sharded(w) for w in _points()]
        opt = _stiefel_muon(params)
        step(opt, params, _gradients())
        if rank == 0:
            torch.save(opt.state_dict(), os.path.join(out_dir, "fsdp_state_dict.pt"))
        plain = [torch.nn.Parameter(w) for w in _points()]
        one = _stiefel_muon(plain)
        step(one, plain, _gradients())
        opt.load_state_dict(one.state_dict())

    results["plain_state_into_sharded"] = _outcome(state_dicts)
    save()

    # D4: the owner of matrix b (rank 1) fails in its whole-matrix work. Elementwise apply
    # (Muon) with a sharded AdamW group after it: every rank raises at that group's check, in
    # the same step. Whole-matrix apply (ManifoldMuon), one group: the step returns, the next
    # one raises before any collective; a failure in a later step is raised by check_finite
    def failing(opt, calls):
        """Rank 1's ``_direction`` raises at its call numbers ``calls`` (1-based)."""
        real, count = opt._direction, [0]

        def direction(*args, **kwargs):
            count[0] += 1
            if rank == 1 and count[0] in calls:
                raise RuntimeError("simulated failure on the owner")
            return real(*args, **kwargs)

        opt._direction = direction

    def elementwise():
        params = [sharded(w) for w in _points()]
        vector = torch.nn.Parameter(distribute_tensor(torch.ones(6, dtype=torch.float64), mesh, [Shard(0)]))
        # no weight decay: a failed matrix's zero update leaves it as it was
        opt = Muon([dict(params=params, param_names=["a", "b"]),
                    dict(params=[vector], param_names=["v"], update="adamw", lr=0.01)], lr=0.02, weight_decay=0,
                   compute_dtype=None)
        failing(opt, {1})
        before = whole(params + [vector])
        vector.grad = distribute_tensor(torch.ones(6, dtype=torch.float64), mesh, [Shard(0)])
        out = {"failed_step": _outcome(lambda: step(opt, params, _gradients())), "before": before,
               "after_failure": whole(params + [vector])}
        vector.grad = distribute_tensor(torch.ones(6, dtype=torch.float64), mesh, [Shard(0)])
        out["next_step"] = _outcome(lambda: step(opt, params, _gradients(seed=2)))
        return out

    results["owner_fails_elementwise"] = _outcome(elementwise)
    save()

    def whole_matrix():
        params = [sharded(w) for w in _points()]
        opt = _stiefel_muon(params)
        failing(opt, {1, 3})  # steps 1 and 4 (step 2 raises before the owner's work)
        before = whole(params)
        out = {"failed_step": _outcome(lambda: step(opt, params, _gradients())), "before": before,
               "after_failure": whole(params)}
        out["raising_step"] = _outcome(lambda: step(opt, params, _gradients(seed=2)))
        out["after_raise"] = whole(params)
        out["good_step"] = _outcome(lambda: step(opt, params, _gradients(seed=3)))
        out["failed_last_step"] = _outcome(lambda: step(opt, params, _gradients(seed=4)))
        out["check_finite"] = _outcome(opt.check_finite)
        out["check_finite_again"] = _outcome(opt.check_finite)
        return out

    results["owner_fails_whole_matrix"] = _outcome(whole_matrix)
    save()

    # D7: fp16 weights, one process and the sharded step (here, on the same threads): the
    # sharded elementwise apply had rounded the update to the weights' dtype before the lr scaled it
    def fp16_updates():
        out = {}
        for case, make, points, gradient in FP16_CASES:
            runs = {}
            for mode in ("one_process", "sharded"):
                params = [sharded(w) if mode == "sharded" else torch.nn.Parameter(w.clone()) for w in points]
                opt = make(params)
                with warnings.catch_warnings(record=True) as warned:
                    warnings.simplefilter("always")
                    for _ in range(FP16_STEPS):
                        step(opt, params, [gradient(w) for w in points])
                    opt.check_finite()
                runs[mode] = whole(params)
                runs[mode + "_warnings"] = [str(w.message) for w in warned if "non-finite" in str(w.message)]
            out[case] = runs
        return out

    results["fp16_updates"] = _outcome(fp16_updates)
    save()

    # D9: project_to_manifolds between sharded steps wrote the rows behind the owner's replica:
    # the owner took it for an outside write and skipped the matrix's next step
    def projected():
        runs = {}
        for mode in ("one_process", "sharded"):
            params = [sharded(a) if mode == "sharded" else torch.nn.Parameter(a.clone())]
            opt = _stiefel_muon(params)
            for k, g in enumerate(_gradients(PROJECTED_STEPS, seed=4)):
                step(opt, params, [g])
                if k == 0:
                    opt.project_to_manifolds()
            runs[mode] = whole(params)[0]
            if mode == "sharded":
                refreshed = torch.as_tensor(sharding_stats(opt).refreshed, dtype=torch.int64)
                dist.all_reduce(refreshed)
                runs["refreshed"] = int(refreshed)
        return runs

    results["projected"] = _outcome(projected)
    save()

    # D2 with Replicate last: before the fix it broke the process group (a gloo mismatch)
    results["batch_replicate"] = _outcome(lambda: refused([sharded(a), sharded(b, Replicate())]))
    save()

    # D8: Shard(0) weights whose gradients are placed otherwise (by hand, not by FSDP2's
    # reduce-scatter): the step had sent each gradient's whole local matrix where its owner
    # expected rows, after moving the momentum: gloo failed inside the all-to-all, unnamed
    def gradient_placed(placement):
        params = [sharded(w) for w in _points()]
        opt = Muon([dict(params=params, param_names=["w0", "w1"])], lr=0.02, compute_dtype=None)
        for p, g in zip(params, _gradients()):
            p.grad = (DTensor.from_local(g / world, mesh, [placement]) if placement.is_partial()
                      else distribute_tensor(g, mesh, [placement]))
        opt.step()

    results["gradient_replicate"] = _outcome(lambda: gradient_placed(Replicate()))
    results["gradient_partial"] = _outcome(lambda: gradient_placed(Partial()))
    save()

    # the group checks ManifoldMuon gained (cold_dual_steps without warm starts, a Gram form's
    # bad declared defaults), met by a sharded group edited after construction: every rank
    # refuses before any collective
    def edited(**options):
        params = [sharded(w) for w in _points()]
        opt = _stiefel_muon(params)
        opt.param_groups[0].update(options)
        step(opt, params, _gradients())

    results["cold_dual_steps_without_warm_start"] = _outcome(lambda: edited(warm_start=False, cold_dual_steps=2))
    results["form_with_bad_defaults"] = _outcome(lambda: edited(manifold=HalfStepStiefel().spec()))
    save()

    # today's whole-matrix state and arguments (WHOLE_CASES): one process, the sharded run
    # (its owners' whole-matrix state gathered), and a run resumed from its distributed checkpoint
    def owners_state(opt, params):
        """Each matrix's whole-matrix state (plain tensors), as its owner holds it."""
        gathered = []
        for p in params:
            owner = matrix_owner(opt, p)
            mine = {k: v for k, v in opt.state[p].items()
                    if isinstance(v, torch.Tensor) and not hasattr(v, "placements")}
            box = [mine if owner in (None, rank) else None]
            dist.broadcast_object_list(box, src=owner if owner is not None else 0)
            gathered.append(box[0])
        return gathered

    def whole_case(case, opt_class, options, dtype, manifold, tiny):
        def build(params):
            return opt_class([dict(params=params, param_names=["w0", "w1"], **options)], lr=0.01)

        def run(model, opt, steps):
            for k in steps:
                step(opt, [model.w0, model.w1], _whole_case_gradients(k, dtype, tiny))
            opt.check_finite()

        def model_of(points, distributed):
            model = torch.nn.Module()
            model.w0, model.w1 = (sharded(w) if distributed else torch.nn.Parameter(w.clone()) for w in points)
            return model

        before, after = range(RESUME_STEPS), range(RESUME_STEPS, 2 * RESUME_STEPS)
        out = {}
        one = model_of(_whole_case_points(dtype, manifold), False)
        one_opt = build([one.w0, one.w1])
        run(one, one_opt, before)
        out["one_process_state"] = [{k: v.clone() for k, v in one_opt.state[p].items() if k != "momentum_buffer"}
                                    for p in (one.w0, one.w1)]
        run(one, one_opt, after)
        out["one_process"] = whole([one.w0, one.w1])

        model = model_of(_whole_case_points(dtype, manifold), True)
        opt = build([model.w0, model.w1])
        run(model, opt, before)
        out["sharded_state"] = owners_state(opt, [model.w0, model.w1])
        folder = os.path.join(out_dir, f"dcp-{case}", f"dcp-step{RESUME_STEPS:08d}")
        os.makedirs(os.path.dirname(folder), exist_ok=True)  # (every rank: a run folder exists before it saves)
        save_distributed(folder, model, Assignment(case, [], {"opt": opt}), {"step": RESUME_STEPS})
        run(model, opt, after)
        out["sharded"] = whole([model.w0, model.w1])

        resumed = model_of(_whole_case_points(dtype, manifold, seed=6), True)  # other weights, overwritten
        resumed_opt = build([resumed.w0, resumed.w1])
        load_distributed(folder, resumed, Assignment(case, [], {"opt": resumed_opt}))
        out["loaded_state"] = owners_state(resumed_opt, [resumed.w0, resumed.w1])
        out["loaded_manifold"] = resumed_opt.param_groups[0].get("manifold")
        run(resumed, resumed_opt, after)
        out["resumed"] = whole([resumed.w0, resumed.w1])
        return out

    for case, *spec in WHOLE_CASES:
        results[f"whole:{case}"] = _outcome(lambda: whole_case(case, *spec))  # noqa: B023 - called at once
        save()

    # a gradient on some ranks only (p.grad None on rank 1): the ranks' norm stacks had differed
    # in length and every rank waited in the norm all-reduce until the process group's timeout.
    # Then, on the same optimizer, gradients on every rank: the group still steps (nothing was
    # left in a collective), and b's gradient None on every rank steps a alone
    def gradient_on_some_ranks(missing_on_rank1):
        params = [sharded(w) for w in _points()]
        opt = Muon([dict(params=params, param_names=["a", "b"])], lr=0.02, compute_dtype=None)
        out = {}
        for p, g in zip(params, _gradients()):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        if rank == 1:
            for i in missing_on_rank1:
                params[i].grad = None
        before = whole(params)
        out["step"] = _outcome(opt.step)
        out["moved"] = [not torch.equal(x, y) for x, y in zip(before, whole(params))]
        step(opt, params, _gradients(seed=2))
        params[1].grad = None
        before = whole(params)
        opt.step()
        out["after"] = [not torch.equal(x, y) for x, y in zip(before, whole(params))]
        return out

    results["gradient_on_some_ranks"] = _outcome(lambda: gradient_on_some_ranks([1]))
    # no gradient of the group on rank 1 at all: that rank had recorded no options to compare and
    # skipped the options' all-reduce, where rank 0 waited for it until the timeout
    results["no_gradient_on_one_rank"] = _outcome(lambda: gradient_on_some_ranks([0, 1]))
    save()

    # options that differ between the ranks (OPTION_CASES): each rank had stepped its rows with
    # its own lr (Muon; an owner's manifold step with its own), and a differing compute_dtype had
    # sent payloads of different sizes into the all-to-all (gloo aborted both processes: that
    # case runs last). An equal tensor lr on both ranks is the control: it steps
    def differing(option_of_rank):
        params = [sharded(w) for w in _points()]
        opt = Muon([dict(params=params, param_names=["a", "b"], **option_of_rank(rank))], lr=0.02)
        before = whole(params)
        out = {"step": _outcome(lambda: step(opt, params, _gradients()))}
        out["moved"] = not all(torch.equal(x, y) for x, y in zip(before, whole(params)))
        return out

    for case, option_of_rank in OPTION_CASES.items():
        results[f"options:{case}"] = _outcome(lambda: differing(option_of_rank))  # noqa: B023 - called at once
        save()

    # another optimizer class on rank 1: the refusal had not said so, and had listed options one
    # class lacks as "rank 0: None, rank 1: None" (a missing key read as None against the text 'None')
    def another_class():
        params = [sharded(w) for w in _points()]
        group = dict(params=params, param_names=["a", "b"])
        opt = Muon([group], lr=0.02) if rank == 0 else ManifoldMuon([group], lr=0.02, manifold="euclidean")
        return _outcome(lambda: step(opt, params, _gradients()))

    results["options:another_class"] = _outcome(another_class)
    save()

    # a group listing its parameters in another order on rank 1 (a [6, 4] and a [3, 4] matrix, or
    # two named [6, 4] ones): each rank's first batch was another shape, and gloo aborted both
    # processes inside the all-to-all (so these run last); two unnamed same-shape ones swapped
    # cannot be told apart (the control: it steps)
    def reordered(shapes, names):
        params = [sharded(torch.ones(shape, dtype=torch.float64)) for shape in shapes]
        listed = params[::-1] if rank == 1 else params
        group = dict(params=listed, **({"param_names": names[::-1] if rank == 1 else names} if names else {}))
        opt = Muon([group], lr=0.02, compute_dtype=None)
        before = whole(params)
        out = {"step": _outcome(lambda: step(opt, params, [torch.ones(p.shape, dtype=torch.float64)
                                                          for p in params]))}
        out["moved"] = not all(torch.equal(x, y) for x, y in zip(before, whole(params)))
        return out

    for case, shapes, names in REORDERED_CASES:
        results[f"reordered:{case}"] = _outcome(lambda: reordered(shapes, names))  # noqa: B023 - called at once
        save()

    # rank 0's group lists a parameter more (appended between steps, or before the first:
    # EXTRA_PARAMETER_CASES): Muon's finiteness all-reduce, one entry per parameter, ran before the
    # options were compared, and gloo aborted rank 1 on the longer vector; ManifoldMuon's first
    # step gathered each weight for its manifold check before that (rank 0 waited until the
    # process group's timeout). So these run last. Then rank 0 drops it again and the group steps: the
    # process group survived, and the parameters' text recorded for the comparison is the edited
    # group's at every step (in both directions)
    def extra_parameter(opt_class, first_step):
        params = [sharded(w) for w in (*_points(), *_points(1, seed=2))]
        group = dict(params=params[:2], param_names=["a", "b"])
        opt = opt_class([group], lr=0.02, compute_dtype=None,
                        **(dict(manifold="stiefel") if opt_class is ManifoldMuon else {}))
        out = {} if first_step else {"first": _outcome(lambda: step(opt, params, _gradients(3)))}
        if rank == 0:
            opt.param_groups[0]["params"].append(params[2])
            opt.param_groups[0]["param_names"].append("c")
        before = whole(params)
        out["extra"] = _outcome(lambda: step(opt, params, _gradients(3, seed=2)))
        out["moved"] = [not torch.equal(x, y) for x, y in zip(before, whole(params))]
        if rank == 0:
            opt.param_groups[0]["params"].pop()
            opt.param_groups[0]["param_names"].pop()
        before = whole(params)
        out["dropped"] = _outcome(lambda: step(opt, params, _gradients(3, seed=3)))
        out["moved_after"] = [not torch.equal(x, y) for x, y in zip(before, whole(params))]
        return out

    for case, opt_class, first_step in EXTRA_PARAMETER_CASES:
        results[case] = _outcome(lambda: extra_parameter(opt_class, first_step))  # noqa: B023 - called at once
        save()

    # rank 0 alone loads a state dict (its own) between two steps, the weights on Stiefel (scale 1)
    # or pushed off it on every rank (scale 2): rank 0 alone had its weights pending the manifold
    # check and gathered them (an all-gather per matrix) while rank 1 went into the all-to-all, and
    # rank 0 alone had dropped its replicas (it sent the weights, rank 1 its momentum and flags).
    # Both had waited until the process group's timeout; so these run after the cases above
    def loaded_on_one_rank(scale, opt_class=ManifoldMuon):
        params = [sharded(w) for w in _points()]
        opt = _stiefel_muon(params, opt_class)
        step(opt, params, _gradients())
        with torch.no_grad():
            for p in params:  # every rank's rows
                p.to_local().mul_(scale)
        if rank == 0:
            opt.load_state_dict(opt.state_dict())
        before = whole(params)
        out = {"step": _outcome(lambda: step(opt, params, _gradients(seed=2)))}
        out["moved"] = [not torch.equal(x, y) for x, y in zip(before, whole(params))]
        out["weights"] = whole(params)
        return out

    for scale in (1.0, 2.0):
        results[f"loaded_on_one_rank:{scale:g}"] = _outcome(lambda: loaded_on_one_rank(scale))  # noqa: B023
        save()
    results["loaded_on_one_rank:copied_checks"] = _outcome(lambda: loaded_on_one_rank(2.0, CopiedChecksMuon))
    save()

    # a group of a sharded w0 and a plain w1, both trainable, w1's gradient on rank 0 only: rank 0
    # had refused the group while rank 1 compared the options alone until the process group's timeout
    def plain_gradient_on_one_rank():
        params = [sharded(a), torch.nn.Parameter(b.clone())]
        opt = grouped(params)
        step(opt, params if rank == 0 else params[:1], _gradients(2 if rank == 0 else 1))

    results["plain_gradient_on_one_rank"] = _outcome(plain_gradient_on_one_rank)
    save()

    # a Shard(1) weight w0 (a placement the step refuses) beside a Shard(0) w1, w0's gradient on
    # rank 0 only: rank 0 had refused w0's placement while rank 1 compared the options alone until
    # the process group's timeout (so this runs last)
    def placement_gradient_on_one_rank():
        params = [sharded(a, Shard(1)), sharded(b)]
        opt = grouped(params)
        for p, g in zip(params, _gradients()):  # (distribute_tensor is collective: on every rank)
            p.grad = distribute_tensor(g, mesh, p.placements)
        if rank == 1:
            params[0].grad = None
        opt.step()

    results["placement_gradient_on_one_rank"] = _outcome(placement_gradient_on_one_rank)
    save()
    try:  # every rank past its last collective before any tears the group down (gloo aborts a peer)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # the results are saved; a broken group is the tests' to report
        pass


if __name__ == "__main__":
    worker(sys.argv[1])
    # no interpreter teardown: a gloo thread can abort a rank at exit (see tests/test_distributed.py)
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each rank's results and the worker's folder."""
    out = tmp_path_factory.mktemp("distributed_checks")
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(out)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = outputs_of(procs)
    ranks = []
    for r, output in enumerate(outputs):
        path = out / f"rank{r}.pt"
        assert path.exists(), output
        ranks.append(torch.load(path))
    return ranks, out


def _refused_by_name(ranks, case: str, *words: str, error: str = "ValueError") -> None:
    for r, results in enumerate(ranks):
        outcome = results[case]
        assert outcome.get("error") == error, (r, case, outcome)
        for word in words:
            assert word in outcome["message"], (r, case, word, outcome["message"])
        assert outcome["seconds"] < PG_TIMEOUT / 2, (r, case, outcome)


def test_a_group_mixing_sharded_and_plain_or_meshes_is_refused_by_name(runs):
    # had been torch's "got mixed torch.Tensor and DTensor" and "must have the same mesh"
    ranks, _ = runs
    _refused_by_name(ranks, "mixed_plain", "'w0' is a DTensor", "'w1' a plain tensor", "param group of their own")
    _refused_by_name(ranks, "mixed_meshes", "'w1' is on the device mesh of ranks [1, 0]", "param group of their own")
    # had named the group and the shape only
    _refused_by_name(ranks, "shard1_alone", "parameter 'w0'", "Shard(dim=1)", "Shard(0)")


def test_a_sharded_parameter_without_manifold_is_told_that_sharding_lost_it(runs):
    ranks, _ = runs
    _refused_by_name(ranks, "sharded_without_manifold", "has no manifold (it is a DTensor: fully_shard replaces "
                     "a geoopt.ManifoldParameter", "set the group's 'manifold'")
    # control: a plain parameter without one is told only what to set
    with pytest.raises(ValueError, match=r"parameter #0 of param group 0 has no manifold; set the group's"):
        ManifoldMuon([torch.nn.Parameter(_points()[0])], lr=0.02)


def test_a_trainable_sharded_parameter_without_gradient_beside_a_plain_one_is_refused_by_name(runs):
    # w0 a DTensor without a gradient, w1 plain with one: the step had read the group's finiteness
    # on the mesh and then raised KeyError (w1 was not among the parameters read)
    ranks, _ = runs
    _refused_by_name(ranks, "mixed_plain_trainable_without_gradient", "'w0' is a DTensor", "'w1' a plain tensor",
                     "param group of their own")
    for r, results in enumerate(ranks):  # the control: w0 frozen, no sharded work, and w1 steps
        assert results["mixed_plain_frozen"].get("ok") is True, (r, results["mixed_plain_frozen"])


def test_a_sharded_weight_off_its_manifold_is_refused_as_in_one_process(runs):
    ranks, _ = runs
    from geomuon.optimizers.base import OffManifoldError

    one = torch.nn.Parameter(2 * _points(1)[0])
    opt = ManifoldMuon([one], lr=0.02, manifold="stiefel", compute_dtype=None)
    one.grad = _gradients(1)[0]
    with pytest.raises(OffManifoldError):  # the one-process step's error (the control)
        opt.step()
    for r, results in enumerate(ranks):
        assert "ok" in results["off_manifold_first_step"], (r, results["off_manifold_first_step"])
        run = results["off_manifold_first_step"]["ok"]
        assert run["step"].get("error") == "OffManifoldError", (r, run["step"])
        assert "off their manifold" in run["step"]["message"] and "projx" in run["step"]["message"], (r, run)
        assert not run["moved"], r


def test_a_sharded_weight_appended_to_a_group_is_checked_on_its_manifold(runs):
    # appended to group["params"] between steps on every rank, a weight off Stiefel had been
    # stepped unchecked; now it is left out of the step, and every rank raises OffManifoldError at
    # its end, as one process does (the group's other weights step). Control: the same weight on
    # Stiefel steps
    ranks, _ = runs
    for r, results in enumerate(ranks):
        off, on = results["appended_off_manifold"], results["appended_on_manifold"]
        assert "ok" in off and "ok" in on, (r, off, on)
        assert off["ok"]["step"].get("error") == "OffManifoldError", (r, off)
        assert "parameter(s) off their manifold — 'c'" in off["ok"]["step"]["message"], (r, off)
        assert off["ok"]["moved"] == [True, True, False], (r, off)
        assert "ok" in on["ok"]["step"], (r, on)
        assert on["ok"]["moved"] == [True, True, True], (r, on)


def test_a_batch_mixing_placements_is_refused_by_name(runs):
    # Muon had stepped the Shard(1) matrix silently wrong (1.4e-2 off the one-process step),
    # ManifoldMuon raised an unnamed shape error on the owner only, Replicate a gloo mismatch
    ranks, _ = runs
    for case in ("batch_shard1", "batch_shard1_manifold"):
        _refused_by_name(ranks, case, "parameter 'w1'", "Shard(dim=1)", "fully_shard")
    _refused_by_name(ranks, "batch_replicate", "parameter 'w1'", "Replicate()", "fully_shard")


def test_a_gradient_placed_unlike_its_parameter_is_refused_by_name(runs):
    # a Replicate or Partial gradient of a Shard(0) weight had reached a mismatched all-to-all
    # (gloo: "enforce fail ... inLengthPerRank[myRank] == outLengthPerRank[myRank]"; a probe
    # with one matrix left a rank waiting there instead), its momentum already moved
    ranks, _ = runs
    _refused_by_name(ranks, "gradient_replicate", "gradient of parameter 'w0' is placed (Replicate(),)",
                     "Shard(dim=0)", "redistribute(p.device_mesh, p.placements)")
    _refused_by_name(ranks, "gradient_partial", "gradient of parameter 'w0' is placed (Partial(sum),)",
                     "redistribute(p.device_mesh, p.placements)")


def test_a_checkpoint_on_a_sub_mesh_keeps_the_whole_matrix_state(runs):
    # the owner (a rank on the mesh) had been compared with the global rank: no warm start
    # and no step count of either matrix reached the checkpoint
    from geomuon.pretrain.parallel import read_distributed

    ranks, out = runs
    assert all("ok" in r["submesh_checkpoint"] for r in ranks), [r["submesh_checkpoint"] for r in ranks]
    saved = read_distributed(str(out / "dcp-step00000002"), prefix="optimizer/mm/")
    for name in ("a", "b"):
        assert {f"{name}/momentum_buffer", f"{name}/dual_correction", f"{name}/step"} <= set(saved), sorted(saved)
        assert float(saved[f"{name}/step"]) == 2


def test_a_sharded_state_dict_is_refused_by_a_plain_optimizer_and_back(runs):
    # under FSDP2 state_dict() is one rank's view; it had loaded into plain parameters and the
    # next step failed in torch ("got mixed torch.Tensor and DTensor")
    import torch.distributed.tensor  # torch.load needs it to read DTensors

    ranks, out = runs
    state = torch.load(out / "fsdp_state_dict.pt", weights_only=False)
    params = [torch.nn.Parameter(w) for w in _points()]
    opt = _stiefel_muon(params)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of parameter 'a' is a DTensor shard.*load_distributed"):
        opt.load_state_dict(state)
    assert not opt.state  # nothing loaded
    # a one-process state dict into the sharded optimizer (its step had failed in to_local)
    _refused_by_name(ranks, "plain_state_into_sharded", "'momentum_buffer' of parameter 'a' is a plain tensor",
                     "load_distributed")


def _step_of_one_process(opt_class, points, gradients, **options):
    params = [torch.nn.Parameter(w.clone()) for w in points]
    opt = opt_class(params, lr=0.02, compute_dtype=None, **options)
    for p, g in zip(params, gradients):
        p.grad = g.clone()
    opt.step()
    return [p.detach() for p in params]


def test_an_owner_that_fails_leaves_no_rank_waiting_and_every_rank_raises(runs):
    # the owner had raised alone, between the two all-to-alls: the other ranks waited in the
    # second one until the process group's timeout (30 min with torch's gloo default)
    ranks, _ = runs
    for r, results in enumerate(ranks):
        # elementwise apply: raised in the same step, at the sharded AdamW group's check
        assert "ok" in results["owner_fails_elementwise"], (r, results["owner_fails_elementwise"])
        run = results["owner_fails_elementwise"]["ok"]
        failed = run["failed_step"]
        assert failed.get("error") == "RuntimeError", (r, failed)
        assert "'b' (group 0, owner rank 1)" in failed["message"] and "load_distributed" in failed["message"]
        assert failed["seconds"] < PG_TIMEOUT / 2, (r, failed)
        assert ("simulated failure on the owner" in failed["message"]) == (r == 1), (r, failed["message"])
        a, b, v = run["after_failure"]
        assert torch.equal(a, _step_of_one_process(Muon, _points(), _gradients(), weight_decay=0)[0])  # a stepped
        assert torch.equal(b, run["before"][1]) and torch.equal(v, run["before"][2])  # b no update, v not reached
        assert "ok" in run["next_step"], (r, run["next_step"])  # the ranks' collectives still match

        # whole-matrix apply, one group: the step returns, the next step raises before it starts
        assert "ok" in results["owner_fails_whole_matrix"], (r, results["owner_fails_whole_matrix"])
        run = results["owner_fails_whole_matrix"]["ok"]
        assert "ok" in run["failed_step"], (r, run["failed_step"])
        a, b = run["after_failure"]
        assert torch.equal(a, _step_of_one_process(ManifoldMuon, _points(), _gradients(), manifold="stiefel")[0])
        assert torch.equal(b, run["before"][1])  # b's weights as they were, bit for bit
        raised = run["raising_step"]
        assert raised.get("error") == "RuntimeError" and "'b' (group 0, owner rank 1)" in raised["message"], (r, raised)
        assert raised["seconds"] < PG_TIMEOUT / 2, (r, raised)
        assert all(torch.equal(x, y) for x, y in zip(run["after_raise"], run["after_failure"]))  # nothing stepped
        assert "ok" in run["good_step"] and "ok" in run["failed_last_step"], (r, run)
        assert run["check_finite"].get("error") == "RuntimeError" and "'b'" in run["check_finite"]["message"], (r, run)
        assert "ok" in run["check_finite_again"], (r, run)  # reported once
    assert "simulated failure on the owner" in ranks[1]["owner_fails_whole_matrix"]["ok"]["raising_step"]["cause"]


def test_fp16_weights_step_as_in_one_process(runs):
    # the update had been rounded to fp16 before the lr scaled it: RightPolarGradM's 9.0e4 became
    # inf in the weights (one process: finite), and Muon's fp16 add rounded lr to fp16 (1 ulp off).
    # Each matrix is alone in its batch, so both runs take the same kernels on the same operands:
    # bit for bit
    ranks, _ = runs
    for r, results in enumerate(ranks):
        assert "ok" in results["fp16_updates"], (r, results["fp16_updates"])
        for case, _, points, _ in FP16_CASES:
            run = results["fp16_updates"]["ok"][case]
            # a finite gradient is stepped on every path, and no rank calls it non-finite
            assert run["one_process_warnings"] == run["sharded_warnings"] == [], (r, case, run)
            for start, one, sharded in zip(points, run["one_process"], run["sharded"]):
                assert one.dtype == sharded.dtype == torch.float16, (case, one.dtype, sharded.dtype)
                assert bool(one.isfinite().all()) and not torch.equal(one, start), (case, one)  # it stepped
                if case == "polar":  # the regime it is about: updates past fp16's range before the lr scales
                    # them (each step moves the weight by |update| * lr, two steps: > 2 * 65504 * 1e-5)
                    assert one.abs().max().item() > FP16_STEPS * torch.finfo(torch.float16).max * 1e-5, one
                assert torch.equal(sharded, one), (r, case, (sharded.float() - one.float()).abs().max())


def _two_weights() -> torch.nn.Module:
    weights = torch.nn.Module()
    weights.a, weights.b = (torch.nn.Parameter(w) for w in _points())
    return weights


def test_a_distributed_checkpoint_of_another_parameter_order_is_refused(tmp_path):
    # load_distributed had mapped the saved state to the parameters by position: an optimizer
    # listing the same two same-shape weights in the other order loaded a's momentum into b,
    # silently. Its optimizers carry no param_names: the model's names identify the parameters.
    # One process, no process group: save_distributed and load_distributed take it alone
    from geomuon.optimizers.assign import Assignment
    from geomuon.pretrain.parallel import load_distributed, save_distributed

    saved = _two_weights()
    opt = Muon([saved.a, saved.b], lr=0.02, compute_dtype=None)
    for p, g in zip((saved.a, saved.b), _gradients()):
        p.grad = g
    opt.step()
    folder = str(tmp_path / "dcp-step00000001")
    save_distributed(folder, saved, Assignment("a then b", [], {"matrices": opt}), {"step": 1})

    swapped = _two_weights()
    reordered = Muon([swapped.b, swapped.a], lr=0.02, compute_dtype=None)
    with pytest.raises(ValueError, match=r"dcp-step00000001.*optimizer state of 'matrices', group 0, holds "
                                         r"\['a', 'b'\] but strategy 'b then a' puts \['b', 'a'\] there"):
        load_distributed(folder, swapped, Assignment("b then a", [], {"matrices": reordered}))
    assert not reordered.state  # nothing loaded
    # the same order loads, each momentum onto its own weight (a copy: bit for bit)
    same = _two_weights()
    ordered = Muon([same.a, same.b], lr=0.02, compute_dtype=None)
    load_distributed(folder, same, Assignment("a then b", [], {"matrices": ordered}))
    for p, q in ((same.a, saved.a), (same.b, saved.b)):
        assert torch.equal(ordered.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])


def test_a_step_count_loads_on_the_cpu_as_a_one_process_resume_loads_it(tmp_path, monkeypatch):
    # every non-elementwise state entry had been loaded onto the parameter's device, torch.optim.AdamW's
    # "step" included: on a GPU, AdamW (neither capturable nor fused) then reads it back at every step
    # (a host sync per parameter). The parameter's device is played here by "meta" (no GPU in the
    # tests): a template there had left the step count on meta. One process, no process group
    from geomuon.optimizers.assign import Assignment
    from geomuon.pretrain import parallel

    def adamw_of(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    opt = adamw_of(saved)
    saved(torch.randn(2, 4)).sum().backward()
    opt.step()
    folder = str(tmp_path / "dcp-step00000001")
    parallel.save_distributed(folder, saved, Assignment("adamw", [], {"adamw": opt}), {"step": 1})
    loaded = torch.nn.Linear(4, 3)
    resumed = adamw_of(loaded)
    monkeypatch.setattr(parallel, "_local_device", lambda p: torch.device("meta"))
    parallel.load_distributed(folder, loaded, Assignment("adamw", [], {"adamw": resumed}))
    for p, q in zip(loaded.parameters(), saved.parameters()):
        assert resumed.state[p]["step"].device.type == "cpu" and float(resumed.state[p]["step"]) == 1.0
        assert torch.equal(resumed.state[p]["exp_avg"], opt.state[q]["exp_avg"])  # control: the state loaded


def test_a_distributed_checkpoint_of_another_geometry_is_refused_as_one_process_refuses_it(tmp_path):
    # load_distributed compared the parameters only: a Stiefel run's state loaded into a DGram
    # optimizer replaced its groups (torch loads the saved options), and the run went on on
    # Stiefel under the DGram label. Now it refuses what Assignment.load_state_dict refuses,
    # with the same words and the folder
    from geomuon.optimizers.assign import Assignment
    from geomuon.pretrain.parallel import load_distributed, save_distributed

    def run(manifold: str):
        weights = _two_weights()  # QR factors: on Stiefel and on DGram
        opt = ManifoldMuon([dict(params=[weights.a, weights.b], param_names=["a", "b"])], lr=0.02,
                           manifold=manifold, compute_dtype=None)
        return weights, Assignment(f"all_{manifold}", [], {"manifold_muon": opt})

    saved, written = run("stiefel")
    for p, g in zip((saved.a, saved.b), _gradients()):
        p.grad = g
    written.step()
    folder = str(tmp_path / "dcp-step00000001")
    save_distributed(folder, saved, written, {"step": 1})

    model, other = run("dgram")
    with pytest.raises(ValueError) as one_process:
        other.load_state_dict(written.state_dict())
    with pytest.raises(ValueError, match=r"dcp-step00000001.*'manifold_muon' gives 'a' .*manifold='Stiefel.*' but "
                                         r"strategy 'all_dgram' gives it manifold='DGram") as distributed:
        load_distributed(folder, model, other)
    assert str(distributed.value) == f"distributed checkpoint {folder!r}: {one_process.value}"
    assert not other.optimizers["manifold_muon"].state  # nothing loaded, the groups kept
    assert [g["manifold"]["name"] for g in other.optimizers["manifold_muon"].param_groups] == ["DGram"]


def test_a_distributed_checkpoint_whose_options_are_refused_leaves_the_model_and_is_no_damage(tmp_path):
    # a saved group the optimizer's load refuses (here: cold_dual_steps with warm_start=False, as a
    # checkpoint written before that pair was refused holds it) had been found after the model's
    # weights were loaded over this run's; and it is a settings refusal, not a damaged folder (the
    # run had then advised resuming from the previous folder, which holds the same options)
    from geomuon.optimizers.assign import Assignment
    from geomuon.pretrain.parallel import RUN_RECORD, DamagedCheckpoint, load_distributed, save_distributed

    def run():
        weights = _two_weights()
        opt = ManifoldMuon([dict(params=[weights.a, weights.b], param_names=["a", "b"], warm_start=False)],
                           lr=0.02, manifold="stiefel", compute_dtype=None)
        return weights, Assignment("all_stiefel", [], {"manifold_muon": opt})

    saved, written = run()
    for p, g in zip((saved.a, saved.b), _gradients()):
        p.grad = g
    written.step()
    folder = str(tmp_path / "dcp-step00000001")
    save_distributed(folder, saved, written, {"step": 1})
    record = torch.load(os.path.join(folder, RUN_RECORD), weights_only=True)
    record["optimizers"]["manifold_muon"]["param_groups"][0]["cold_dual_steps"] = 2
    torch.save(record, os.path.join(folder, RUN_RECORD))

    model, fresh = run()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"dcp-step00000001.*cold_dual_steps=2 with warm_start=False") as refused:
        load_distributed(folder, model, fresh)
    assert not isinstance(refused.value, DamagedCheckpoint)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # the weights were not loaded
    os.remove(os.path.join(folder, ".metadata"))  # control: an unfinished folder is damage
    with pytest.raises(DamagedCheckpoint, match="has no .metadata"):
        load_distributed(folder, model, fresh)


def test_projecting_between_sharded_steps_costs_no_step(runs):
    # project_to_manifolds wrote every rank's rows behind the owner's replica: the owner took
    # them for an outside write and skipped the next step (refreshed 1; 1.6e-2 off one process).
    # One matrix alone in its batch, so the owner runs the one-process kernels on the same
    # operands, and every rank projects the same gathered matrix: bit for bit
    ranks, _ = runs
    for r, results in enumerate(ranks):
        assert "ok" in results["projected"], (r, results["projected"])
        run = results["projected"]["ok"]
        assert run["refreshed"] == 0, (r, run["refreshed"])
        assert torch.equal(run["sharded"], run["one_process"]), (r, (run["sharded"] - run["one_process"]).abs().max())


def _one_process_refusal(**options) -> str:
    params = [torch.nn.Parameter(w) for w in _points()]
    opt = _stiefel_muon(params)
    opt.param_groups[0].update(options)
    for p, g in zip(params, _gradients()):
        p.grad = g
    with pytest.raises(ValueError) as refused:
        opt.step()
    return str(refused.value)


def test_a_sharded_group_edited_past_manifold_muons_checks_is_refused_as_in_one_process(runs):
    # cold_dual_steps with warm_start=False (accepted and ignored before) and a Gram form declaring
    # dual_steps = 2.5 (run as 2 steps before): refused by the group check, which runs before any
    # collective, on every rank, with the one-process words
    ranks, _ = runs
    for case, options, words in (
            ("cold_dual_steps_without_warm_start", dict(warm_start=False, cold_dual_steps=2),
             ("cold_dual_steps=2 with warm_start=False",)),
            ("form_with_bad_defaults", dict(manifold=HalfStepStiefel().spec()),
             ("HalfStepStiefel", "dual_steps must be a whole number"))):
        _refused_by_name(ranks, case, *words)
        one_process = _one_process_refusal(**options)
        assert all(r[case]["message"] == one_process for r in ranks), (case, one_process, ranks[0][case]["message"])


def test_options_that_differ_between_ranks_are_refused_by_name_before_any_step(runs):
    ranks, _ = runs
    for r, results in enumerate(ranks):
        control = results["options:same_tensor_lr"]["ok"]
        assert "ok" in control["step"] and control["moved"], (r, control)
        for case in ("lr", "tensor_lr", "compute_dtype"):
            outcome = results[f"options:{case}"]
            assert "ok" in outcome, (r, case, outcome)  # the process group survived the refusal
            refused = outcome["ok"]["step"]
            assert refused.get("error") == "ValueError", (r, case, refused)
            values = {"lr": ("0.02", "0.05"), "compute_dtype": ("None", "torch.bfloat16"),
                      "tensor_lr": ("tensor(0.02, torch.float64)", "tensor(0.05, torch.float64)")}[case]
            option = "compute_dtype" if case == "compute_dtype" else "lr"
            for word in ("differ between the ranks", f"param group 0 option '{option}': rank 0: {values[0]}, "
                                                     f"rank 1: {values[1]}"):
                assert word in refused["message"], (r, case, word, refused["message"])
            assert not outcome["ok"]["moved"], (r, case)  # refused before any weight moved


def test_another_optimizer_class_on_one_rank_is_named_and_absent_options_are_not_shown_as_equal(runs):
    ranks, _ = runs
    for r, results in enumerate(ranks):
        refused = results["options:another_class"]["ok"]
        assert refused.get("error") == "ValueError", (r, refused)
        assert "the optimizer: rank 0: Muon, rank 1: ManifoldMuon" in refused["message"], (r, refused["message"])
        # an option only one class has shows as absent on the other rank, never as two equal texts
        assert "(no such option)" in refused["message"], (r, refused["message"])
        assert not re.search(r"rank 0: (\S+), rank 1: \1[;)]", refused["message"]), (r, refused["message"])


def test_parameters_listed_in_another_order_on_one_rank_are_refused_by_name_before_any_step(runs):
    # rank 1's group lists its parameters reversed: gloo had aborted every process inside the
    # all-to-all (the ranks' first batches were of different shapes)
    ranks, _ = runs
    listed = {"named_same_shape": ("'a' [6, 4] torch.float64, 'b' [6, 4] torch.float64",
                                   "'b' [6, 4] torch.float64, 'a' [6, 4] torch.float64"),
              "shapes": ("#0 of param group 0 [6, 4] torch.float64, #1 of param group 0 [3, 4] torch.float64",
                         "#0 of param group 0 [3, 4] torch.float64, #1 of param group 0 [6, 4] torch.float64")}
    for r, results in enumerate(ranks):
        # the control: unnamed same-shape parameters cannot be told apart, and the step goes on
        control = results["reordered:unnamed_same_shape"]
        assert "ok" in control and "ok" in control["ok"]["step"] and control["ok"]["moved"], (r, control)
        for case, (rank0, rank1) in listed.items():
            outcome = results[f"reordered:{case}"]
            assert "ok" in outcome, (r, case, outcome)  # the process group survived the refusal
            refused = outcome["ok"]["step"]
            assert refused.get("error") == "ValueError", (r, case, refused)
            word = f"param group 0 sharded parameters: rank 0: {rank0}, rank 1: {rank1}"
            assert word in refused["message"], (r, case, refused["message"])
            assert "same options and parameters, in the same order" in refused["message"], (r, case)
            assert not outcome["ok"]["moved"], (r, case)  # refused before any weight moved


def _same_tensors(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case, opt_class, options, dtype, manifold, tiny", WHOLE_CASES,
                         ids=[case[0] for case in WHOLE_CASES])
def test_whole_matrix_state_and_arguments_step_save_and_resume_as_one_process(runs, case, opt_class, options, dtype,
                                                                             manifold, tiny):
    # Each matrix is alone in its batch and every step's operands are the one-process step's, so
    # the sharded run is the one-process run bit for bit; a resume reads back the bytes that were
    # saved, so it is the uninterrupted run bit for bit. The chains' second warm start had been
    # shared with the first (a block that never fitted); the manifolds' arguments are private
    # copies now, in the param group as spec() (a tensor for the user's); the polar maps' scale
    # ||M||_*^-1 of a 1e-43 gradient overflows float32 (inf weights before)
    ranks, _ = runs
    for r, results in enumerate(ranks):
        outcome = results[f"whole:{case}"]
        assert "ok" in outcome, (r, case, outcome)
        run = outcome["ok"]
        for one, sharded, resumed in zip(run["one_process"], run["sharded"], run["resumed"]):
            assert one.dtype == sharded.dtype == dtype and bool(one.isfinite().all()), (case, one)
            assert torch.equal(sharded, one), (r, case, (sharded.double() - one.double()).abs().max())
            assert torch.equal(resumed, sharded), (r, case, (resumed.double() - sharded.double()).abs().max())
        for one, sharded, loaded in zip(run["one_process_state"], run["sharded_state"], run["loaded_state"]):
            if opt_class is RowNormM:  # row-wise: no whole-matrix state, no owner
                assert sharded == {} and loaded == {}, (case, sharded, loaded)
                continue
            # the owner holds what one process holds, and the checkpoint brings it back
            assert _same_tensors(sharded, one), (r, case, sorted(sharded), sorted(one))
            assert _same_tensors(loaded, sharded), (r, case, sorted(loaded), sorted(sharded))
        if case.startswith("chain"):
            for state in run["loaded_state"]:  # one warm start per regulator, in fp32 for bf16 weights
                assert state["regulate_v"].shape == (4, 4) and state["regulate_v.1"].shape[0] == 4, state
                assert {state[k].dtype for k in ("regulate_v", "regulate_v.1")} == {torch.float64 if dtype ==
                                                                                      torch.float64 else torch.float32}
        if manifold is not None:
            assert MatrixManifold.resolve(run["loaded_manifold"], case) == manifold, run["loaded_manifold"]
        if tiny:
            # the tiny gradient's matrix got a zero update (RowNormM: its rows under the eps floor) and
            # moved by the weight decay alone, (1 - lr wd)^4 of its start in float32: 4 steps, each a
            # rounded product and a rounded factor, <= 8 * 2^-24 = 4.8e-7 of its largest entry (1e-6:
            # twice that). The other matrix stepped: 4e-3 to 4e-2 past the decay (four lr-sized steps)
            decay = (1 - 0.01 * 0.1) ** (2 * RESUME_STEPS)
            tiny_start, other_start = (w.double() for w in _whole_case_points(dtype)[::-1])
            assert (run["one_process"][1].double() - decay * tiny_start).abs().max() <= 1e-6 * tiny_start.abs().max()
            assert (run["one_process"][0].double() - decay * other_start).abs().max() > 1e-3, case


@pytest.mark.parametrize("case, named", [("gradient_on_some_ranks", ["'b' (on 1 of 2 ranks)"]),
                                         ("no_gradient_on_one_rank", ["'a' (on 1 of 2 ranks)", "'b' (on 1 of 2 ranks)"])])
def test_a_gradient_on_some_ranks_only_is_refused_by_name_on_every_rank(runs, case, named):
    # p.grad None on rank 1 only: the ranks' norm all-reduces had differed in length, and both
    # waited until the process group's timeout (a timeout error, not a named refusal)
    ranks, _ = runs
    for r, results in enumerate(ranks):
        outcome = results[case]
        assert "ok" in outcome, (r, outcome)
        refused = outcome["ok"]["step"]
        assert refused.get("error") == "ValueError", (r, refused)
        for word in (*named, "some ranks only", "None on every rank"):
            assert word in refused["message"], (r, word, refused["message"])
        assert outcome["ok"]["moved"] == [False, False], (r, outcome)  # refused before any step
        # the same optimizer then steps a (b's gradient None on every rank: b stays)
        assert outcome["ok"]["after"] == [True, False], (r, outcome)


@pytest.mark.parametrize("case,first_step", [(case, first_step) for case, _, first_step in EXTRA_PARAMETER_CASES],
                         ids=[case for case, *_ in EXTRA_PARAMETER_CASES])
def test_a_parameter_more_on_one_rank_is_refused_by_name_on_every_rank_and_the_group_steps_once_dropped(
        runs, case, first_step):
    # rank 0's group had a third parameter: Muon's finiteness all-reduce (one entry per parameter)
    # ran before the options' comparison, and gloo aborted rank 1 on the longer vector (rank 0:
    # "Connection reset by peer"); with NCCL, a wait until the process group's timeout. ManifoldMuon's
    # first step gathered every weight for its manifold check before both, rank 0 one more: rank 0
    # waited until the process group's timeout ("Application timeout caused pair closure")
    ranks, _ = runs
    listed = ("rank 0: 'a' [6, 4] torch.float64, 'b' [6, 4] torch.float64, 'c' [6, 4] torch.float64, "
              "rank 1: 'a' [6, 4] torch.float64, 'b' [6, 4] torch.float64")
    for r, results in enumerate(ranks):
        outcome = results.get(case)
        assert outcome is not None and "ok" in outcome, (r, outcome)  # None: the rank died in a collective
        run = outcome["ok"]
        assert first_step or "ok" in run["first"], (r, run)  # the step before rank 0 appends c
        refused = run["extra"]
        assert refused.get("error") == "ValueError", (r, refused)
        assert f"param group 0 sharded parameters: {listed}" in refused["message"], (r, refused["message"])
        assert refused["seconds"] < PG_TIMEOUT / 2, (r, refused)
        assert run["moved"] == [False, False, False], (r, run["moved"])  # refused before any step
        # rank 0 dropped c again: the same group on both ranks steps (the parameters' text was
        # formatted again for the edit, and no rank was left in a collective)
        assert "ok" in run["dropped"], (r, run["dropped"])
        assert run["moved_after"] == [True, True, False], (r, run["moved_after"])


def test_a_state_dict_loaded_on_one_rank_is_checked_and_stepped_alike_on_every_rank(runs):
    # rank 0 alone had its weights pending the manifold check (and no replicas): it gathered them
    # while rank 1 went into the all-to-all, a wait until the process group's timeout. Now every
    # rank checks the weights any rank checks (and drops a replica any rank lacks). On Stiefel
    # the step is the one-process run's, bit for bit (each matrix alone in its batch on its owner,
    # as in test_an_owner_that_fails...: the same kernels on the same operands; the state rank 0
    # loaded is its own, so the same warm start); off it, every rank refuses both weights by name
    ranks, _ = runs
    plain = [torch.nn.Parameter(w) for w in _points()]
    one = _stiefel_muon(plain)
    for seed in (1, 2):
        for p, g in zip(plain, _gradients(seed=seed)):
            p.grad = g
        one.step()
    for r, results in enumerate(ranks):
        on = results.get("loaded_on_one_rank:1")
        assert on is not None and "ok" in on, (r, on)  # None: the rank died in a collective
        assert "ok" in on["ok"]["step"] and on["ok"]["moved"] == [True, True], (r, on)
        for sharded_weight, weight in zip(on["ok"]["weights"], plain):
            assert torch.equal(sharded_weight, weight.detach()), (r, (sharded_weight - weight).abs().max())
        _refused_off_their_manifold(r, results.get("loaded_on_one_rank:2"))


def _refused_off_their_manifold(r: int, off: dict | None) -> None:
    """Rank ``r``'s step of both weights pushed off Stiefel after rank 0 alone loaded a state dict:
    refused by name at the end of the step, neither weight moved (the rank checked both)."""
    from geomuon.optimizers.base import OffManifoldError

    assert off is not None and "ok" in off, (r, off)  # None: the rank died in a collective
    refused = off["ok"]["step"]
    assert refused.get("error") == OffManifoldError.__name__, (r, refused)  # at the end of the step, on each rank
    assert "off their manifold — 'a', 'b'" in refused["message"], (r, refused["message"])
    assert refused["seconds"] < PG_TIMEOUT / 2, (r, refused)
    assert off["ok"]["moved"] == [False, False], (r, off)


def test_an_override_of_pending_checks_answering_with_a_copy_keeps_every_rank_checking_alike(runs):
    # CopiedChecksMuon answers _pending_checks with a copy. The base had added the weights other
    # ranks check to the hook's answer itself (ManifoldMuon's live set): with a copy, rank 1 did not
    # check the weights rank 0 loaded, and went into the all-to-all while rank 0 gathered them (a
    # wait until the process group's timeout). The ranks' union now reaches the optimizer through
    # _add_checks, whatever _pending_checks returns
    ranks, _ = runs
    for r, results in enumerate(ranks):
        _refused_off_their_manifold(r, results.get("loaded_on_one_rank:copied_checks"))


@pytest.mark.parametrize("case, error, words", [
    ("unpaired", "NotImplementedError", ("UnpairedChecksMuon overrides _pending_checks", "define _add_checks(group")),
    ("short", "ValueError", ("ShortChecksMuon._pending_checks answered 1 flags for the 2 sharded parameters",
                             "one per parameter, in order"))])
def test_weight_check_hooks_out_of_contract_are_refused_by_name_on_every_rank(runs, case, error, words):
    # _pending_checks without _add_checks: a rank would have checked alone the weights it wants
    # checked (the others gathering nothing); an answer of the wrong length: zip had paired flags
    # with other weights. Both refused on every rank, quickly (no rank left in a collective), and
    # no weight moved, not even the earlier AdamW group's (refused in the step, it had stepped)
    ranks, _ = runs
    _refused_by_name(ranks, f"hooks:{case}", *words, error=error)
    assert [results[f"hooks:{case}:moved"] for results in ranks] == [[False, False, False]] * len(ranks)


def test_a_plain_gradient_on_one_rank_beside_a_sharded_parameter_is_refused_by_name_on_every_rank(runs):
    # rank 1, without w1's gradient, had not refused the group: it waited in the options'
    # all-reduce until the process group's timeout. The refusal is decided by requires_grad now
    ranks, _ = runs
    _refused_by_name(ranks, "plain_gradient_on_one_rank", "'w0' is a DTensor", "'w1' a plain tensor",
                     "param group of their own")


def test_a_sharded_weight_placed_otherwise_is_refused_by_name_on_every_rank_whichever_has_its_gradient(runs):
    # w0 Shard(1), its gradient on rank 0 only: rank 0 refused its placement, rank 1 (without that
    # gradient) waited in the options' all-reduce until the process group's timeout. A parameter's
    # placement is the model's, the same on every rank: refused there whether it has a gradient or not
    ranks, _ = runs
    _refused_by_name(ranks, "placement_gradient_on_one_rank", "parameter 'w0'", "Shard(dim=1)", "Shard(0)")
