"""``geomuon check-equivariance``: check an update map or an optimizer against a symmetry group.

    geomuon check-equivariance my_updates:row_normalize --group left-perm-right-orth --shape 64x32
    geomuon check-equivariance my_optim:RowNormSGD --arg lr=0.05 --steps 3 --group left-perm-right-orth
    geomuon check-equivariance geomuon.optimizers:Muon --group bi-orthogonal --dtype float32 \\
        --compute-dtype bfloat16
    geomuon check-equivariance my_updates:row_normalize --group left-perm-right-orth --structured
    geomuon check-equivariance my_updates:row_normalize --group left-perm-right-orth --shape 3x64x32

``TARGET`` is ``module:attribute``; the module is looked up in the working directory first
(``my_updates.py`` next to you needs no ``PYTHONPATH``), then on the normal path. The
attribute is

* a map ``D -> U`` on ``[..., m, n]`` tensors (for ``--group neuron-permutation`` a SwiGLU
  triple ``(W_gate, W_up, W_down)`` to a triple), called with the ``--arg`` keywords;
* a ``torch.optim.Optimizer`` subclass, constructed as ``Class(params, **args)`` over fresh
  parameters and stepped ``--steps`` times from $W_0$ and from $g\\cdot W_0$ (weights moved
  by the group, gradients moved as the gradients of a loss with that symmetry);
* or a :class:`~geomuon.theory.equivariance.MapUpdate` / ``DirectionUpdate`` /
  ``OptimizerUpdate`` object.

It draws ``--trials`` adversarial inputs (seeded by ``--seed``, fresh and printed when not
given), prints one line per trial and the verdict with its explanation, and exits with

* 0 — holds (within the update's own round-off floor on every resolved trial);
* 1 — violated (far above the floor on some trial; the message names the trial, the group
  element, the seed and why the tolerance is what it is);
* 3 — inconclusive (between the floor and a clear violation, or too few resolved trials);
* 4 — the update raised or returned a non-finite output;
* 2 — a usage error (bad group, shape, dtype, import, argument).

With ``--expect violated`` (a negative control) 0 and 1 swap. The decision rule is
derived in :mod:`geomuon.theory.equivariance`.

``--structured`` declares the update single-valued at every input (ties, exact zeros, repeated
singular values, rank 0), which the check then judges with exact group elements
(``check_equivariance(structured=True)``); leave it out for an update that is set-valued there
(an SVD polar factor of a rank-deficient matrix). ``--shape BxMxN`` (any number of batch sizes
before ``M`` and ``N``: ``3x64x32``, ``2x4x64x32``) checks the update on a stack of matrices,
each member moved by its own group element, or by one for the whole stack with
``--batch-elements shared`` (an update that couples its members on purpose).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import inspect
import math
import os
import re
import shlex
import sys

import torch

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Declare the verb's arguments on ``parser`` and set :func:`run` as its action."""
    from geomuon.theory.equivariance import KINDS, MIN_TRIALS, SCALES
    from geomuon.theory.groups import GROUPS

    parser.description = __doc__.splitlines()[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "exit status: 0 holds, 1 violated, 3 inconclusive, 4 the update raised or returned NaN/inf, 2 usage"
    parser.add_argument("target", metavar="module:attribute", help="the update map or optimizer class to check")
    parser.add_argument("--group", required=True, help=f"one of {', '.join(GROUPS)}, or module:Class")
    parser.add_argument("--shape", default="6x4",
                        help="MxN (default 6x4), or BxMxN for a stack of B matrices (more batch sizes: 2x3xMxN)")
    parser.add_argument("--batch-elements", choices=("independent", "shared"), default=None,
                        help="with a batched --shape: one group element per member of the stack (independent, the "
                             "default: catches an update that mixes its members) or one for the whole stack (shared)")
    parser.add_argument("--structured", action="store_true",
                        help="declare the update single-valued at ties, exact zeros, repeated singular values and "
                             "rank 0, and judge those inputs too (not for an SVD polar factor, set-valued there)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float64", help="dtype of the inputs")
    parser.add_argument("--compute-dtype", choices=sorted(_DTYPES), default=None,
                        help="precision to hold, at most --dtype's (default --dtype): e.g. bfloat16 for an update "
                             "that computes in bf16 internally, so that 'holds' means equivariant up to bf16")
    parser.add_argument("--condition", type=float, default=1e3,
                        help="condition number of the 'conditioned' inputs (default 1e3)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh seed, printed)")
    parser.add_argument("--trials", type=int, default=40,
                        help=f"adversarial draws (default 40; at least {MIN_TRIALS} must be resolved to hold); "
                             f"inputs cycle through {', '.join(KINDS)} at scales {SCALES[0]:g}..{SCALES[-1]:g}")
    parser.add_argument("--expect", choices=("holds", "violated", "fails"), default="holds",
                        help="declared behaviour (violated = a negative control; fails is an alias)")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument of the map or the optimizer constructor (Python literal; repeatable)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per trajectory, for an optimizer class target (default 3; only "
                             "these steps are checked: an update that changes later, e.g. a preconditioner "
                             "refreshed every k steps, needs more)")
    parser.set_defaults(func=run)


@contextlib.contextmanager
def _working_folder_first():
    """The working directory first on ``sys.path`` for the command (as ``python -m`` puts it
    there), so a target module's neighbours import too (``my_optim.py`` importing
    ``my_updates.py``, at import time or inside the update); ``sys.path`` is restored after, for
    an in-process caller."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path[:] = saved


def _load(target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must be module:attribute, got {target!r}")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        stem = os.path.splitext(os.path.basename(module_name))[0]
        raise ValueError(f"target {target!r} names a file: give the module's name instead ({stem}:{attr}), "
                         "from the folder that holds it (it comes first on the import path)")
    try:
        obj = importlib.import_module(module_name)  # (the working directory first: _working_folder_first)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} (looked in {os.getcwd()} and on sys.path): "
                         f"{err}") from None
    except Exception as err:
        raise ValueError(f"importing module {module_name!r} raised {type(err).__name__}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj) and not hasattr(obj, "evaluate"):
        raise ValueError(f"{target!r} is neither a map, an optimizer class nor an update subject")
    return obj


def _shape(text: str) -> tuple[int, ...]:
    """``MxN`` or ``BxMxN`` (batch sizes before ``M`` and ``N``) as a tuple of ints."""
    sizes = re.split(r"\s*[xX]\s*", text.strip())
    if len(sizes) < 2 or not all(size.isdecimal() and int(size) >= 1 for size in sizes):
        raise ValueError(f"--shape must look like 8x5 (positive M and N), or 3x8x5 for a stack of 3, got {text!r}")
    return tuple(int(size) for size in sizes)


def _arguments(pairs: list[str]) -> dict:
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--arg must look like KEY=VALUE, got {pair!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value  # a bare word is a string
    return kwargs


def _check_keywords(obj, kwargs: dict, target: str) -> None:
    """Refuse ``--arg`` keywords that ``obj`` (a map called as ``obj(D, **kwargs)``, or an
    optimizer class as ``obj(params, **kwargs)``) does not take, or a required argument no ``--arg``
    gives, before any trial (they had failed every trial, exit 4)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without one: the trials will say
        return
    try:
        signature.bind(None, **kwargs)
    except TypeError as err:
        raise ValueError(f"--arg does not fit {target}: {err} (the first argument is the checked input; "
                         "give each other required one as --arg NAME=VALUE)") from None


def _check_constructor_values(optimizer: type, kwargs: dict, target: str, shape: tuple[int, ...],
                              dtype: torch.dtype) -> None:
    """Build ``optimizer(params, **kwargs)`` once over a parameter of the checked shape and dtype,
    before any trial, so that a value the constructor refuses (``--arg lr=-1``: "Learning rate
    should be >= 0") is a usage error, exit 2, as the module's exit codes say, not exit 4 ("the
    update raised") on trial 0. The parameter is on the ``meta`` device: nothing is allocated (a
    shape too large for the machine is the check's own refusal, naming ``--shape``, not a crash here)."""
    try:
        optimizer([torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))], **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--arg: {target} refused {', '.join(f'{k}={v!r}' for k, v in kwargs.items())}: "
                         f"{type(err).__name__}: {err}") from None


