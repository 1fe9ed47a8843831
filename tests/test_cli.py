"""The ``geomuon`` command's own options (each verb is tested beside its code)."""

import pytest

from geomuon import __version__
from geomuon.cli import main


def test_version_prints_the_installed_version_and_exits_0(capsys):
    # `geomuon --version` had been "the following arguments are required: VERB", exit 2
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"geomuon {__version__}"


def test_a_missing_verb_is_still_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "VERB" in capsys.readouterr().err
