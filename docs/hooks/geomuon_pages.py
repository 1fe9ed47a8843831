"""MkDocs hook: the parts of pages that are generated from the code at build time.

Markers in the Markdown sources are replaced before conversion:

* ``<!-- geomuon:api PACKAGE -->`` becomes one mkdocstrings ``:::`` directive for the
  package and one per public module under it (found on disk, recursively), so a module
  added to a package appears in the API reference without editing the docs.
* ``<!-- geomuon:symmetry-table -->`` becomes the declared (update x group) table read
  from ``geomuon.theory.declared.declarations()`` -- the rows the equivariance suite runs --
  so the page cannot disagree with the code or the tests.
* ``<!-- geomuon:results-pages -->`` becomes the list of the results pages the studies
  have written under ``docs/results/`` (``geomuon study NAME``), which are also added to
  the navigation under *Results* -- a study's page appears without editing the docs.
* ``<!-- geomuon:benchmark NAME -->`` becomes the table that ``bench/NAME.py --markdown``
  wrote to ``docs/results/benchmarks/NAME.md`` (with the header saying how it was
  produced), or a line saying it is not yet measured and which command writes it;
  ``<!-- geomuon:benchmark NAME FILE -->`` includes ``FILE.md``, another table of the
  same script (e.g. ``optimizer_step optimizer_step_gpt2_small``: other settings). The
  files themselves are excluded from the site (``exclude_docs``): they are parts of the
  results page, not pages.
"""

from __future__ import annotations

import html
import logging
import pkgutil
import re
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

log = logging.getLogger("mkdocs.hooks.geomuon_pages")

ROOT = Path(__file__).resolve().parents[2]
_API_MARKER = re.compile(r"^<!-- geomuon:api (?P<package>[\w.]+) -->$", re.MULTILINE)
_SYMMETRY_MARKER = "<!-- geomuon:symmetry-table -->"
_RESULTS_MARKER = "<!-- geomuon:results-pages -->"
_RESULTS_LANDING = "results/index.md"
_BENCHMARK_MARKER = re.compile(r"^<!-- geomuon:benchmark (?P<name>\w+)(?: (?P<file>\w+))? -->$", re.MULTILINE)
BENCHMARKS = Path("results") / "benchmarks"  # relative to docs/


def public_modules(package: str) -> list[tuple[str, bool]]:
    """``(dotted name, is_package)`` of the package and its public modules, found on disk
    (nothing is imported), each package before its modules."""
    # geomuon.X lives in the repository's top-level X/ (pyproject.toml's package-dir)
    parts = package.split(".")
    directory = ROOT.joinpath(*(parts[1:] if parts[0] == "geomuon" else parts))
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
_ORIENTATION = {"any": "", "tall": ", tall m ≥ n", "wide": ", wide m < n"}


def symmetry_rows(symmetry) -> list[tuple[str, str, str, str]]:
    """``(update (kind), group, expected, rationale)`` as displayed, one per declaration of
    the ``geomuon.theory.declared`` module given."""
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
    """The declared table as an HTML block: the names are escaped text, a rationale is
    Markdown (its formulas ``$...$`` render as the page's own).

    An HTML table rather than a Markdown one, so that a ``|`` in a formula cannot end its
    cell; ``md_in_html`` parses the rationale's cell (``markdown="span"``) only when every
    element around it asks for Markdown too (``markdown="1"``)."""
    header = "".join(f"<th>{name}</th>" for name in ("update (kind)", "group", "equivariance", "why"))
    body = "\n".join(
        '<tr markdown="1">' + "".join(f"<td>{html.escape(cell)}</td>" for cell in names)
        + f'<td markdown="span">{rationale}</td></tr>'
        for *names, rationale in symmetry_rows(symmetry)
    )
    return (
        f'<div class="geomuon-declared" markdown="1">\n<table markdown="1">\n<thead><tr>{header}</tr></thead>\n'
        f'<tbody markdown="1">\n{body}\n</tbody>\n</table>\n</div>\n'
    )


