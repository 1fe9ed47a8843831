"""The ``geomuon`` command line: one verb per sub-command, each implemented next to its code.

A verb is registered in :data:`VERBS` as ``name -> "module:function"``; the function
receives the sub-parser to fill in and must set ``func`` (the callable run with the parsed
arguments, returning an exit code) through ``parser.set_defaults``. Modules are imported
only when their verb is used, so ``geomuon info`` does not pay for the training stack.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

VERBS: dict[str, tuple[str, str]] = {
    "info": ("geomuon.cli:add_info_parser", "print versions, manifolds and optimizers"),
    "check-equivariance": ("geomuon.theory.cli:add_parser", "check an update map against a symmetry group"),
    "pretrain": ("geomuon.pretrain.train:add_parser", "pretrain a GPT with a per-module strategy"),
    "compare": ("geomuon.pretrain.compare:add_parser", "compare strategies: results table and plots"),
    "study": ("geomuon.pretrain.studies.command:add_parser", "rerun a seed study and write its results page"),
}


def add_info_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=run_info)


# Base classes users subclass; `info` lists what can be used as is.
_BASE_CLASSES = {"MatrixManifold", "MatrixOptimizer"}


def _public_subclasses(module_name: str, base: type) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", dir(module))
    return sorted(
        name
        for name in names
        if isinstance(getattr(module, name, None), type)
        and issubclass(getattr(module, name), base)
        and name not in _BASE_CLASSES
    )


def run_info(args: argparse.Namespace) -> int:
    from importlib.metadata import PackageNotFoundError, version

    import geoopt
    import torch

    for dist in ("geomuon", "torch", "geoopt", "numpy", "sympy"):
        try:
            print(f"{dist:10s} {version(dist)}")
        except PackageNotFoundError:
            print(f"{dist:10s} (not installed)")
    print(f"{'cuda':10s} {'available' if torch.cuda.is_available() else 'not available'}")
    print("manifolds: " + ", ".join(_public_subclasses("geomuon.manifolds", geoopt.Manifold)))
    print("optimizers: " + ", ".join(_public_subclasses("geomuon.optimizers", torch.optim.Optimizer)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from geomuon import __version__

    parser = argparse.ArgumentParser(prog="geomuon", description=__doc__.splitlines()[0])
    # what a bug report or a CI log names first (`geomuon info` adds torch's and the others')
    parser.add_argument("--version", action="version", version=f"geomuon {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (target, help_text) in VERBS.items():
        # add_help=False: `geomuon VERB --help` must reach the verb's own parser (second pass)
        sub_parser = sub.add_parser(name, help=help_text, add_help=False)
        module_name, func_name = target.split(":")
        sub_parser.set_defaults(_target=(module_name, func_name))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # First pass finds the verb; its module then defines the verb's own arguments.
    known, _ = parser.parse_known_args(argv)
    module_name, func_name = known._target
    verb_parser = argparse.ArgumentParser(prog=f"geomuon {known.verb}")
    getattr(importlib.import_module(module_name), func_name)(verb_parser)
    args = verb_parser.parse_args(argv[argv.index(known.verb) + 1 :])
    return int(args.func(args) or 0)


def entry() -> None:
    """The ``geomuon`` command (and ``python -m geomuon``): :func:`main` on ``sys.argv``, then exit
    with its status.

    A process of a torchrun job (``WORLD_SIZE`` > 1) leaves with ``os._exit`` once its output is
    flushed (every file of the run is written and closed by then): the trained model holds the
    gloo process group, whose worker thread can still be releasing the last collective's
    tensors when the interpreter finalizes, and a thread that needs the GIL then aborts the
    process ("terminate called without an active exception", SIGABRT after ``done``; 3 of 34
    two-process CPU runs on a busy machine), which torchrun reports as a failed job."""
    code = main()
    if os.environ.get("WORLD_SIZE", "1") != "1":  # (a malformed value was refused by name in main)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
