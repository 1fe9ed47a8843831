"""MkDocs hook: the parts of pages that are generated from the code at build time.

Markers in the Markdown sources are replaced before conversion:

* ``<!-- geomuon:api PACKAGE -->`` becomes one mkdocstrings ``:::`` directive for the
  package and one per public module under it (found on disk, recursively), so a module
  added to a package appears in the API reference without editing the docs.
* ``<!-- geomuon:symmetry-table -->`` becomes the declared (update x group) table read
  from ``optimizers.symmetry.declarations()`` -- the rows the equivariance suite runs --
  so the page cannot disagree with the code or the tests.
"""

from __future__ import annotations

import html
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
        log.warning("API page: package %r not found under %s", package, ROOT)
        return ""
    blocks = []
    for module, is_package in modules:
        # A package shows only its docstring: what it re-exports is documented once, in
        # the module that defines it.
        options = "    options:\n      members: false\n      heading_level: 1\n" if is_package else ""
        blocks.append(f"::: {module}\n{options}")
    return "\n".join(blocks)


_EXPECTED = {"holds": "holds", "fails": "fails (negative control)"}
_ORIENTATION = {"any": "", "tall": ", tall m ≥ n", "wide": ", wide m ≤ n"}


def symmetry_rows(symmetry) -> list[tuple[str, str, str, str]]:
    """``(update (kind), group, expected, rationale)`` as displayed, one per declaration of
    the ``optimizers.symmetry`` module given."""
    return [
        (
            f"{declaration.update} ({declaration.kind}){_ORIENTATION[declaration.orientation]}",
            declaration.group.name,
            _EXPECTED[declaration.expected],
            declaration.rationale,
        )
        for declaration in symmetry.declarations()
    ]


def declared_table(symmetry) -> str:
    """The declared table as an HTML block: the rationales hold characters (``*``, ``_``,
    ``|``) that Markdown would read as markup."""
    header = ("update (kind)", "group", "equivariance", "why")

    def cells(row, tag):
        return "".join(f"<{tag}>{html.escape(cell)}</{tag}>" for cell in row)

    body = "\n".join(f"<tr>{cells(row, 'td')}</tr>" for row in symmetry_rows(symmetry))
    return (
        f'<div class="geomuon-declared">\n<table>\n<thead><tr>{cells(header, "th")}</tr></thead>\n'
        f"<tbody>\n{body}\n</tbody>\n</table>\n</div>\n"
    )


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _API_MARKER.sub(_api_section, markdown)
    if _SYMMETRY_MARKER in markdown:
        import optimizers.symmetry

        markdown = markdown.replace(_SYMMETRY_MARKER, declared_table(optimizers.symmetry))
    return markdown
