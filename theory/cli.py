"""``geomuon check-equivariance``: check a user's update map against a symmetry group.

    geomuon check-equivariance mypkg.updates:my_map --group bi-orthogonal --shape 8x5

imports ``my_map`` (a function ``D -> U`` on ``[..., m, n]`` tensors; for
``--group neuron-permutation`` it maps a SwiGLU triple ``(W_gate, W_up, W_down)`` to a
triple), draws random float64 inputs of condition number ``--condition`` and random group
elements, prints the residual table and exits 1 when the declared behaviour (``--expect``,
default ``holds``) is not observed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

import torch

from geomuon.theory.equivariance import MUST_FAIL_RESIDUAL, check_equivariance
from geomuon.theory.groups import GROUPS, get_group

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Declare the verb's arguments on ``parser`` and set :func:`run` as its action."""
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("target", metavar="module:function", help="the update map to check")
    parser.add_argument("--group", required=True, help=f"one of {', '.join(sorted(GROUPS))}")
    parser.add_argument("--shape", default="6x4", help="MxN (default 6x4)")
    parser.add_argument("--trials", type=int, default=8, help="random draws (default 8)")
    parser.add_argument("--expect", choices=("holds", "fails"), default="holds")
    parser.add_argument("--condition", type=float, default=100.0,
                        help="condition number of the random inputs (default 100)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float64")
    parser.add_argument("--tol", type=float, default=None,
                        help="fixed tolerance (default: derived from dtype and conditioning)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def _load(target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must be module:function, got {target!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target!r} is not callable")
    return obj


def _shape(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"--shape must look like 8x5 (positive M and N), got {text!r}")
    return int(match[1]), int(match[2])


def run(args: argparse.Namespace) -> int:
    """Check ``args.target`` against ``args.group``; return the exit code (0, 1 or 2)."""
    try:
        update = _load(args.target)
        group = get_group(args.group)
        shape = _shape(args.shape)
        if args.trials < 1:
            raise ValueError(f"--trials must be >= 1, got {args.trials}")
        if not args.condition >= 1.0:
            raise ValueError(f"--condition must be >= 1, got {args.condition}")
    except ValueError as err:
        print(f"geomuon check-equivariance: error: {err}", file=sys.stderr)
        return 2
    report = check_equivariance(
        update, group, shape, trials=args.trials, expect=args.expect, dtype=_DTYPES[args.dtype],
        condition=args.condition, tol=args.tol, generator=torch.Generator().manual_seed(args.seed),
    )
    print(report.table())
    if not report.passed:
        if args.expect == "holds":
            print(f"{report.update} is NOT equivariant under {group.name}: a residual exceeds its tolerance")
        else:
            print(f"{report.update} showed no residual >= {MUST_FAIL_RESIDUAL:g} under {group.name}")
    return 0 if report.passed else 1
