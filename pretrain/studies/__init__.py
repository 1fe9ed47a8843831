r"""``geomuon study NAME``: run one of the seed studies of ``bench/studies/`` and write its
results page under ``docs/results/``.

The studies are not library code: they live with the other benchmark scripts in
``bench/`` and write into the documentation of a source checkout, so this verb is a thin
dispatcher. It locates the checkout as the directory holding ``geomuon/cli.py`` (an
editable install, ``make setup``, keeps it there), puts that directory on ``sys.path``
and imports ``bench.studies.<NAME>``; from a plain wheel install, which has neither
``bench/`` nor ``docs/``, it says so instead of failing on an import.

Equivalent without the console script, from the repository root:
``python -m bench.studies.NAME [options]``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

STUDY_NAMES = ("manifolds", "lipschitz", "symmetry")


def checkout_root() -> Path:
    """The source checkout this package runs from (``ValueError`` if there is none)."""
    from geomuon import cli as geomuon_cli

    root = Path(geomuon_cli.__file__).resolve().parents[1]
    if not (root / "bench" / "studies" / "common.py").is_file():
        raise ValueError(
            f"geomuon study needs a source checkout (bench/studies/ under {root} "
            "is missing): clone the repository and run `make setup` there"
        )
    return root


def load_study(name: str):
    """The study module ``bench.studies.<name>`` of the checkout."""
    if name not in STUDY_NAMES:
        raise ValueError(f"unknown study {name!r}; choose one of {', '.join(STUDY_NAMES)}")
    root = str(checkout_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"bench.studies.{name}")


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Fill the ``geomuon study`` parser: the study name, then the study's own options."""
    parser.description = ("Rerun one seed study at CPU scale (several seeds) and write its results page: "
                          + ", ".join(STUDY_NAMES))
    parser.add_argument("name", choices=STUDY_NAMES, help="which study")
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="the study's own options (--size, --data, --out, --jobs, ...; see "
                             "`geomuon study NAME --help`)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the named study; returns its exit code (2 when there is no source checkout)."""
    try:
        study = load_study(args.name)
    except ValueError as err:
        print(f"geomuon study: {err}", file=sys.stderr)
        return 2
    from bench.studies import common

    return common.main(study, list(args.options))
