"""MkDocs hook: turn the Sphinx roles of the docstrings into links of the API reference.

The code's docstrings use Sphinx cross-reference roles (``:func:`msign```,
``:class:`~geomuon.manifolds.base.MatrixManifold```), which Markdown renders as the literal role
followed by inline code. This hook records the anchor of every documented object
(mkdocstrings gives each one the id of its dotted path) while pages are converted, then,
once all pages are known, replaces each role by a link to the object. A name is resolved
the way Python would look it up from the docstring's owner: the owner's own members, then
its module's, then its package's, then as an absolute dotted path. A name that resolves
nowhere in the site (``torch.Tensor``) stays inline code, without the role.
"""

from __future__ import annotations

import html
import posixpath
import re

_ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|obj|exc|const):<code>(?P<name>[^<]+)</code>")
_OBJECT_ID = re.compile(r'\bid="(?P<id>geomuon\.(?:manifolds|optimizers|theory|pretrain)(?:\.\w+)*)"')

_anchors: dict[str, str] = {}  # dotted path -> url of the page documenting it


def on_pre_build(config) -> None:
    _anchors.clear()


def on_page_content(html_text: str, page, config, files) -> str:
    for match in _OBJECT_ID.finditer(html_text):
        _anchors.setdefault(match.group("id"), page.url)
    return html_text


def _resolve(name: str, owner: str | None) -> str | None:
    scopes = []
    if owner:
        parts = owner.split(".")
        scopes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
    for candidate in [f"{scope}.{name}" for scope in scopes] + [name]:
        if candidate in _anchors:
            return candidate
    return None


def _link(match: re.Match, output: str, page_url: str) -> str:
    raw = html.unescape(match.group("name")).strip()
    shown = raw.lstrip("~").split(".")[-1] if raw.startswith("~") else raw
    name = raw.lstrip("~").rstrip("()")
    owners = list(_OBJECT_ID.finditer(output, 0, match.start()))
    target = _resolve(name, owners[-1].group("id") if owners else None)
    code = f"<code>{html.escape(shown)}</code>"
    if target is None:
        return code
    here = posixpath.dirname(page_url)
    href = posixpath.relpath(_anchors[target], here or ".") + "#" + target
    return f'<a class="autorefs autorefs-internal" href="{href}" title="{target}">{code}</a>'


def on_post_page(output: str, page, config) -> str:
    if not page.url.startswith("api/"):
        return output
    return _ROLE.sub(lambda m: _link(m, output, page.url), output)
