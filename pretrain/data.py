r"""Training data: token streams, their sources, and deterministic batches.

Sources (``load_data(spec)``):

* ``"embedded"`` — the default: Python's own documentation topics (``pydoc_data.topics``,
  ≈ 465k characters of real English prose and code that ship with every CPython), char
  level. Needs no download.
* ``"shakespeare:PATH"`` — tiny Shakespeare from a local file, char level, checked
  against its sha256 (``--no-checksum`` style override: ``shakespeare:PATH:nocheck``; only
  that trailing ``:nocheck`` is a flag, so PATH may hold ':').
* ``"text:PATH"`` — any UTF-8 text file, char level.
* ``"tokens:DIR"`` — GPT-2 token shards: nanoGPT's headerless ``train.bin``/``val.bin``
  (uint16) or llm.c/modded-nanogpt shards ``*val*.bin``/``*train*.bin`` (a 256 × int32
  header ``[20240520, 1, n_tokens, 0, …]`` followed by ``n_tokens`` uint16 tokens).

Batches are a pure function of ``(seed, step)`` (:meth:`TokenData.batch`), so a resumed
run and a run on many processes draw exactly the batches of an uninterrupted
single-process run: every rank draws the same global batch and keeps its slice. A run's
checkpoints keep :attr:`TokenData.identity`, so a resume on other data is refused, and a
resume on the same data read from another path (moved, linked, spelled relative) is not.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import numbers
import os
from dataclasses import dataclass, field

import numpy as np
import torch

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
VAL_FRACTION = 0.1
SPLITS = ("train", "val")


class Shards:
    """The tokens of several uint16 shards (memmaps) in order, read as one stream without
    holding them in memory: ``len()`` and contiguous slices ``tokens[start:stop]``, which
    gather the pieces of the shards the slice spans (a window may cross a shard boundary,
    as in the concatenated stream). ``np.concatenate`` had copied a whole split into every
    process: about 20 GB per rank for FineWeb-10B's 100 shards."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(part) for part in parts])  # the stream offset of each shard, then the end

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole stream as one array, in memory (``np.asarray(tokens)``: asked for explicitly)."""
        return np.asarray(self[:], dtype=dtype)

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"Shards reads contiguous slices tokens[start:stop], not {index!r}")
        start, stop, _ = index.indices(len(self))
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        for i in range(first, len(self.parts)):
            if self.starts[i] >= stop:
                break
            pieces.append(self.parts[i][max(start - self.starts[i], 0) : stop - self.starts[i]])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces or [self.parts[0][:0]])


@dataclass
class TokenData:
    """Train/val token streams (int64 arrays, uint16 memmaps, or :class:`Shards` of several
    memmaps) and how to decode them."""

    train: np.ndarray | Shards
    val: np.ndarray | Shards
    vocab_size: int
    source: str
    itos: list[str] | None = None  # char-level vocabulary (None for GPT-2 tokens)
    meta: dict = field(default_factory=dict)

    def check_context(self, block_size: int) -> None:
        """Both splits must hold at least one window of ``block_size + 1`` tokens."""
        for split in SPLITS:
            self._check_window(split, block_size)

    def _check_window(self, split: str, block_size: int) -> None:
        """``split`` names a split holding at least one window of ``block_size + 1`` tokens."""
        if split not in SPLITS:
            # any other name had silently drawn val windows (with the train split's seeds)
            raise ValueError(f"data {self.source}: unknown split {split!r}; use one of {SPLITS}")
        self._check_integer("block_size", block_size)
        n = len(getattr(self, split))
        if n < block_size + 1:
            raise ValueError(
                f"data {self.source}: the {split} split has {n} tokens, fewer than "
                f"block_size + 1 = {block_size + 1}; use a shorter context (--block-size) "
                f"or a larger corpus"
            )

    def _check_integer(self, name: str, value, least: int = 1) -> None:
        """``value`` is an integer ≥ ``least`` (numpy integers too); a 0 had given empty windows or
        numpy's "need at least one array to stack", which names nothing."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            kind = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ValueError(f"data {self.source}: {name} must be {kind} (got {value!r})")

    def batch(self, split: str, batch_size: int, block_size: int, seed: int, step: int):
        """``(x, y)`` int64 ``[batch_size, block_size]`` windows drawn by a generator seeded
        from ``(seed, step, split)`` alone (:data:`BATCH_SEEDING`; distinct triples, distinct
        streams) — the same on every process and after resume.
        ``split`` is ``"train"`` or ``"val"``; ``ValueError`` (naming the argument) for
        another split, a ``batch_size`` or ``block_size`` below 1, a ``seed`` or ``step`` that is
        not an integer ≥ 0 (the seed is their decimal spelling: a float ``1.0`` or a tensor step
        had silently drawn other batches than ``1``), or a split shorter than one window of
        ``block_size + 1`` tokens."""
        self._check_window(split, block_size)
        self._check_integer("batch_size", batch_size)
        self._check_integer("seed", seed, least=0)
        self._check_integer("step", step, least=0)
        tokens = getattr(self, split)
        gen = torch.Generator().manual_seed(_batch_seed(int(seed), int(step), split == "val"))
        starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=gen).tolist()
        windows = np.stack([np.asarray(tokens[s : s + block_size + 1], dtype=np.int64) for s in starts])
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def decode(self, ids) -> str:
        if self.itos is None:
            raise ValueError(f"data {self.source}: GPT-2 token data has no char vocabulary to decode")
        return "".join(self.itos[i] for i in ids)

    @functools.cached_property
    def identity(self) -> dict:
        """What the batches depend on, as plain data (a run's checkpoints keep it; a resume
        compares it with :func:`identity_changes`): the vocabulary (its size, and its
        characters for char-level data), each split's length and a sha256 of both splits'
        tokens; and, as a record only, the source it was read from. Computed when first asked
        for: the hash reads every token once (about 0.6 s per GB on one core)."""
        digest = hashlib.sha256()
        for split in (self.train, self.val):
            for part in split.parts if isinstance(split, Shards) else [split]:
                digest.update(memoryview(np.ascontiguousarray(part)))
        return {"source": self.source, "vocab_size": self.vocab_size,
                "characters": None if self.itos is None else "".join(self.itos),
                "train_tokens": len(self.train), "val_tokens": len(self.val), "sha256": digest.hexdigest()}


