"""The documentation site: strict build, offline math, complete API reference, working
links, and the rendered pages looked at in a real browser (headless Chromium).

The site is built once per session into a temporary directory with
``mkdocs build --strict`` (any warning -- a broken link, an unrendered formula, a missing
page -- fails the build). The browser tests need Debian's ``chromium``: under ``CI=true`` a
missing browser is a failure, elsewhere the tests skip and say what to install.
Screenshots go to ``$GEOMUON_DOCS_SCREENSHOTS`` (default: a pytest temporary directory;
each browser test prints its path, shown with ``pytest -s``).
"""

from __future__ import annotations

import ast
import dataclasses
import html
import html.parser
import importlib
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("geomuon.manifolds", "geomuon.optimizers", "geomuon.theory", "geomuon.pretrain")


def _page(package: str) -> str:
    """The API page of a subpackage: docs/api/manifolds.md documents geomuon.manifolds."""
    return package.rsplit(".", 1)[-1]
CONCEPT_PAGES = ("manifolds", "steepest-descent", "symmetry", "lipschitz")

sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import geomuon_mathml  # noqa: E402  (the hooks under test; imported, not copied)
import geomuon_pages  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return site_dir


class _VisibleText(html.parser.HTMLParser):
    """Text a reader sees: skips code, scripts, styles and MathML's TeX annotations."""

    HIDDEN = {"script", "style", "code", "pre", "annotation", "template"}

    def __init__(self):
        super().__init__()
        self.depth = 0
        self.chunks: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in self.HIDDEN:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.HIDDEN and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.chunks.append(data)


def visible_text(page_html: str) -> str:
    parser = _VisibleText()
    parser.feed(page_html)
    return "".join(parser.chunks)


RAW_MATH = re.compile(r"\$\$|\\\(|\\\)|\\\[|\\\]|\$[^$\s][^$]*\$")
# A formula cut open shows one "$" (not a price) and its commands as text: a "|" inside math
# in a Markdown table row ends the cell there, and the rest of the formula went to the next
# cells (certificates.md had shown "so $\max" and "\text{GELU}'").
STRAY_MATH = re.compile(r"\$(?!\d)|\\[A-Za-z]{2,}")
# Defects the converter lets through silently, in the MathML: "\operatorname{row\_norm}"
# (a name that is not all letters) comes out as an empty <mo/> before italic letters spaced as
# a product; a control character in the TeX source is an escape Python read in a docstring
# that is not raw ("\t" of "\times": the formula showed "m imes n"); a formula that is only a
# bar is half of an absolute value or norm whose bars were written as two formulas around
# plain text (pretrain/monitoring.py's "$|$activation$|$").
SILENT_MATH = re.compile(r"<mo\s*/>|<mo></mo>|<math alttext=\"[^\"]*[\x00-\x09\x0b-\x1f\x7f]"
                         r"|<math alttext=\"\s*(?:\\?\||\\[lr]?[vV]ert)\s*\"")


def assert_math_rendered(page_html: str, where: str) -> None:
    text = visible_text(page_html)
    for pattern in (RAW_MATH, STRAY_MATH):
        leftover = pattern.search(text)
        assert leftover is None, f"{where}: raw LaTeX left in the text: ...{text[max(0, leftover.start() - 80):leftover.end() + 80]}..."
    assert 'class="arithmatex"' not in page_html, f"{where}: a formula was not converted to MathML"
    wrong = SILENT_MATH.search(page_html)
    assert wrong is None, f"{where}: a formula renders wrong: {html.unescape(page_html[wrong.start():wrong.start() + 300])!r}"


def test_concept_pages_have_mathml_and_no_raw_latex(site):
    for name in CONCEPT_PAGES:
        page = (site / "concepts" / f"{name}.html").read_text()
        # Each concept page is built around its formulas; a handful means rendering ran.
        assert page.count("<math") >= 10, f"concepts/{name}: only {page.count('<math')} formulas"
        assert_math_rendered(page, f"concepts/{name}")


