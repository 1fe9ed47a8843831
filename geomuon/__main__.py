"""``python -m geomuon``: the ``geomuon`` command."""

from geomuon.cli import entry

entry()
