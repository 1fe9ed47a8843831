"""Every Python block of the README, the Getting-started page and the tutorials runs as written.

The ```` ```python ```` blocks of a page are joined in order and run as one script in a
fresh interpreter (so a page cannot depend on state from another page or from the test
process), in an empty working directory, with ``TINYSHAKESPEARE`` pointing at the
machine's copy of tiny Shakespeare when there is one. Shell blocks (```` ```bash ````) are not run. A page that
drifts from the code fails here. Tutorials that train use configurations small enough to
finish in seconds; the prose says how to scale them up. A page states its results in the
code, so that a wrong result fails here and not only a crash: a ``print(...)  # True`` line
must print exactly that, and an ``assert`` compares with a tolerance taken from the dtype,
never a hand-written literal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The README mirrors the Getting-started example, so it runs too.
PAGES = [ROOT / "README.md", DOCS / "index.md"] + sorted((DOCS / "tutorials").glob("*.md"))
# A fence may be indented (inside a list item); the block's lines lose that indent.
PYTHON_BLOCK = re.compile(
    r"^(?P<indent>[ ]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```[ ]*$", re.DOTALL | re.MULTILINE
)
# `print(expr)  # True: why` states what the line prints; the runner checks it on that same line
# (line numbers stay those of the page), evaluating `expr` once, as the page does.
PRINTED_CLAIM = re.compile(r"^(?P<indent>[ ]*)print\((?P<expr>.*)\)[ ]*#[ ]*(?P<claim>True|False)\b.*$", re.MULTILINE)
# A float literal in scientific notation (1e-5, 2.5e-7): a tolerance someone typed in.
LITERAL_TOLERANCE = re.compile(r"\b\d+(\.\d*)?[eE]-\d+\b")
# The machines that run the suite keep tiny Shakespeare beside the repository (DESIGN §6).
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
# Each page runs well under this; the margin covers a loaded 2-core CI machine.
PAGE_TIMEOUT_S = 180


def python_blocks(markdown: str) -> list[str]:
    blocks = []
    for match in PYTHON_BLOCK.finditer(markdown):
        indent = len(match.group("indent"))
        blocks.append("\n".join(line[indent:] for line in match.group("code").splitlines()))
    return blocks


def with_printed_claims_checked(code: str, page: str) -> str:
    """``code`` with every ``print(expr)  # True`` line also asserting that it printed ``True``."""

    def checked(match: re.Match) -> str:
        indent, expr, claim = match.group("indent"), match.group("expr"), match.group("claim")
        message = f"{page}: print({expr}) is documented to print {claim}"
        return f"{indent}_claimed = {expr}; print(_claimed); assert str(_claimed) == {claim!r}, {message!r}"

    return PRINTED_CLAIM.sub(checked, code)


def test_block_extraction_finds_fenced_python_only():
    sample = "text\n```python\nx = 1\n```\n```bash\nls\n```\n    ```python\n    y = x\n    ```\n"
    assert python_blocks(sample) == ["x = 1", "y = x"]


def test_printed_claims_are_checked():
    holds = with_printed_claims_checked("x = 2\nprint(x == 2)  # True: two is two\n", "sample.md")
    exec(compile(holds, "sample.md", "exec"), {})
    broken = with_printed_claims_checked("x = 3\nprint(x == 2)  # True: two is two\n", "sample.md")
    assert broken.count("\n") == 2, "the check must stay on the claim's line"
    with pytest.raises(AssertionError, match=r"sample.md: print\(x == 2\) is documented to print True"):
        exec(compile(broken, "sample.md", "exec"), {})


def test_readme_claim_is_one_the_runner_checks():
    # The README's and Getting-started's example ends on `print(...)  # True`: if the pattern
    # stopped matching it, the claim would go back to being printed and never checked.
    for page in (ROOT / "README.md", DOCS / "index.md"):
        code = "\n".join(python_blocks(page.read_text()))
        assert PRINTED_CLAIM.search(code), f"{page.relative_to(ROOT)}: no `print(...)  # True` claim found"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_tolerances_come_from_the_dtype(page):
    # A page teaches by example: an `assert |x - y| < 1e-5` teaches a number with no reason
    # (and breaks at another dtype); use torch.finfo(dtype).eps or geomuon's own
    # default_tolerance(dtype), whose docstrings derive them.
    typed = [line.strip() for block in python_blocks(page.read_text()) for line in block.splitlines()
             if "assert" in line and LITERAL_TOLERANCE.search(line.split("#")[0])]
    assert not typed, f"{page.relative_to(ROOT)}: tolerance typed in, not taken from the dtype: {typed}"


def test_every_tutorial_page_has_code():
    for page in PAGES:
        assert python_blocks(page.read_text()), f"{page.relative_to(ROOT)} has no ```python block to run"


def test_custom_manifold_tutorial_fits_in_40_lines():
    code = python_blocks((DOCS / "tutorials" / "custom-manifold.md").read_text())
    lines = [line for block in code for line in block.splitlines() if line.strip()]
    assert 0 < len(lines) < 40, f"{len(lines)} non-blank lines of code"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_code_runs_as_written(page, tmp_path):
    blocks = python_blocks(page.read_text())
    script = tmp_path / f"{page.stem}.py"
    script.write_text(with_printed_claims_checked("\n\n".join(blocks), page.name) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    if SHAKESPEARE.is_file():
        env.setdefault("TINYSHAKESPEARE", str(SHAKESPEARE))
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, (
        f"{page.relative_to(ROOT)} failed after {elapsed:.1f}s:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    print(f"{page.relative_to(ROOT)}: {elapsed:.1f}s\n{result.stdout[-2000:]}")