def results_pages(docs_dir: Path) -> list[tuple[str, str]]:
    """``(title, path relative to docs/)`` of every results page but the landing page,
    sorted by path; the title is the page's first ``# `` heading."""
    pages = []
    for path in sorted((docs_dir / "results").glob("*.md")):
        relative = path.relative_to(docs_dir).as_posix()
        if relative == _RESULTS_LANDING:
            continue
        heading = re.search(r"^# (.+)$", path.read_text(), re.MULTILINE)
        pages.append((heading.group(1).strip() if heading else path.stem, relative))
    return pages


def package_view(target: Path) -> Path:
    """A folder under ``target`` laid out as the installed ``geomuon`` package, so griffe
    (which finds modules by their files) reads ``geomuon.manifolds`` from ``manifolds/``.

    From ``pyproject.toml``'s ``[tool.setuptools.package-dir]``: a package that holds other
    mapped packages (``geomuon``) becomes a real folder with copies of its own modules, so
    nothing is ever written into the checkout (griffe resolves symlinked files to their
    folder, so they cannot be links); every other package is a symlink to its folder.
    """
    with open(ROOT / "pyproject.toml", "rb") as handle:
        mapping = tomllib.load(handle)["tool"]["setuptools"]["package-dir"]
    parents = {package.rpartition(".")[0] for package in mapping}
    for package, folder in sorted(mapping.items()):  # parents before their subpackages
        view = target.joinpath(*package.split("."))
        if package in parents:
            view.mkdir(parents=True, exist_ok=True)
            for module in (ROOT / folder).glob("*.py"):
                shutil.copy2(module, view / module.name)
        elif not view.exists():
            view.symlink_to(ROOT / folder, target_is_directory=True)
    return target


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    view = package_view(Path(tempfile.mkdtemp(prefix="geomuon-docs-")))
    config.plugins["mkdocstrings"].config.handlers["python"]["paths"] = [str(view)]
    return add_results_to_nav(config)


def add_results_to_nav(config):
    """Turn the nav entry of the results landing page into a section (returns ``config``)."""
    # Turn the nav entry of the results landing page into a section holding the landing
    # page and every study page found on disk.
    studies = [{title: relative} for title, relative in results_pages(Path(config.docs_dir))]
    for index, entry in enumerate(config.nav or []):
        if isinstance(entry, dict) and list(entry.values()) == [_RESULTS_LANDING]:
            title = next(iter(entry))
            config.nav[index] = {title: [{"Overview": _RESULTS_LANDING}, *studies]} if studies else entry
    return config


def _results_list(docs_dir: Path) -> str:
    pages = results_pages(docs_dir)
    if not pages:
        return "*No study has written its page yet.*\n"
    # Links are relative to results/index.md, which holds the marker.
    return "".join(f"* [{title}]({Path(relative).name})\n" for title, relative in pages)


def benchmark_table(docs_dir: Path, name: str, file: str | None = None) -> str:
    """The Markdown that ``bench/<name>.py --markdown`` wrote under ``docs/results/benchmarks/``
    (as ``<file>.md``, default ``<name>.md``), or a *not yet measured* line naming the
    command that writes it."""
    if not (ROOT / "bench" / f"{name}.py").is_file():
        log.warning("benchmark marker names %r, but there is no bench/%s.py", name, name)
        return ""
    path = docs_dir / BENCHMARKS / f"{file or name}.md"
    if not path.is_file():
        target = (BENCHMARKS / f"{file or name}.md").as_posix()
        return f"*Not yet measured:* `python bench/{name}.py --markdown docs/{target}` writes this table.\n"
    return path.read_text()


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _API_MARKER.sub(_api_section, markdown)
    docs_dir = Path(config.docs_dir)
    markdown = _BENCHMARK_MARKER.sub(lambda match: benchmark_table(docs_dir, match.group("name"), match.group("file")), markdown)
    if _RESULTS_MARKER in markdown:
        markdown = markdown.replace(_RESULTS_MARKER, _results_list(docs_dir))
    if _SYMMETRY_MARKER in markdown:
        import geomuon.theory.declared

        markdown = markdown.replace(_SYMMETRY_MARKER, declared_table(geomuon.theory.declared))
    return markdown
