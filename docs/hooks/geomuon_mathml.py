r"""MkDocs hook: render every formula to MathML at build time, so pages need no network.

``pymdownx.arithmatex`` (generic mode) turns ``$...$`` and ``$$...$$`` -- in the pages and
in the docstrings that mkdocstrings renders -- into ``<span class="arithmatex">\(...\)</span>``
and ``<div class="arithmatex">\[...\]</div>``. After each page's HTML exists
(``on_page_content``, which sees the API pages too), this hook replaces those elements by
MathML produced with ``latex2mathml``; browsers render MathML natively (Chromium >= 109,
Firefox, Safari), so the built site contains no math renderer and fetches nothing.

``latex2mathml`` leaves commands it does not know in the output as literal text (``\arg``
becomes ``<mi>\arg</mi>``), which a reader would see as raw LaTeX. Such formulas are
reported as warnings naming the page and the formula, so ``mkdocs build --strict`` fails
instead of publishing them; the rewrite table below teaches the converter the few
commands the docs and docstrings need that it lacks.
"""

from __future__ import annotations

import html
import logging
import re

from latex2mathml.converter import convert
from markdown import Extension
from markdown.preprocessors import Preprocessor

log = logging.getLogger("mkdocs.hooks.geomuon_mathml")

_ARITHMATEX = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">(?P<body>.*?)</(?P=tag)>', re.DOTALL
)
# Delimiters arithmatex writes in generic mode: \( \) inline, \[ \] display.
_DELIMITERS = {"span": (r"\(", r"\)"), "div": (r"\[", r"\]")}

# Commands latex2mathml lacks, rewritten to ones it renders identically.
_REWRITES = (
    (re.compile(r"\\arg\\max\b"), r"\\operatorname{argmax}"),
    (re.compile(r"\\arg\\min\b"), r"\\operatorname{argmin}"),
    (re.compile(r"\\arg\b"), r"\\operatorname{arg}"),
    (re.compile(r"\\operatorname\*"), r"\\operatorname"),
    (re.compile(r"\\tfrac\b"), r"\\frac"),
)
# Inside \text{...} latex2mathml keeps escapes such as "\_" verbatim.
_TEXT_ARGUMENT = re.compile(r"\\(text|mathrm|textrm|mathit)\{([^{}]*)\}")
_TEXT_ESCAPE = re.compile(r"\\([_%&#$ ])")
# A backslash command surviving into the MathML's text is LaTeX the converter did not know.
_RAW_COMMAND = re.compile(r">[^<]*\\[A-Za-z]+[^<]*<")
_OPERATOR_NAME = re.compile(r"<mo>([A-Za-z][A-Za-z ]+)</mo>")
_CAPITAL_GREEK = re.compile(r"<mi>(&#x00(?:39[1-9A-F]|3A[0-9]);)</mi>")


def _prepare(tex: str) -> str:
    for pattern, replacement in _REWRITES:
        tex = pattern.sub(replacement, tex)
    return _TEXT_ARGUMENT.sub(
        lambda m: "\\" + m.group(1) + "{" + _TEXT_ESCAPE.sub(r"\1", m.group(2)) + "}", tex
    )


def latex_to_mathml(tex: str, display: bool) -> str:
    """MathML for one formula; raises ``ValueError`` when it would show raw LaTeX."""
    mathml = convert(_prepare(tex), display="block" if display else "inline")
    leftover = _RAW_COMMAND.search(mathml)
    if leftover:
        raise ValueError(f"unsupported LaTeX command in {leftover.group(0)[1:-1]!r}")
    if "<mi>&</mi>" in mathml:
        raise ValueError("alignment '&' outside an environment that supports it (use align*)")
    # \operatorname{sym} arrives as <mo>sym</mo>, which browsers space as a binary operator
    # ("sym (A)"); a multi-letter <mi> is upright and sits tight against its argument as in TeX.
    mathml = _OPERATOR_NAME.sub(r"<mi>\1</mi>", mathml)
    # TeX sets capital Greek upright; a one-letter <mi> would be italic.
    mathml = _CAPITAL_GREEK.sub(r'<mi mathvariant="normal">\1</mi>', mathml)
    # Keep the source in an attribute (screen readers, copy tools) rather than in an
    # <annotation>, whose text the search index would show as raw LaTeX.
    return mathml.replace("<math ", f'<math alttext="{html.escape(tex, quote=True)}" ', 1)


def _render(match: re.Match, page_name: str) -> str:
    tag = match.group("tag")
    opening, closing = _DELIMITERS[tag]
    tex = html.unescape(match.group("body")).strip()
    if tex.startswith(opening) and tex.endswith(closing):
        tex = tex[len(opening) : -len(closing)].strip()
    try:
        mathml = latex_to_mathml(tex, display=tag == "div")
    except Exception as error:  # latex2mathml raises many exception types on bad input
        log.warning("%s: formula %r does not render: %s", page_name, tex, error)
        return match.group(0)
    if tag == "div":
        return f'<div class="math-display">{mathml}</div>'
    return mathml


class _SeparateDisplayMath(Preprocessor):
    """Put a blank line between consecutive ``$$...$$`` lines.

    arithmatex only recognizes a display formula that is a block of its own, while TeX
    (and MathJax) also accept two displays on consecutive lines; docstrings use both.
    Runs after the fenced-code preprocessors, so code blocks are already set aside.
    """

    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        for line in lines:
            if out and out[-1].rstrip().endswith("$$") and line.lstrip().startswith("$$"):
                out.append("")
            out.append(line)
        return out


class _DisplayMathExtension(Extension):
    def extendMarkdown(self, md):
        md.preprocessors.register(_SeparateDisplayMath(md), "geomuon_display_math", 15)


def on_config(config):
    # The same list feeds mkdocstrings' docstring rendering, so docstrings get it too.
    config.markdown_extensions.append(_DisplayMathExtension())
    return config


def on_page_content(html_text: str, page, config, files) -> str:
    return _ARITHMATEX.sub(lambda m: _render(m, page.file.src_uri), html_text)