def _check_steps_a_stack(optimizer: type, kwargs: dict, target: str, shape: tuple[int, ...],
                         dtype: torch.dtype) -> None:
    """One step of ``optimizer(params, **kwargs)`` on a zero parameter of a batched ``shape`` (a
    zero gradient), before any trial: an optimizer class is checked on one parameter of that
    shape, and one that steps only matrices (Muon's default ``matrix_view="strict"``) is a
    usage error naming ``--shape``, exit 2, not exit 4 ("the update raised") on trial 0."""
    # a stack of one member per batch dimension: stepping it says the same, at one matrix's memory
    param = torch.nn.Parameter(torch.zeros((1,) * (len(shape) - 2) + shape[-2:], dtype=dtype))
    param.grad = torch.zeros_like(param)
    try:
        optimizer([param], **kwargs).step()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"--shape {'x'.join(map(str, shape))}: {target} is checked on one parameter of that shape "
                         f"and cannot step it ({type(err).__name__}: {err}); give --shape MxN, or an option that "
                         "steps a stack of matrices (geomuon's optimizers: --arg matrix_view=batch)") from None


def _subject(obj, kwargs: dict, steps: int, target: str, shape: tuple[int, ...], dtype: torch.dtype):
    from geomuon.theory.equivariance import MapUpdate, OptimizerUpdate

    name = target.partition(":")[2]
    if not hasattr(obj, "evaluate"):
        _check_keywords(obj, kwargs, target)
    if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
        if kwargs:
            _check_constructor_values(obj, kwargs, target, shape, dtype)
        if len(shape) > 2:
            _check_steps_a_stack(obj, kwargs, target, shape, dtype)
        label = name + (f"({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})" if kwargs else "")
        return OptimizerUpdate(lambda params: obj(params, **kwargs), name=label, steps=steps)
    if hasattr(obj, "evaluate"):
        if kwargs:
            raise ValueError("--arg applies to maps and optimizer classes, not to an update subject")
        return obj
    return MapUpdate(functools.partial(obj, **kwargs) if kwargs else obj, name=name)


