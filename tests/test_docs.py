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

import dataclasses
import html
import html.parser
import importlib
import inspect
import json
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


def assert_math_rendered(page_html: str, where: str) -> None:
    text = visible_text(page_html)
    leftover = RAW_MATH.search(text)
    assert leftover is None, f"{where}: raw LaTeX left in the text: ...{text[max(0, leftover.start() - 80):leftover.end() + 80]}..."
    assert 'class="arithmatex"' not in page_html, f"{where}: a formula was not converted to MathML"


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


def test_symmetry_table_is_generated_from_the_code(site):
    import geomuon.theory.declared

    rows = geomuon_pages.symmetry_rows(geomuon.theory.declared)
    assert len(rows) == len(geomuon.theory.declared.declarations()) >= 5
    page = (site / "concepts" / "symmetry.html").read_text()
    table = page[page.index('<div class="geomuon-declared">') :]
    table = table[: table.index("</table>")]
    shown = [
        tuple(html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td>(.*?)</td>", row, re.S))
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)
        if "<td>" in row
    ]
    assert shown == rows
    # Both verdicts are present: the negative controls are part of the table.
    assert {row[2] for row in rows} == {"holds", "fails (negative control)"}


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
              "manifold_inrun_projected": "manifold_inrun"}


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
