"""Griffe extension: read the ``#:`` comments above an attribute as its docstring.

The code documents module constants, class attributes and dataclass fields with Sphinx's
``#:`` comments (a comment block, each line starting ``#:``, right above the assignment);
griffe reads only a string literal below an assignment, so without this extension every such
entry of the API reference showed its value and an empty description.

Supported: a block of ``#:`` lines directly above the assignment (a blank line or a plain
comment ends it; a multi-line assignment takes the block above its first line). Not
supported: a trailing ``x = 1  #: doc``, and an indented block at the end of a comment keeps
no indentation relative to the first line (griffe's cleaning).
"""

from __future__ import annotations

import re

import griffe

_COMMENT = re.compile(r"^\s*#:\s?(?P<text>.*)$")


class AttributeComments(griffe.Extension):
    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs) -> None:
        if attr.docstring is not None or attr.lineno is None:
            return
        lines = attr.lines_collection[attr.filepath] if attr.filepath in attr.lines_collection else None
        if not lines:
            return
        block = []
        for line in reversed(lines[: attr.lineno - 1]):
            match = _COMMENT.match(line)
            if match is None:
                break
            block.append(match.group("text"))
        if block:
            attr.docstring = griffe.Docstring("\n".join(reversed(block)), lineno=attr.lineno - len(block),
                                              parent=attr)
