"""``python -m geomuon``: the ``geomuon`` command."""

from geomuon.cli import main

raise SystemExit(main())