def _replay_command(args: argparse.Namespace, seed: int) -> str:
    """The shell command that reruns this check: every option that changes it, each word quoted
    for a POSIX shell (``--arg 'factors=(2.0, 3.0)'`` had been printed bare, a syntax error in
    bash) and ``--condition`` to its last digit (``{:g}`` had printed 1234567 as 1.23457e+06,
    so the "replay" drew other conditioned inputs)."""
    words = ["geomuon", "check-equivariance", args.target, "--group", args.group, "--shape", args.shape,
             "--dtype", args.dtype, "--condition", repr(args.condition), "--trials", str(args.trials)]
    for pair in args.arg:
        words += ["--arg", pair]
    if args.steps:
        words += ["--steps", str(args.steps)]
    if args.compute_dtype:
        words += ["--compute-dtype", args.compute_dtype]
    if args.expect != "holds":
        words += ["--expect", args.expect]
    if args.structured:
        words.append("--structured")
    if args.batch_elements:
        words += ["--batch-elements", args.batch_elements]
    return shlex.join(words + ["--seed", str(seed)])


def run(args: argparse.Namespace) -> int:
    """Check ``args.target`` against ``args.group``; return the exit code (0, 1, 2, 3 or 4)."""
    with _working_folder_first():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from geomuon.theory.equivariance import EXIT_CODES, check_equivariance, finer_precision  # lazy: --help stays fast

    from geomuon.theory.groups import get_group

    try:
        shape = _shape(args.shape)
        if args.trials < 1:
            raise ValueError(f"--trials must be >= 1, got {args.trials}")
        if not 1.0 <= args.condition < math.inf:  # inf had built all-NaN inputs, blamed on the map
            raise ValueError(f"--condition must be a finite number >= 1, got {args.condition}")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        if args.batch_elements and len(shape) == 2:  # else ignored, yet echoed in the replay line
            raise ValueError(f"--batch-elements applies to a batched --shape (BxMxN: 3x{args.shape.strip()}), "
                             f"not to {args.shape.strip()}")
        if args.compute_dtype and finer_precision(_DTYPES[args.compute_dtype], _DTYPES[args.dtype]):
            # check_equivariance refuses it too, but by its parameters' names, not the flags: a finer
            # stated precision than the inputs' asks the map to hold more than its inputs carry
            raise ValueError(f"--compute-dtype {args.compute_dtype} is finer than --dtype {args.dtype}; the "
                             "precision to hold is at most the inputs' (leave it out to hold --dtype's)")
        kwargs = _arguments(args.arg)
        target = _load(args.target)
        optimizer = isinstance(target, type) and issubclass(target, torch.optim.Optimizer)
        if args.steps is not None and not optimizer:  # it had been ignored, and echoed in the replay line
            raise ValueError(f"--steps applies to an optimizer class, not to {args.target}")
        subject = _subject(target, kwargs, 3 if args.steps is None else args.steps, args.target, shape,
                           _DTYPES[args.dtype])
        # after the target: a group its module registers has a name now
        group = get_group(args.group, importer=importlib.import_module)
    except ValueError as err:
        print(f"geomuon check-equivariance: error: {err}", file=sys.stderr)
        return 2
    expect = "violated" if args.expect == "fails" else args.expect
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        # Checks run many small evaluations: a second thread only spins (measured: 5.9 s of
        # CPU for a 64x32 check with 2 threads on a busy machine, 2.3 s with one).
        torch.set_num_threads(1)
    try:
        report = check_equivariance(
            subject, group, shape, trials=args.trials, expect=expect, dtype=_DTYPES[args.dtype],
            compute_dtype=_DTYPES[args.compute_dtype] if args.compute_dtype else None, condition=args.condition,
            seed=args.seed, structured=args.structured, batch_elements=args.batch_elements or "independent",
        )
    except (TypeError, ValueError) as err:
        # the check's inputs (a seed out of range, a group whose sample fails, a target that is
        # no update subject): a usage error, not exit 1, which a CI job reads as "violated"
        print(f"geomuon check-equivariance: error: {err}", file=sys.stderr)
        return 2
    finally:  # called in-process (tests, notebooks): leave the caller's thread count as it was
        torch.set_num_threads(threads)
    print(report.table())
    print(f"replay: {_replay_command(args, report.seed)}")
    if expect == "violated" and report.verdict in ("holds", "violated"):
        print(f"expected violated: {'as declared' if report.verdict == 'violated' else 'NOT observed'}")
        return EXIT_CODES["holds"] if report.verdict == "violated" else EXIT_CODES["violated"]
    return report.exit_code
