r"""``geomuon study NAME [options]``: run one of the seed studies of
:mod:`geomuon.pretrain.studies` (its options: ``geomuon study NAME --help``)."""

from __future__ import annotations

import argparse

from . import STUDIES, STUDY_NAMES, common

__all__ = ["add_parser", "run"]


def add_parser(parser: argparse.ArgumentParser) -> None:
    """Fill the ``geomuon study`` parser: the study name, then the study's own options."""
    parser.description = ("Rerun one seed study at CPU scale (several seeds) and write its results page: "
                          + ", ".join(STUDY_NAMES))
    parser.add_argument("name", choices=STUDY_NAMES, help="which study")
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="the study's own options (--data, --size, --out, --publish, --jobs, ...; see "
                             "`geomuon study NAME --help`)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the named study; returns its exit code (2 for bad options)."""
    return common.main(STUDIES[args.name], list(args.options))