def identity_changes(saved: dict, now: dict) -> list[str]:
    """How the data of :attr:`TokenData.identity` ``now`` differs from ``saved``, in words
    (empty when it is the same data). The tokens decide, not the ``source``: the same file
    read from another path (moved, through a link, a relative spelling) gives the same
    batches, and had been refused; another tokenization (characters or GPT-2 tokens) differs
    in its vocabulary and tokens, and is named first."""
    changes = []
    if (saved["characters"] is None) != (now["characters"] is None):
        changes.append("tokenization: " + " → ".join("GPT-2 tokens" if identity["characters"] is None else "characters"
                                                      for identity in (saved, now)))
    if saved["characters"] is not None and now["characters"] is not None:
        before, after = set(saved["characters"]), set(now["characters"])
        changes += [f"characters {words}: {''.join(sorted(chars))!r}"
                    for words, chars in (("added", after - before), ("removed", before - after)) if chars]
    changes += [f"{key.replace('_', ' ')}: {saved[key]!r} → {now[key]!r}"
                for key in ("vocab_size", "train_tokens", "val_tokens") if saved[key] != now[key]]
    if saved["sha256"] != now["sha256"]:
        changes.append(f"tokens sha256: {saved['sha256'][:12]}… → {now['sha256'][:12]}…")
    return changes


#: How :meth:`TokenData.batch` seeds its generator (a run's checkpoints record it: a resume must
#: draw the batches the run would have drawn). Before it, the seed was the linear
#: ``seed * 1_000_003 + 2 * step + val``, under which seed 0's training batches from step
#: 1,000,003 on were seed 2's from step 0.
BATCH_SEEDING = "blake2b-64"


def _batch_seed(seed: int, step: int, val: bool) -> int:
    """The generator seed of ``(seed, step, split)``: the first 8 bytes of their BLAKE2b digest, so
    no two of them share a stream (:data:`BATCH_SEEDING`)."""
    key = f"{seed}/{step}/{'val' if val else 'train'}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


# ----------------------------------------------------------------------------- text


def char_data(text: str, source: str) -> TokenData:
    """Char-level tokens of ``text``: the vocabulary is its sorted character set; the
    first 90% is train, the rest val."""
    if not text:
        raise ValueError(f"data {source}: the text is empty")
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = np.fromiter((stoi[c] for c in text), dtype=np.int64, count=len(text))
    n_train = int(len(ids) * (1 - VAL_FRACTION))
    return TokenData(ids[:n_train], ids[n_train:], len(itos), source, itos)