def test_every_page_renders_its_math(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 14
    for page in pages:
        assert_math_rendered(page.read_text(), str(page.relative_to(site)))


def test_docstring_math_renders_in_api_reference(site):
    # geomuon.manifolds.linalg.NSSchedule's docstring carries a display formula ($$ ... $$).
    page = (site / "api" / "manifolds.html").read_text()
    start = page.index('id="geomuon.manifolds.linalg.NSSchedule"')
    docstring = page[start : page.index('id="geomuon.manifolds.linalg.NSSchedule.name"')]
    assert re.search(r'<math [^>]*display="block"', docstring)


def test_site_fetches_nothing_from_the_network(site):
    external = re.compile(r"""(?:src|href)=["']https?://|@import\s+url\(["']?https?://|url\(["']?https?://""")
    for path in list(site.rglob("*.html")) + list(site.rglob("*.css")):
        text = path.read_text(errors="replace")
        for match in external.finditer(text):
            context = text[match.start() : match.start() + 120]
            # Outbound hyperlinks (<a href>) are fine: they are not loaded to view the page.
            if re.search(r"<a\s[^>]*$", text[max(0, match.start() - 300) : match.start()]):
                continue
            raise AssertionError(f"{path.relative_to(site)} loads {context!r}")


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if "id" in attributes:
            self.ids.add(attributes["id"])
        if tag == "a" and attributes.get("name"):
            self.ids.add(attributes["name"])
        for key in ("href", "src"):
            if attributes.get(key):
                self.links.append(attributes[key])


def test_no_broken_internal_links(site):
    parsed = {}
    for path in site.rglob("*.html"):
        parser = _Links()
        parser.feed(path.read_text())
        parsed[path.resolve()] = parser
    broken = []
    for path, parser in parsed.items():
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//") or link.startswith("mailto:"):
                continue
            if not parts.path:
                target = path
            elif parts.path.startswith("/"):  # root-relative (the 404 page's links)
                target = (site / unquote(parts.path).lstrip("/")).resolve()
            else:
                target = (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site.resolve())}: {link}")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in parsed[target].ids:
                    broken.append(f"{path.relative_to(site.resolve())}: {link} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(sorted(broken))


def _public_objects(module_name: str):
    """(name, object) for the module's public classes and functions defined in it."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    for name in names:
        obj = getattr(module, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module_name:
            yield name, obj


def _own_docstring(obj) -> str | None:
    """The docstring written for ``obj`` itself, as griffe reads it from the source: not one
    inherited from a base class, nor the signature ``dataclass`` puts there when none is."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if doc and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None
    return doc.strip() if doc else None


def _api_entry(site, name: str) -> str:
    """The HTML of ``name``'s entry on the built ``api/manifolds.html``: from its ``id`` to the
    next object's."""
    page = (site / "api" / "manifolds.html").read_text()
    start = page.index(f'id="{name}"')
    return page[start:page.index('<div class="doc doc-object', start)]


def test_docstring_roles_link_to_the_objects_they_name(site):
    # :func:`msign` in geomuon.manifolds.stiefel.Stiefel's docstring is a link to msign's entry
    # (the hook had matched ids "manifolds...." while mkdocstrings writes "geomuon.manifolds....":
    # every role had fallen back to plain code).
    entry = _api_entry(site, "geomuon.manifolds.stiefel.Stiefel")
    assert 'title="geomuon.manifolds.linalg.msign"' in entry


def test_attribute_comments_show_in_the_api_reference(site):
    # KELLER_QUINTIC is documented by a "#:" comment above it; griffe alone shows it empty.
    entry = _api_entry(site, "geomuon.manifolds.linalg.KELLER_QUINTIC")
    assert "Keller Jordan" in entry


def test_api_reference_documents_every_public_class_and_function(site):
    undocumented, missing_docstring, checked = [], [], 0
    for package in PACKAGES:
        modules = geomuon_pages.public_modules(package)
        assert modules, f"package {package} not found"
        page = (site / "api" / f"{_page(package)}.html").read_text()
        for module_name, _ in modules:
            for name, obj in _public_objects(module_name):
                checked += 1
                anchor = f'id="{module_name}.{name}"'
                if anchor not in page:
                    undocumented.append(f"{module_name}.{name}")
                elif not _own_docstring(obj):
                    missing_docstring.append(f"{module_name}.{name}")
    assert checked >= 5
    assert not undocumented, f"absent from the API reference: {undocumented}"
    assert not missing_docstring, f"public objects without a docstring: {missing_docstring}"


def test_package_exports_are_documented_where_they_are_defined(site):
    pages = {p: (site / "api" / f"{_page(p)}.html").read_text() for p in PACKAGES}
    absent = []
    for package in PACKAGES:
        exported = importlib.import_module(package)
        for name in getattr(exported, "__all__", []):
            obj = getattr(exported, name)
            home = getattr(obj, "__module__", None)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or home is None:
                continue
            top = ".".join(home.split(".")[:2])
            if top not in pages or f'id="{home}.{obj.__name__}"' not in pages[top]:
                absent.append(f"{package}.{name} (defined in {home})")
    assert not absent, f"re-exported but documented nowhere: {absent}"


def _cell_source(cell: str) -> str:
    """A rendered table cell as the Markdown it was made from: each formula read back from the
    TeX its MathML keeps in ``alttext``, each code span back in backticks."""
    parts = re.split(r'<math alttext="([^"]*)".*?</math>', cell, flags=re.S)  # text, TeX, text, ...
    return "".join("$" + html.unescape(part) + "$" if k % 2
                   else html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"</?code>", "`", part)))
                   for k, part in enumerate(parts))


def test_symmetry_table_is_generated_from_the_code(site):
    import geomuon.theory.declared

    rows = geomuon_pages.symmetry_rows(geomuon.theory.declared)
    assert len(rows) == len(geomuon.theory.declared.declarations()) >= 5
    page = (site / "concepts" / "symmetry.html").read_text()
    table = page[page.index('<div class="geomuon-declared">') :]
    table = table[: table.index("</table>")]
    cells = [re.findall(r"<td>(.*?)</td>", row, re.S) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)
             if "<td>" in row]
    assert [tuple(map(_cell_source, row)) for row in cells] == rows
    # Every formula of a rationale is MathML on the page (a "$...$" left as text would read
    # back the same), and nothing else in the table is raw LaTeX.
    assert [row[3].count("<math") for row in cells] == [rationale.count("$") // 2 for *_, rationale in rows]
    assert_math_rendered(table, "concepts/symmetry: the declared table")
    # Both verdicts are present: the negative controls are part of the table.
    assert {row[2] for row in rows} == {"holds", "fails (negative control)"}


# Math written outside "$...$" and code spans, as the rationales had been: Unicode ("O_m×O_n",
# "WᵀW", "‖d_i‖", "Π^⊥", "ε"), ASCII subscripts, powers, bars, braces and backslashes
# ("sigma_max", "L_{gW}", "||Z||_F"), and e-notation ("~2e-2"). The dashes are prose.
PSEUDO_MATH = re.compile(r"[^\x00-\x7f–—]|[_^|\\{}]|\d[eE]-?\d")


def pseudo_math(markdown: str) -> str | None:
    """The first math of ``markdown`` written outside a formula or code span (an unpaired
    ``$`` included), or ``None``."""
    outside = re.sub(r"\$[^$]*\$|`[^`]*`", " ", markdown)
    found = re.search(r"\$", outside) or PSEUDO_MATH.search(outside)
    return found.group(0) if found else None


def test_declared_rationales_write_their_math_as_latex():
    # The docs render each rationale as Markdown: math outside "$...$" shows as plain text.
    import geomuon.theory.declared

    written = {d.id: pseudo_math(d.rationale) for d in geomuon.theory.declared.declarations()}
    assert not {row: found for row, found in written.items() if found}, written
    # Negative control: the notations the rationales had been written in are caught; a formula,
    # a code span and the dashes of prose are not.
    for pseudo in ("S_m × O_n", "msign(LDRᵀ)", "‖D‖_*", "||Z||_F", "(~2e-2)", "sigma_max", "L_{gW}",
                   r"shift $\mathbf 1v^\top changes"):
        assert pseudo_math(pseudo) is not None, pseudo
    assert pseudo_math(r"`row_norm` is $S_m \times O_n$-equivariant — at 2–6 sides, $\lVert Z\rVert_F$") is None


# --- in the browser -----------------------------------------------------------------

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # needed as root (CI); harmless otherwise
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,2000",
]


