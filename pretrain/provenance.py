r"""How a measurement was produced: the commit of the code, the machine, Markdown tables.

Shared by the studies (:mod:`geomuon.pretrain.studies`) and the benchmark scripts of a
source checkout (``bench/``), so a results page and a benchmark table state their
provenance the same way. Nothing here needs a checkout: installed from a wheel,
:func:`git_commit` says the code is not a git checkout.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CHECKOUT", "code_fingerprint", "file_above", "git_commit", "machine", "markdown_row", "markdown_table",
           "require_writable"]


def file_above(path: Path) -> Path | None:
    """The first of ``path``'s parents that exists and is not a directory (a path through a
    file, which nothing can create or read: an output or data path refused by name), else ``None``."""
    return next((p for p in path.parents if p.exists() and not p.is_dir()), None)


def require_writable(option: str, folder: Path) -> None:
    """Create ``folder`` (and its parents) and write a probe file in it, refusing ``option``
    by name on any ``OSError``: a folder that cannot be created (``--out /proc/x``) had
    failed with a traceback after every run had trained (the studies' and the
    benchmarks' output folders)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # a name of its own (O_EXCL): two runs probing one folder had removed each other's probe
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".geomuon-write-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{option} {str(folder)!r} cannot be created or written ({err.strerror or err}); "
                         f"choose a folder you can write to") from None


def _checkout() -> Path | None:
    # pretrain/ sits at the top of the repository (pyproject's package-dir); an installed
    # copy lives in site-packages/geomuon/pretrain/, whose parent is no checkout of ours
    # even when the virtual environment happens to sit inside one.
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists() and (root / "pyproject.toml").is_file() and (root / "pretrain").is_dir():
        return root
    return None


#: The source checkout this code runs from (``None`` when installed from a wheel).
CHECKOUT: Path | None = _checkout()


def git_commit(short: bool = True, repo: Path | None = None) -> str:
    """``git rev-parse [--short] HEAD`` of the checkout (default :data:`CHECKOUT`), with
    ``-dirty`` when tracked files outside ``docs/results/`` have uncommitted changes (the
    measured code is then not exactly that commit), or ``-unknown-tree (git status: <its
    error>)`` when ``git status`` fails (a corrupt index, say): the tree is then not known
    to be clean, and a clean-looking hash would claim it was."""
    repo = CHECKOUT if repo is None else repo
    if repo is None:
        return "unknown (installed package, not a git checkout)"

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", *(["--short"] if short else []), "HEAD")
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        # Results pages are what these runs write: a page written earlier in the same
        # session does not make the measured code differ from the commit.
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/results")
        if status.returncode != 0:
            reason = (status.stderr.strip().splitlines() or [f"exit status {status.returncode}"])[0]
            return f"{head.stdout.strip()}-unknown-tree (git status: {reason})"
        return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


#: The subpackages whose source decides what a training run computes. ``pretrain/studies``
#: is left out: it writes pages, and what a study trains is named in each run's key, with the
#: source files of its hooks and the sources of the functions that build its runs hashed there
#: (``geomuon.pretrain.studies.common``).
_TRAINING_CODE = ("manifolds", "optimizers", "theory", "pretrain")


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """A 16-hex-digit hash of the installed ``geomuon`` training code (every ``.py`` file of
    :data:`_TRAINING_CODE` but ``pretrain/studies``, path and bytes) and torch's version.

    Unlike :func:`git_commit` it needs no checkout and sees uncommitted edits, so a cached
    result is reused only by the code that produced it (a study resumed after the engine
    changed trains its runs again instead of mixing old and new numbers)."""
    import importlib

    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    for package in _TRAINING_CODE:
        base = Path(importlib.import_module(f"geomuon.{package}").__file__).resolve().parent
        for path in sorted(base.rglob("*.py")):
            relative = path.relative_to(base)
            if package == "pretrain" and relative.parts[0] == "studies":
                continue
            digest.update(f"{package}/{relative.as_posix()}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def machine() -> str:
    """``"x86_64 Linux, 2 CPU(s), Intel(R) Xeon(R) Processor"``: what every table and study page
    says it ran on. The CPU count is of the CPUs this process may run on (its affinity mask, where
    the system has one): ``os.cpu_count()`` counts the host's, so a run confined to 8 of a node's
    128 CPUs (``taskset``, a batch scheduler) had been recorded as a 128-CPU measurement. The CPU
    model matters for digit-for-digit reproduction: the math libraries pick kernels (and so
    rounding) by instruction set, so a run on another CPU kind agrees only to within the seed
    spread."""
    model = _cpu_model()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.machine()} {platform.system()}, {usable} CPU(s)" + (f", {model}" if model else "")


def _cpu_model() -> str:
    """The first ``model name`` of ``/proc/cpuinfo`` (Linux), else ``platform.processor()`` (may be empty)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown_row(cells: list[str]) -> str:
    """One ``| a | b |`` row."""
    return "| " + " | ".join(cells) + " |"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (what the scripts print and the docs include)."""
    return "\n".join([markdown_row(header), "|" + "---|" * len(header), *map(markdown_row, rows)])