def embedded_corpus() -> str:
    """The documentation topics shipped with CPython, concatenated in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str, expected_sha256: str | None = None) -> str:
    """Read a UTF-8 text corpus, checking its sha256 when given; errors name the file."""
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a folder; give a text file (a folder of token shards is tokens:DIR)")
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:  # an unreadable file had been a PermissionError traceback
        raise ValueError(f"data file {path!r} cannot be read ({err.strerror or err})") from None
    if expected_sha256 is not None:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != expected_sha256:
            raise ValueError(
                f"data file {path!r}: sha256 {digest} differs from the expected "
                f"{expected_sha256}; the file is not the expected corpus (or is corrupt)"
            )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data file {path!r} is not UTF-8 text ({err})") from None


# ----------------------------------------------------------------------------- shards


def read_shard(path: str, vocab_size: int = 50304) -> np.ndarray:
    """Tokens of one GPT-2 shard as a read-only uint16 memmap.

    The format is recognised from the first int32: ``20240520`` is an llm.c header
    (checked: version 1, token count consistent with the file size); anything else is a
    headerless nanoGPT file (its first two uint16 would form 20240520 only with token
    54216 ≥ any GPT-2 vocabulary, so the two formats cannot be confused) — unless its
    first 1024 bytes look like an llm.c header with another magic number (see
    :func:`looks_like_llmc_header`), which is refused rather than read as 512 tokens.
    Tokens must be below ``vocab_size``."""
    if not os.path.isfile(path):
        raise ValueError(f"token shard {path!r} does not exist")
    size = os.path.getsize(path)
    header_bytes = LLMC_HEADER_INTS * 4
    with open(path, "rb") as f:
        head = f.read(4)
    first = np.frombuffer(head, dtype="<i4") if len(head) == 4 else np.empty(0, dtype="<i4")
    if len(first) and first[0] == LLMC_MAGIC:
        if size < header_bytes:
            raise ValueError(f"token shard {path!r}: truncated llm.c header ({size} of {header_bytes} bytes)")
        header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
        if header[1] != LLMC_VERSION:
            raise ValueError(f"token shard {path!r}: llm.c header version {header[1]}, expected {LLMC_VERSION}")
        n_tokens = int(header[2])
        expected = header_bytes + 2 * n_tokens
        if n_tokens < 0 or size != expected:
            raise ValueError(
                f"token shard {path!r}: header says {n_tokens} tokens ({expected} bytes) but the "
                f"file has {size} bytes; the shard is truncated or malformed — re-create it"
            )
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=header_bytes, shape=(n_tokens,))
    else:
        header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
        if looks_like_llmc_header(header, size):
            raise ValueError(
                f"token shard {path!r} starts like an llm.c header (magic {int(header[0])}, version "
                f"{int(header[1])}, {int(header[2])} tokens) but its magic is not {LLMC_MAGIC} "
                f"(llm.c GPT-2 uint16 shards, version {LLMC_VERSION}); other llm.c formats are not "
                f"supported — re-export the shard as GPT-2 uint16 tokens"
            )
        if size % 2:
            raise ValueError(
                f"token shard {path!r}: {size} bytes is not a whole number of uint16 tokens; "
                f"the file is truncated or not a nanoGPT .bin (llm.c shards start with int32 "
                f"{LLMC_MAGIC}, this one starts with {int(first[0]) if len(first) else 'nothing'})"
            )
        if size == 0:  # np.memmap cannot map an empty file (its error names none)
            raise ValueError(f"token shard {path!r} holds no tokens (the file is empty); re-create it")
        tokens = np.memmap(path, dtype="<u2", mode="r")
    if len(tokens) == 0:
        raise ValueError(f"token shard {path!r} holds no tokens")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(
            f"token shard {path!r}: token id {top} ≥ vocab_size {vocab_size} (the model's vocabulary); "
            f"train a model whose vocab_size exceeds {top} (--model-overrides '{{\"vocab_size\": ...}}'), "
            f"or the shard is not tokens of that vocabulary"
        )
    return tokens


def looks_like_llmc_header(header: np.ndarray, size: int) -> bool:
    """Whether the first 256 int32 of a file of ``size`` bytes are an llm.c header,
    whatever its magic: the token count ``header[2]`` matches the file size exactly, or the
    253 padding ints ``header[3:]`` are all zero. Read as GPT-2 tokens, the latter would
    be 506 consecutive ``!`` tokens in positions 6–511 — not text."""
    if len(header) < LLMC_HEADER_INTS:
        return False
    count_fits = 0 <= int(header[2]) and LLMC_HEADER_INTS * 4 + 2 * int(header[2]) == size
    return count_fits or not header[3:].any()


def shard_data(directory: str, vocab_size: int = 50304) -> TokenData:
    """GPT-2 tokens from ``directory``: nanoGPT ``train.bin``/``val.bin``, or llm.c shards
    whose names contain ``val``/``train`` (in sorted order; several shards stay memmaps, read
    as one stream through :class:`Shards`)."""
    if os.path.isfile(directory):
        raise ValueError(f"token directory {directory!r} is a file; tokens:DIR takes the folder of the "
                         f".bin shards (a text file is text:PATH)")
    if not os.path.isdir(directory):
        raise ValueError(f"token directory {directory!r} does not exist")
    paths = {}
    for split in SPLITS:
        plain = os.path.join(directory, f"{split}.bin")
        # the folder's name is not a pattern: one holding '[' had matched none of its shards
        pattern = os.path.join(glob.escape(directory), f"*{split}*.bin")
        paths[split] = [plain] if os.path.isfile(plain) else sorted(glob.glob(pattern))
        if not paths[split]:
            raise ValueError(
                f"token directory {directory!r} has no {split} shard: expected {split}.bin "
                f"(nanoGPT) or *{split}*.bin (llm.c)"
            )
    # a name holding both words (approval_train_000.bin) had been trained on and validated on
    if shared := sorted(set(paths["train"]) & set(paths["val"])):
        raise ValueError(
            f"token directory {directory!r}: {', '.join(map(repr, shared))} match both *train*.bin and "
            f"*val*.bin, so they would be both trained on and validated on; rename them so that "
            f"each shard's name holds one of 'train' and 'val'"
        )
    splits = {}
    for split in SPLITS:
        shards = [read_shard(p, vocab_size) for p in paths[split]]
        splits[split] = shards[0] if len(shards) == 1 else Shards(shards)
    return TokenData(splits["train"], splits["val"], vocab_size, f"tokens:{directory}")


def shakespeare_data(path: str, check: bool = True) -> TokenData:
    """Char-level tiny Shakespeare from the file ``path`` (any name, ':' included),
    checked against :data:`SHAKESPEARE_SHA256` unless ``check`` is false."""
    return char_data(read_text(path, SHAKESPEARE_SHA256 if check else None), f"shakespeare:{path}")


def load_data(spec: str = "embedded", vocab_size: int = 50304) -> TokenData:
    """Resolve a data spec (see the module docstring) into a :class:`TokenData`."""
    problem = spec_problem(spec)
    if problem:
        raise ValueError(problem)
    kind, _, rest = spec.partition(":")
    if kind == "embedded":
        return char_data(embedded_corpus(), spec_source(spec))
    if kind == "shakespeare":
        # only a trailing ":nocheck" is a flag: the path itself may hold ':' (splitting at
        # the first one had refused "col:on/tiny.txt" as an unknown flag 'on/tiny.txt')
        return shakespeare_data(rest.removesuffix(":nocheck"), check=not rest.endswith(":nocheck"))
    if kind == "text":
        return char_data(read_text(rest), f"text:{rest}")
    return shard_data(rest, vocab_size)


def read_from(source: str) -> str:
    """``source`` (a :attr:`TokenData.source`) with its file or folder as an absolute path, links
    resolved: where the data was read from, as a run's provenance records it (a relative path
    or a link names another file once the working folder or the link changes)."""
    kind, _, path = source.partition(":")
    return source if kind == "embedded" else f"{kind}:{os.path.realpath(path)}"


def spec_source(spec: str) -> str:
    """The ``source`` of the :class:`TokenData` that ``load_data(spec)`` returns, without
    reading anything (a ``:nocheck`` flag is not part of it)."""
    if spec == "embedded":
        return "embedded:pydoc_data.topics"
    return spec.removesuffix(":nocheck") if spec.startswith("shakespeare:") else spec


#: The forms of a data spec, as ``--data`` accepts them (see the module docstring).
DATA_SYNTAX = ("embedded", "shakespeare:PATH[:nocheck]", "text:PATH", "tokens:DIR")


def spec_problem(spec: str) -> str | None:
    """What is wrong with the form of a data spec (``None`` when it has one of
    :data:`DATA_SYNTAX`'s forms); the files it names are checked when it is loaded."""
    if not isinstance(spec, str):  # a pathlib.Path had raised AttributeError: 'partition'
        return f"data spec {spec!r} is a {type(spec).__name__}; give a string, one of: " + ", ".join(DATA_SYNTAX)
    kind, colon, rest = spec.partition(":")
    if kind == "embedded" and not colon:
        return None
    if kind == "shakespeare" and colon and not rest.removesuffix(":nocheck"):
        # "shakespeare::nocheck" had passed the config's check and failed at load with file ''
        return f"data spec {spec!r} names no file; use shakespeare:PATH[:nocheck]"
    if kind in ("shakespeare", "text", "tokens") and rest:
        return None
    return f"unknown data spec {spec!r}; use one of: " + ", ".join(DATA_SYNTAX)


def write_llmc_shard(path: str, tokens, *, magic: int = LLMC_MAGIC, version: int = LLMC_VERSION) -> None:
    """Write ``tokens`` as an llm.c shard (used by tests and data-preparation scripts)."""
    tokens = np.asarray(tokens, dtype="<u2")
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