@pytest.fixture(scope="module")
def chromium() -> str:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    message = (
        "headless Chromium not found: install Debian's `chromium` package "
        "(run: sudo apt-get install chromium; `make test` installs it only under CI=true), "
        "or point CHROMIUM at a Chrome/Chromium binary"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def run_chromium(chromium: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="geomuon-chromium-") as profile:
        return subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )


# Runs in the page after load: for every <math>, is it a MathML element the browser laid
# out (non-empty box), and does every fraction stack its numerator above its denominator
# (which only a MathML layout does: unsupported markup would run inline)?
PROBE = """
<script>
window.addEventListener("load", () => {
  const maths = [...document.querySelectorAll("article math")];
  const laidOut = maths.filter(m => m instanceof MathMLElement &&
    m.getBoundingClientRect().width > 0 && m.getBoundingClientRect().height > 0).length;
  const fractions = [...document.querySelectorAll("article mfrac")];
  const stacked = fractions.filter(f => f.children.length === 2 &&
    f.children[0].getBoundingClientRect().bottom <= f.children[1].getBoundingClientRect().top + 1).length;
  const out = document.createElement("pre");
  out.id = "geomuon-probe";
  out.textContent = JSON.stringify({maths: maths.length, laidOut, fractions: fractions.length, stacked});
  document.body.appendChild(out);
});
</script>
"""


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory) -> Path:
    configured = os.environ.get("GEOMUON_DOCS_SCREENSHOTS")
    directory = Path(configured) if configured else tmp_path_factory.mktemp("docs-screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.mark.browser
@pytest.mark.parametrize("page_name", [f"concepts/{p}" for p in CONCEPT_PAGES] + ["api/manifolds"])
def test_math_renders_in_headless_chromium(site, chromium, screenshot_dir, page_name):
    page = site / f"{page_name}.html"
    # The probe goes into a copy beside the page so relative assets still resolve; its
    # output lands below the fold, outside the screenshot.
    probed = page.with_name(page.stem + ".probe.html")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    shot = screenshot_dir / (page_name.replace("/", "-") + ".png")
    dom = run_chromium(chromium, f"--screenshot={shot}", "--dump-dom", probed.as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    probe = re.search(r'<pre id="geomuon-probe">(.*?)</pre>', dom.stdout)
    assert probe, f"{page_name}: the page did not finish loading in Chromium"
    result = json.loads(html.unescape(probe.group(1)))
    expected = page.read_text().count("<math")
    assert result["maths"] == expected > 0, result
    assert result["laidOut"] == result["maths"], f"{page_name}: formulas not laid out as MathML: {result}"
    assert result["stacked"] == result["fractions"], f"{page_name}: fractions not stacked: {result}"
    # What the reader sees after scripts ran: still no raw LaTeX.
    assert_math_rendered(dom.stdout, f"{page_name} in Chromium")
    assert shot.stat().st_size > 10_000, f"{page_name}: screenshot missing or blank"
    print(f"screenshot: {shot}")


def test_formula_converter_rejects_what_would_show_as_raw_latex():
    # latex2mathml passes unknown commands through as text; the hook must refuse them (the
    # build then fails naming the page and the formula) instead of publishing "\\foo".
    with pytest.raises(ValueError, match="unsupported"):
        geomuon_mathml.latex_to_mathml(r"\foo(x)", display=False)
    with pytest.raises(ValueError, match="alignment"):
        geomuon_mathml.latex_to_mathml(r"a &= b", display=True)
    # The rewrites it relies on: escapes inside \text, \arg\max, \tfrac.
    mathml = geomuon_mathml.latex_to_mathml(r"\text{fan\_in} + \arg\max_x \tfrac12", display=True)
    rendered = re.sub(r'alttext="[^"]*"', "", mathml)  # the TeX source is kept only there
    assert "fan_in" in rendered and "\\" not in rendered
    assert 'display="block"' in mathml and "<mfrac>" in mathml


def test_raw_latex_detector_flags_unrendered_math():
    # Negative control of assert_math_rendered: raw delimiters in text are caught, the same
    # characters inside code are not.
    for raw in ("<p>$$x^2$$</p>", r"<p>\(x\)</p>", "<p>cost $x_1$ here</p>", '<span class="arithmatex">x</span>'):
        with pytest.raises(AssertionError):
            assert_math_rendered(raw, "sample")
    assert_math_rendered("<p><code>$HOME and \\(x\\)</code> <math><mi>x</mi></math></p>", "sample")
    # A formula a table cell cut open, and what the converter gets wrong without a warning,
    # made by the hook itself: a non-letter \operatorname, a cooked "\times" (a tab).
    # A bar alone: the halves of "$|$x$|$" and "$\lVert$x$\rVert$".
    for raw in ("<td>so $\\max</td><td>\\text{GELU}'</td>",
                geomuon_mathml.latex_to_mathml(r"\operatorname{row\_norm}(D)", display=False),
                geomuon_mathml.latex_to_mathml("m\times n", display=False),
                geomuon_mathml.latex_to_mathml("|", display=False),
                geomuon_mathml.latex_to_mathml(r"\rVert", display=False)):
        with pytest.raises(AssertionError, match="raw LaTeX|renders wrong"):
            assert_math_rendered(raw, "sample")
    # Not flagged: a price, a backslash in code, and the fixes of the formulas.
    assert_math_rendered("<p>costs $5, <code>C:\\temp $x$</code></p>", "sample")
    for tex in (r"\text{row\_norm}(D)", r"\operatorname{msign}(G)", r"m\times n", r"\max_i \lvert a_i\rvert",
                r"\lVert D\rVert_*"):
        assert_math_rendered(geomuon_mathml.latex_to_mathml(tex, display=False), "sample")


def _docstring_escapes(source: str) -> list[tuple[int, list[str]]]:
    """(line, LaTeX commands) of every docstring in ``source`` that is not a raw string and
    holds a backslash before a letter: Python reads ``\\times`` there as a tab and ``imes``,
    ``\\frac`` as a form feed, ``\\nabla`` as a newline -- still valid TeX, so the strict site
    build renders the wrong formula without a warning."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            text = ast.get_source_segment(source, node.value)
            if "r" not in re.match(r"[A-Za-z]*", text).group(0).lower():
                commands = re.findall(r"(?<!\\)\\[A-Za-z]+", text)
                if commands:
                    found.append((node.value.lineno, commands))
    return found


def test_docstrings_with_latex_are_raw_strings():
    sources = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert "optimizers/gram.py" in sources  # the listing is the repository's
    cooked = {path: found for path in sources if (found := _docstring_escapes((ROOT / path).read_text()))}
    assert not cooked, f"make these docstrings raw strings (r\"\"\"...): {cooked}"
    # Negative control: a cooked \times is found, the raw and the escaped ones are not.
    assert _docstring_escapes('def f():\n    """$m\\times n$"""\n') == [(2, ["\\times"])]
    assert _docstring_escapes('def f():\n    r"""$m\\times n$"""\n') == []
    assert _docstring_escapes('def f():\n    """$m\\\\times n$"""\n') == []


@pytest.mark.browser
def test_browser_probe_tells_mathml_from_unrendered_markup(chromium, tmp_path):
    # Negative control of the probe: the same fraction as MathML (stacked) and as unknown
    # HTML tags (laid out inline, as a browser without MathML would) must be told apart.
    fraction = "<mfrac><mi>a</mi><mi>b</mi></mfrac>"
    page = tmp_path / "probe.html"
    page.write_text(f"<html><body><article><math display='block'>{fraction}</math>"
                    f"<p>{fraction}</p></article>{PROBE}</body></html>")
    dom = run_chromium(chromium, "--dump-dom", page.as_uri())
    result = json.loads(html.unescape(re.search(r'<pre id="geomuon-probe">(.*?)</pre>', dom.stdout).group(1)))
    assert result == {"maths": 1, "laidOut": 1, "fractions": 2, "stacked": 1}, result


@pytest.mark.browser
def test_search_works_offline_from_file_urls(site, chromium):
    # The search index is inlined and the worker shim vendored (mkdocs.yml), so searching a
    # site opened from disk finds pages without a server or a network.
    url = (site / "index.html").as_uri() + "?q=retraction"
    dom = run_chromium(chromium, "--virtual-time-budget=8000", "--dump-dom", url)
    found = re.search(r'md-search-result__meta">(\d+) matching document', dom.stdout)
    assert found and int(found.group(1)) >= 3, dom.stdout[-2000:]


def test_results_pages_written_by_studies_join_the_navigation(tmp_path):
    # A study writes docs/results/<name>.md; the hook lists it on the landing page and adds
    # it under Results in the navigation, so strict mode never sees an orphan page.
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "index.md").write_text("# Results\n\n<!-- geomuon:results-pages -->\n")
    nav = [{"Home": "index.md"}, {"Results": "results/index.md"}]
    config = types.SimpleNamespace(docs_dir=str(tmp_path), nav=nav)
    assert geomuon_pages.add_results_to_nav(config).nav[1] == {"Results": "results/index.md"}
    listing = geomuon_pages.on_page_markdown("<!-- geomuon:results-pages -->", None, config, None)
    assert "No study has written its page yet" in listing

    (tmp_path / "results" / "lipschitz.md").write_text("# Enforced Lipschitz bounds\n\nbody\n")
    geomuon_pages.add_results_to_nav(config)
    assert config.nav[1] == {"Results": [{"Overview": "results/index.md"},
                                         {"Enforced Lipschitz bounds": "results/lipschitz.md"}]}
    listing = geomuon_pages.on_page_markdown("<!-- geomuon:results-pages -->", None, config, None)
    assert listing == "* [Enforced Lipschitz bounds](lipschitz.md)\n"


# table file (docs/results/benchmarks/FILE.md) -> the bench script that writes it
BENCHMARKS = {"polar_kernels": "polar_kernels", "optimizer_step": "optimizer_step",
              "optimizer_step_2threads": "optimizer_step", "optimizer_step_gpt2_small": "optimizer_step",
              "optimizer_step_fast_bf16": "optimizer_step", "optimizer_step_fast_bf16_2threads": "optimizer_step",
              "optimizer_step_gpt2_small_fast_bf16": "optimizer_step",
              "manifold_frontier": "manifold_frontier", "manifold_frontier_polar_express": "manifold_frontier",
              "manifold_frontier_jacobi": "manifold_frontier",
              "manifold_frontier_projected": "manifold_frontier",
              "manifold_inrun": "manifold_inrun", "manifold_inrun_reference": "manifold_inrun",
              "manifold_inrun_projected": "manifold_inrun",
              "optimizer_step_amx": "optimizer_step", "optimizer_step_amx_2threads": "optimizer_step",
              "optimizer_step_gpt2_small_amx": "optimizer_step",
              "manifold_inrun_polar_express": "manifold_inrun", "manifold_inrun_polish": "manifold_inrun",
              "distributed_step": "distributed_step", "equivariance_checker": "equivariance_checker"}


def test_benchmark_tables_are_included_as_their_scripts_wrote_them(site):
    # docs/results/benchmarks/NAME.md is written by `bench/NAME.py --markdown` and included
    # in the results page by the hook; a missing one shows the command that writes it.
    page = html.unescape((site / "results" / "index.html").read_text())
    quick_runs = 0
    for name, script in BENCHMARKS.items():
        written = ROOT / "docs" / "results" / "benchmarks" / f"{name}.md"
        if not written.is_file():
            assert f"python bench/{script}.py --markdown docs/results/benchmarks/{name}.md" in page
            continue
        text = written.read_text()
        command = re.search(r"^\| command \| `(.*)` \|$", text, re.MULTILINE).group(1)
        assert command.startswith(f"python bench/{script}.py") and f"--markdown docs/results/benchmarks/{name}.md" in command
        assert command in page, f"{name}: its table is not on the results page"
        is_quick = "--quick" in command.split()
        assert text.startswith('!!! warning "Quick run: not a result"') == is_quick, f"{name}: quick-run mark"
        quick_runs += is_quick
    assert page.count("Quick run: not a result") == quick_runs


def test_benchmark_marker_includes_the_file_or_says_not_yet_measured(tmp_path, caplog):
    config = types.SimpleNamespace(docs_dir=str(tmp_path), nav=[])
    marker = "## Kernels\n\n<!-- geomuon:benchmark polar_kernels -->\n"
    missing = geomuon_pages.on_page_markdown(marker, None, config, None)
    assert "*Not yet measured:* `python bench/polar_kernels.py --markdown docs/results/benchmarks/polar_kernels.md`" in missing
    (tmp_path / "results" / "benchmarks").mkdir(parents=True)
    (tmp_path / "results" / "benchmarks" / "polar_kernels.md").write_text("| a |\n|---|\n| 1 |\n")
    assert geomuon_pages.on_page_markdown(marker, None, config, None) == "## Kernels\n\n| a |\n|---|\n| 1 |\n\n"
    # A second table of the same script (other settings) is named after the script.
    other = "<!-- geomuon:benchmark polar_kernels polar_kernels_big -->\n"
    assert "`python bench/polar_kernels.py --markdown docs/results/benchmarks/polar_kernels_big.md`" in (
        geomuon_pages.on_page_markdown(other, None, config, None))
    (tmp_path / "results" / "benchmarks" / "polar_kernels_big.md").write_text("| b |\n")
    assert geomuon_pages.on_page_markdown(other, None, config, None) == "| b |\n\n"
    # A marker naming no bench script is a warning (a failure under mkdocs --strict).
    with caplog.at_level("WARNING", logger="mkdocs.hooks.geomuon_pages"):
        geomuon_pages.on_page_markdown("<!-- geomuon:benchmark no_such_script -->", None, config, None)
    assert "no bench/no_such_script.py" in caplog.text


# --- numbers and conventions the concept and results pages state, held against their sources

DOCS = ROOT / "docs"
TABLES = DOCS / "results" / "benchmarks"


def _table_header(name: str) -> dict[str, str]:
    """The commit and the bf16 / fp32 matmul rate a benchmark table's header records."""
    text = (TABLES / f"{name}.md").read_text()
    commit = re.search(r"^\| commit \| `([0-9a-f]+)(?:-dirty)?` \|", text, re.MULTILINE).group(1)
    rate = re.search(r"^\| bf16 / fp32 matmul rate \| ([\d.]+)x ", text, re.MULTILINE).group(1)
    return {"commit": commit, "rate": rate}


# (what the prose says, with named groups `commit` and/or `rate`) -> the table it describes
RESULTS_PROSE_TABLES = [
    (r"bf16 products at \*\*(?P<rate>[\d.]+)× the fp32 rate\*\*, a gap like", "optimizer_step_fast_bf16"),
    (r"On a CPU with AMX\*\* \(an Intel Xeon whose bf16 products run at \*\*(?P<rate>[\d.]+)× the fp32 rate",
     "optimizer_step_amx"),
    (r"\(process clock, `(?P<commit>[0-9a-f]+)`, the first table\)", "optimizer_step_amx"),
    (r"\(wall clock, the second table, `(?P<commit>[0-9a-f]+)`, quiet machine\)", "optimizer_step_amx_2threads"),
    (r"The same block on the AMX Xeon \(`(?P<commit>[0-9a-f]+)`, bf16 (?P<rate>[\d.]+)× fp32",
     "optimizer_step_gpt2_small_amx"),
    (r"The same block on the fast-bf16 AMD EPYC \(`(?P<commit>[0-9a-f]+)`", "optimizer_step_gpt2_small_fast_bf16"),
    (r"Measured here \(`(?P<commit>[0-9a-f]+)`, the Intel Xeon whose bf16 products run at (?P<rate>[\d.]+)× its",
     "manifold_frontier"),
    (r"the same AMD EPYC with bf16 at\s+(?P<rate>[\d.]+)× fp32\) one polish round", "manifold_frontier_projected"),
    (r"an Intel Xeon without AMX: bf16 matrix products at \*\*(?P<rate>[\d.]+)× the fp32", "optimizer_step"),
]


@pytest.mark.parametrize("prose, table", RESULTS_PROSE_TABLES, ids=[t for _, t in RESULTS_PROSE_TABLES])
def test_results_prose_quotes_the_commit_and_bf16_rate_of_its_table(prose, table):
    text = (DOCS / "results" / "index.md").read_text()
    found = re.search(prose, text)
    assert found, f"results/index.md no longer says {prose!r}: update this test with the prose"
    header = _table_header(table)
    for key, value in found.groupdict().items():
        assert value == header[key], f"results/index.md quotes {key} {value} for {table}.md, whose header says {header[key]}"


def test_lipschitz_page_quotes_the_composition_numbers_of_the_tightness_table():
    # The composition paragraph of the Lipschitz concept page quotes the results page's
    # table: the product of the sub-layer estimates and the network estimate, 1000 steps.
    table = (TABLES / "lipschitz_tightness.md").read_text()
    page = (DOCS / "concepts" / "lipschitz.md").read_text().replace(",", "")
    paragraph = page[page.index("Any bound that multiplies per-sub-layer constants"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    commit = re.search(r"^\| commit \| `([0-9a-f]+)` \|", table, re.MULTILINE).group(1)
    assert f"the table at\n`{commit}`" in paragraph or f"the table at `{commit}`" in paragraph
    for model in ("2 layers, 2 heads", "3 layers, 4 heads"):
        row = re.search(rf"^\| {model} \| 1000 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", table, re.MULTILINE)
        product, estimate, ratio = row.groups()
        assert product in paragraph and estimate in paragraph, (model, product, estimate)
        assert f"{float(ratio):.0f}×" in paragraph or f"{float(ratio):.1f}×" in paragraph, (model, ratio)
    # The radii bullet quotes the table's last two columns (joint bound / reached, 1000 steps).
    radii = page[page.index("*The composed radius is not.*"):]
    radii = radii[:radii.index("\n* ")]
    for model in ("2 layers, 2 heads", "3 layers, 4 heads"):
        row = re.search(rf"^\| {model} \| 1000 \|.*\| ([\d.]+) / ([\d.]+) \| ([\d.]+) / ([\d.]+) \|$", table, re.MULTILINE)
        for value in row.groups():
            assert f"{float(value):.2f}" in radii, (model, value)


def test_smoothed_dual_certificate_constant_is_an_upper_bound():
    # Each singular value loses sigma (1 - sigma / sqrt(sigma^2 + mu)) = sqrt(mu) f(t),
    # t = sigma / sqrt(mu), f(t) = t (1 - t / sqrt(t^2 + 1)); the page's constant must be at
    # least max f (0.30028..., at t = 0.786), or the stated certificate 1 - const c is false.
    page = (DOCS / "concepts" / "steepest-descent.md").read_text()
    stated = float(re.search(r"certifies at least \$1 - ([\d.]+)c\$", page).group(1))
    lo, hi = 0.0, 3.0
    f = lambda t: t * (1 - t / math.sqrt(t * t + 1))  # noqa: E731 (unimodal on [0, inf))
    for _ in range(200):  # golden-section search for the maximum
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (a, hi) if f(a) < f(b) else (lo, b)
    assert 0.3002 < f(lo) < 0.3004
    assert stated >= f(lo), f"steepest-descent.md states 1 - {stated}c; each singular value can lose {f(lo):.5f} sqrt(mu)"


def test_symmetry_page_states_the_action_its_gradient_formula_assumes():
    # grad L(g.W) = L^-T grad L(W) R^-1 holds for g.W = L W R^T (R^-T for g.W = L W R); the
    # page must say which, and act_gradient must compute it.
    from geomuon.theory.groups import get_group

    page = (DOCS / "concepts" / "symmetry.md").read_text()
    formula = r"\nabla\mathcal L(g\cdot W) = L^{-\top}\nabla\mathcal L(W)R^{-1}"
    assert formula in page
    assert r"g\cdot W = LWR^\top" in page[: page.index(formula)], "the page uses L and R without defining the action"
    torch = importlib.import_module("torch")
    g = get_group("bi-orthogonal").sample((4, 3), generator=torch.Generator().manual_seed(0))
    G = torch.randn(4, 3, dtype=torch.float64)
    expected = torch.linalg.inv(g.left).mT @ G @ torch.linalg.inv(g.right)
    torch.testing.assert_close(g.act_gradient(G), expected)


def _step_ms(name: str, optimizer: str) -> float:
    """The median step time of one optimizer in a step-cost table."""
    text = (TABLES / f"{name}.md").read_text()
    return float(re.search(rf"^\| {re.escape(optimizer)} \| ([\d.]+) \|", text, re.MULTILINE).group(1))


def test_results_prose_thread_scaling_is_the_ratio_of_the_two_tables():
    text = (DOCS / "results" / "index.md").read_text()
    found = re.search(r"the whole step scales by (?P<step>[\d.]+)× from one\s+thread to two \(Stiefel "
                      r"(?P<one>\d+) ms in the one-thread table, (?P<two>\d+) ms here.*?our Muon's scales by "
                      r"(?P<muon>[\d.]+)× \((?P<muon_one>\d+) → (?P<muon_two>\d+) ms\)", text, re.DOTALL)
    assert found, "results/index.md no longer states the two-thread scaling: update this test with the prose"
    for optimizer, ratio, one, two in (("ManifoldMuon Stiefel", "step", "one", "two"), ("Muon (ours)", "muon", "muon_one", "muon_two")):
        t1, t2 = _step_ms("optimizer_step", optimizer), _step_ms("optimizer_step_2threads", optimizer)
        assert (round(t1), round(t2)) == (int(found[one]), int(found[two])), (optimizer, t1, t2)
        assert found[ratio] == f"{t1 / t2:.2f}", f"{optimizer}: {t1} / {t2} = {t1 / t2:.3f}, the page says {found[ratio]}"


# --- the concept pages' claims against the code they describe ---------------------------------

MATH_PAGES = ("steepest-descent", "symmetry", "certificates")


def test_certificates_page_counts_the_mutation_catalogue_as_list_prints_it():
    listed = subprocess.run([sys.executable, "bench/symbolic_mutations.py", "--list"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    page = (DOCS / "concepts" / "certificates.md").read_text()
    stated = re.search(r"breaks one formula of the library at a time \((\d+)\s+mutations", page)
    assert stated, "certificates.md no longer states the catalogue's size: update this test with the prose"
    assert int(stated.group(1)) == len(listed), f"certificates.md says {stated.group(1)} mutations, --list prints {len(listed)}"
    # the last full run the page cites took the whole catalogue, and is the published table's
    run = re.search(r"The last full run \(at `([0-9a-f]+)`, all (\d+)", page)
    assert run, "certificates.md no longer cites its last full run: update this test with the prose"
    assert int(run.group(2)) == len(listed), f"the cited run took {run.group(2)} mutations, --list prints {len(listed)}"
    table = (DOCS / "results" / "benchmarks" / "symbolic_mutations.md").read_text()
    assert f"| commit | `{run.group(1)}` |" in table, "the page cites another run than the published table's"
    assert f"**{len(listed)}/{len(listed)}**" in table, "the published run did not kill every mutation of the catalogue"


def _stated_range(page: str, label: str) -> tuple[float, float]:
    """The range ``low–high`` the page quotes after ``label`` (a regular expression)."""
    found = re.search(label + r",\s+(\d\.\d+)–(\d\.\d+)", page)
    assert found, f"steepest-descent.md no longer quotes {label!r}: update this test with the prose"
    return float(found.group(1)), float(found.group(2))


def test_steepest_descent_page_figures_are_what_the_engine_measures():
    # Eight draws (seeds 0-7) of a Stiefel point and a Gaussian G at 96 x 32, float64. The
    # optimum is bracketed by 100 decaying steps with alpha = 0.5: its certificate (primal /
    # dual, both exact) exceeds 1 - 1e-5, so dividing by its dual value misstates a fraction by
    # less than 1e-5, below the last quoted digit (1e-3).
    from geomuon.manifolds import Stiefel
    from geomuon.optimizers.steepest import steepest_direction

    page = (DOCS / "concepts" / "steepest-descent.md").read_text()
    ranges = {key: _stated_range(page, label) for key, label in (
        ("projected", r"\$\\operatorname\{msign\}\(G\)\$ projected"), ("projection start", r"\$\\Phi\(P_W G\)\$"),
        ("reference", r"20 steps with\s+\$\\alpha = 0\.1\$(?: \(`REFERENCE`\))?"))}
    torch = importlib.import_module("torch")
    manifold = Stiefel()
    measured = {key: [] for key in ranges}
    for seed in range(8):
        generator = torch.Generator().manual_seed(seed)
        W = manifold.projx(torch.randn(96, 32, dtype=torch.float64, generator=generator))
        G = torch.randn(96, 32, dtype=torch.float64, generator=generator)
        bracket = steepest_direction(manifold, W, G, steps=100, alpha=0.5)
        assert float(bracket.ratio) > 1 - 1e-5, "the 100-step bracket no longer certifies the optimum"
        optimum = float(bracket.dual)
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        projected = manifold.proju(W, U @ Vh)
        projected = projected / torch.linalg.matrix_norm(projected, 2)
        measured["projected"].append(float((G * projected).sum()) / optimum)
        measured["projection start"].append(float(steepest_direction(manifold, W, G, steps=0).primal) / optimum)
        measured["reference"].append(float(steepest_direction(manifold, W, G, settings="reference").primal) / optimum)
    for key, (low, high) in ranges.items():
        assert low <= min(measured[key]) and max(measured[key]) <= high, (
            f"steepest-descent.md quotes {low}-{high} for {key}; the engine measures "
            f"{min(measured[key]):.4f}-{max(measured[key]):.4f}")
    assert re.search(r"100 steps with\s+\$\\alpha = 0\.5\$, above 0\.99999", page)


def test_steepest_descent_page_says_which_iterates_the_reported_dual_is_the_minimum_of():
    # With decay off, iterate k of a K-step solve is the last iterate of a k-step solve, so the
    # dual value of each iterate is that solve's `dual` without track_best. The page says the
    # reported dual is the minimum over every tenth iterate and the last; exact comparison:
    # both sides are the same float64 computation on the same iterate.
    from geomuon.manifolds import DGram
    from geomuon.optimizers.steepest import steepest_direction

    page = (DOCS / "concepts" / "steepest-descent.md").read_text()
    assert "`track_best`, every tenth iterate and the last" in page
    torch = importlib.import_module("torch")
    generator = torch.Generator().manual_seed(1)
    manifold = DGram()
    W = manifold.projx(torch.randn(12, 5, dtype=torch.float64, generator=generator))
    G = torch.randn(12, 5, dtype=torch.float64, generator=generator)
    steps, plain = 25, dict(alpha=1.0, decay=False, tol=0.0)  # constant steps oscillate here
    per_iterate = [float(steepest_direction(manifold, W, G, steps=k, track_best=False, **plain).dual)
                   for k in range(steps + 1)]
    reported = float(steepest_direction(manifold, W, G, steps=steps, track_best=True, **plain).dual)
    scored = [per_iterate[k] for k in range(steps + 1) if k % 10 == 0 or k == steps]
    assert reported == min(scored)
    # and the distinction matters here: an unscored iterate has a smaller dual value
    assert min(per_iterate) < reported


def test_steepest_descent_page_cost_counts_the_newton_schulz_steps_the_engine_runs():
    # The Cost section prices 20 dual steps in Muon orthogonalizations. Count the Newton-Schulz
    # steps each really runs (every schedule's step is the same quintic: equal cost per step);
    # the page's figure is a round "about", so it must be within 10% of the count's ratio (the
    # page had said 40 for a count of 50.4).
    from geomuon.manifolds import Stiefel, linalg
    from geomuon.optimizers import Muon
    from geomuon.optimizers.steepest import steepest_direction

    page = (DOCS / "concepts" / "steepest-descent.md").read_text()
    found = re.search(r"(\d+) dual steps dualize (\d+) iterates.*?about (\d+) Muon orthogonalizations", page, re.DOTALL)
    assert found, "steepest-descent.md no longer prices dual steps in Muon orthogonalizations: update this test"
    dual_steps, iterates, stated = (int(value) for value in found.groups())
    torch = importlib.import_module("torch")
    counted = [0]
    original = linalg.newton_schulz_step

    def counting_step(*args, **kwargs):
        counted[0] += 1
        return original(*args, **kwargs)

    generator = torch.Generator().manual_seed(0)
    manifold = Stiefel()
    W = manifold.projx(torch.randn(24, 8, dtype=torch.float64, generator=generator))
    G = torch.randn(24, 8, dtype=torch.float64, generator=generator)
    weight = torch.nn.Parameter(G.clone())
    weight.grad = G.clone()
    try:
        linalg.newton_schulz_step = counting_step
        steepest_direction(manifold, W, G, steps=dual_steps, tol=0.0, certify=None, track_best=False)
        engine = counted[0]
        counted[0] = 0
        Muon([weight], lr=0.01).step()
        muon = counted[0]
    finally:
        linalg.newton_schulz_step = original
    assert engine == iterates * linalg.POLAR_EXPRESS.default_steps, (engine, iterates)
    assert abs(stated / (engine / muon) - 1) <= 0.1, (
        f"steepest-descent.md: {dual_steps} dual steps cost about {stated} Muon orthogonalizations; the engine "
        f"runs {engine} Newton-Schulz steps, Muon {muon} per orthogonalization ({engine / muon:.1f})")


def _table_rows(page: str, first_header: str) -> list[list[str]]:
    """The cells of a Markdown table's body, the table found by its first header cell."""
    start = page.index(f"| {first_header} |")
    rows = []
    for line in page[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_symmetry_page_cites_for_each_invariance_group_the_maps_declared_to_hold():
    # An invariance row's "blocks" cell names, before any "not", the maps of
    # geomuon.theory.declared that hold under that group: exactly those (a map whose floor
    # breaks the invariance is a declared negative control and must not be cited as holding).
    import geomuon.theory.declared

    verdicts = {(subject, group): verdict for subject, group, verdict, _ in
                geomuon_pages.symmetry_rows(geomuon.theory.declared)}
    page = (DOCS / "concepts" / "symmetry.md").read_text()
    invariance_rows = [row for row in _table_rows(page, "group") if "(invariance)" in row[0]]
    assert len(invariance_rows) == 2
    for _, name, _, blocks in invariance_rows:
        group = name.strip("`")
        cited = set(re.findall(r"`([a-z_]+)`", blocks.split("not")[0]))
        excluded = set(re.findall(r"`([a-z_]+)`", blocks.split("not", 1)[1])) if "not" in blocks else set()
        holding = {subject.removesuffix(" (map)") for (subject, g), verdict in verdicts.items()
                   if g == group and verdict == "holds" and subject.endswith(" (map)")}
        assert cited == holding, f"symmetry.md cites {sorted(cited)} for {group}; declared.py holds {sorted(holding)}"
        for map_name in excluded:
            assert verdicts.get((f"{map_name} (map)", group), "fails (negative control)") != "holds", (group, map_name)


def test_symmetry_page_formulas_of_the_normalizing_maps_are_their_docstrings():
    # The page's row and column norm are the code's: the floor epsilon and which index is a row.
    from geomuon.optimizers import maps

    page = (DOCS / "concepts" / "symmetry.md").read_text()
    formulas = {row[0]: row[1] for row in _table_rows(page, "map")}
    # spacing is not meaning, and a table cell spells the norm \Vert (a "\|" would end the cell)
    squeeze = lambda tex: re.sub(r"\s|\\,", "", tex.replace(r"\|", r"\Vert "))  # noqa: E731
    for label, update in (("row norm", maps.row_norm), ("column norm", maps.col_norm)):
        documented = re.search(r"\$U\(D\) = (.+?)\$", update.__doc__).group(1)
        shown = formulas[label].split("$")[1]
        assert squeeze(shown) == squeeze(documented), f"symmetry.md: {label} is ${shown}$, {update.__name__} computes ${documented}$"


def test_math_pages_cite_names_and_files_that_exist():
    # Every dotted `geomuon.…` name resolves, every certificate the certificates page names is
    # in geomuon.theory.symbolic (or, for the bound a certificate pins, in the regulators), and
    # every cited repository file exists.
    import geomuon.theory.symbolic
    from geomuon.optimizers import regulate

    missing = []
    for name in MATH_PAGES:
        page = (DOCS / "concepts" / f"{name}.md").read_text()
        for dotted in set(re.findall(r"`(geomuon(?:\.[A-Za-z_]\w*)+)", page)):
            parts, obj = dotted.split("."), None
            for cut in range(len(parts), 1, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    obj = getattr(obj, attribute, None)
                break
            if obj is None:
                missing.append(f"{name}.md: {dotted}")
        for path in set(re.findall(r"`((?:tests|bench|theory|optimizers|manifolds|pretrain)/[\w/]+\.py)`", page)):
            if not (ROOT / path).is_file():
                missing.append(f"{name}.md: {path}")
    certificates = (DOCS / "concepts" / "certificates.md").read_text()
    for certificate in set(re.findall(r"`((?:certify|ns)_\w+|\w+_(?:reference|error_bound))`", certificates)):
        if not any(hasattr(module, certificate) for module in (geomuon.theory.symbolic, regulate)):
            missing.append(f"certificates.md: {certificate}")
    assert not missing, "the pages cite what does not exist:\n" + "\n".join(sorted(missing))
