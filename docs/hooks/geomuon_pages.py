"""MkDocs hook: the parts of pages that are generated from the code at build time.

Markers in the Markdown sources are replaced before conversion:

* ``<!-- geomuon:api PACKAGE -->`` becomes one mkdocstrings ``:::`` directive for the
  package and one per public module under it (found on disk, recursively), so a module
  added to a package appears in the API reference without editing the docs.
* ``<!-- geomuon:symmetry-table -->`` becomes the declared (update x group) table read
  from ``optimizers.symmetry`` -- the same rows the equivariance tests run -- so the
  page cannot disagree with the code.
"""

from __future__ import annotations

import logging
import pkgutil
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.geomuon_pages")

ROOT = Path(__file__).resolve().parents[2]
_API_MARKER = re.compile(r"^<!-- geomuon:api (?P<package>[\w.]+) -->$", re.MULTILINE)
_SYMMETRY_MARKER = "<!-- geomuon:symmetry-table -->"


def public_modules(package: str) -> list[tuple[str, bool]]:
    """``(dotted name, is_package)`` of the package and its public modules, found on disk
    (nothing is imported), each package before its modules."""
    directory = ROOT.joinpath(*package.split("."))
    if not (directory / "__init__.py").is_file():
        return []
    found = [(package, True)]
    for info in sorted(pkgutil.iter_modules([str(directory)]), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        child = f"{package}.{info.name}"
        found.extend(public_modules(child) if info.ispkg else [(child, False)])
    return found


def _api_section(match: re.Match) -> str:
    package = match.group("package")
    modules = public_modules(package)
    if not modules:
        # Packages land one by one; an absent one is shown as such rather than breaking
        # the build (tests/test_docs.py checks every existing public name is documented).
        log.info("API page: package %r has no __init__.py under %s yet", package, ROOT)
        return f'!!! note "Not written yet"\n    The package `{package}` has no modules yet.\n'
    blocks = []
    for module, is_package in modules:
        # A package shows only its docstring: what it re-exports is documented once, in
        # the module that defines it.
        options = "    options:\n      members: false\n      heading_level: 1\n" if is_package else ""
        blocks.append(f"::: {module}\n{options}")
    return "\n".join(blocks)


def symmetry_table_markdown() -> str:
    try:
        import optimizers.symmetry as symmetry
    except ModuleNotFoundError as error:
        # Only the module's own absence is tolerated (packages land one by one, and
        # tests/test_docs.py requires the table); a broken import inside it is an error.
        if error.name not in ("optimizers", "optimizers.symmetry"):
            raise
        log.info("symmetry table: optimizers.symmetry does not exist yet")
        return '!!! note "Not generated yet"\n    `optimizers/symmetry.py` does not exist yet.\n'
    return declared_table(symmetry)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _API_MARKER.sub(_api_section, markdown)
    if _SYMMETRY_MARKER in markdown:
        markdown = markdown.replace(_SYMMETRY_MARKER, symmetry_table_markdown())
    return markdown


def symmetry_rows(symmetry) -> list[tuple[str, ...]]:
    raise NotImplementedError("waiting for optimizers/symmetry.py")


def declared_table(symmetry) -> str:
    raise NotImplementedError("waiting for optimizers/symmetry.py")
