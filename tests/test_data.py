"""Data sources of ``geomuon.pretrain.data``: embedded corpus, Shakespeare, GPT-2 token shards."""

import os
import shutil

import numpy as np
import pytest
import torch

from geomuon.pretrain.data import (
    SHAKESPEARE_SHA256,
    _batch_seed,
    load_data,
    read_shard,
    shard_data,
    write_llmc_shard,
)

SHAKESPEARE = "/work/shared/data/tinyshakespeare.txt"


def test_embedded_corpus_needs_no_download():
    data = load_data("embedded")
    assert len(data.train) > 100_000 and len(data.val) > 10_000
    assert data.vocab_size == len(data.itos) and data.train.max() < data.vocab_size
    assert "def" in data.decode(data.train[:20_000].tolist())


@pytest.mark.skipif(not os.path.exists(SHAKESPEARE), reason="tiny Shakespeare is not on this machine")
def test_shakespeare_from_path_with_checksum(tmp_path):
    data = load_data(f"shakespeare:{SHAKESPEARE}")
    assert data.vocab_size == 65 and len(data.train) + len(data.val) == 1_115_394
    assert data.decode(data.train[:9].tolist()) == "First Cit"
    tampered = tmp_path / "shakespeare.txt"
    shutil.copy(SHAKESPEARE, tampered)
    with open(tampered, "a") as f:
        f.write("x")
    with pytest.raises(ValueError, match=f"differs from the expected {SHAKESPEARE_SHA256}"):
        load_data(f"shakespeare:{tampered}")
    assert load_data(f"shakespeare:{tampered}:nocheck").vocab_size == 65


def test_llmc_and_nanogpt_shards_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=5000).astype(np.uint16)
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", tokens[:1000])
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", tokens[1000:3000])
    write_llmc_shard(tmp_path / "fineweb_train_000002.bin", tokens[3000:])
    data = shard_data(str(tmp_path))
    assert np.array_equal(data.val, tokens[:1000]) and np.array_equal(data.train, tokens[1000:])
    nano = tmp_path / "nano"
    nano.mkdir()
    tokens[:4000].tofile(nano / "train.bin")
    tokens[4000:].tofile(nano / "val.bin")
    data = load_data(f"tokens:{nano}")
    assert np.array_equal(data.train, tokens[:4000]) and data.vocab_size == 50304


def test_several_shards_stay_on_disk_and_give_the_windows_of_their_concatenation(tmp_path):
    # np.concatenate had read every shard of a split into memory, in every process (about 20 GB
    # per rank for FineWeb-10B); the shards stay memmaps, and a window is gathered when drawn
    tokens = np.random.default_rng(0).integers(0, 50257, size=3000).astype(np.uint16)
    bounds = [0, 700, 1500, 2600]  # three train shards of unequal lengths
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        write_llmc_shard(tmp_path / f"fineweb_train_{i:06d}.bin", tokens[a:b])
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", tokens[2600:])
    data = shard_data(str(tmp_path))
    parts = getattr(data.train, "parts", [data.train])
    assert len(parts) == 3 and all(isinstance(part, np.memmap) for part in parts)
    assert len(data.train) == 2600
    whole = tokens[:2600]
    for start, stop in ((0, 700), (690, 710), (650, 1600), (1500, 2600), (2599, 2600), (5, 5), (0, 2600)):
        assert np.array_equal(data.train[start:stop], whole[start:stop]), (start, stop)  # across boundaries too
    # the batches are those of the concatenated stream, windows that cross a boundary included
    concatenated = type(data)(whole, tokens[2600:], data.vocab_size, data.source)
    for step in range(20):
        for got, expected in zip(data.batch("train", 8, 64, 0, step), concatenated.batch("train", 8, 64, 0, step)):
            assert torch.equal(got, expected)


def test_the_data_identity_names_what_changed(tmp_path):
    # what a resumed run compares with its checkpoint's (a changed corpus had resumed silently)
    from geomuon.pretrain.data import identity_changes

    tokens = np.random.default_rng(0).integers(0, 50257, size=3000).astype(np.uint16)
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", tokens[:500])
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", tokens[500:1500])
    write_llmc_shard(tmp_path / "fineweb_train_000002.bin", tokens[1500:2500])
    before = shard_data(str(tmp_path)).identity
    assert identity_changes(before, shard_data(str(tmp_path)).identity) == []  # read again: the same data
    write_llmc_shard(tmp_path / "fineweb_train_000003.bin", tokens[2500:])  # a shard added
    changes = identity_changes(before, shard_data(str(tmp_path)).identity)
    assert changes[0] == "train tokens: 2000 → 2500" and changes[1].startswith("tokens sha256: ")
    replaced = tokens[1500:2500].copy()
    replaced[-1] ^= 1  # one token of a shard replaced: same names and lengths
    write_llmc_shard(tmp_path / "fineweb_train_000002.bin", replaced)
    os.remove(tmp_path / "fineweb_train_000003.bin")
    assert [c.split(":")[0] for c in identity_changes(before, shard_data(str(tmp_path)).identity)] == ["tokens sha256"]
    text = tmp_path / "corpus.txt"
    text.write_text("abcabc" * 100)
    before = load_data(f"text:{text}").identity
    text.write_text("abcabd" * 100)
    assert identity_changes(before, load_data(f"text:{text}").identity)[:2] == [
        "characters added: 'd'", "vocab size: 3 → 4"]


def test_malformed_shards_name_the_file_and_the_problem(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    path = tmp_path / "s.bin"
    write_llmc_shard(path, tokens)
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * 60)
    with pytest.raises(ValueError, match=r"s\.bin.*header says 100 tokens.*truncated"):
        read_shard(str(path))
    write_llmc_shard(path, tokens, version=7)
    with pytest.raises(ValueError, match=r"s\.bin.*version 7"):
        read_shard(str(path))
    with open(path, "wb") as f:  # magic, then nothing
        f.write(np.array([20240520], dtype="<i4").tobytes())
    with pytest.raises(ValueError, match="truncated llm.c header"):
        read_shard(str(path))
    with open(path, "wb") as f:
        f.write(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a whole number of uint16"):
        read_shard(str(path))
    np.array([1, 60000], dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="token id 60000 ≥ vocab_size 50304"):
        read_shard(str(path))
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    tokens.tofile(only_train / "train.bin")
    with pytest.raises(ValueError, match=r"only_train.*has no val shard"):
        shard_data(str(only_train))
    with pytest.raises(ValueError, match="does not exist"):
        read_shard(str(tmp_path / "missing.bin"))
    open(path, "wb").close()  # empty: numpy's "cannot mmap an empty file" had named no file
    with pytest.raises(ValueError, match=r"s\.bin' holds no tokens \(the file is empty\)"):
        read_shard(str(path))


def test_corpus_shorter_than_context_is_an_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("to be or not to be, " * 20)  # 400 characters: val split has 40
    data = load_data(f"text:{path}")
    data.check_context(32)
    with pytest.raises(ValueError, match=r"short\.txt.*val split has 40 tokens.*--block-size"):
        data.check_context(64)
    with pytest.raises(ValueError, match="unknown data spec"):
        load_data("webtext")
    # a folder given as a text file had been reported as missing
    with pytest.raises(ValueError, match=r"is a folder; give a text file"):
        load_data(f"text:{tmp_path}")


def test_an_unreadable_corpus_is_refused_by_name(tmp_path, unreadable_data_files):
    # an unreadable text file had been a bare PermissionError traceback (root reads a chmod-000
    # file, so the refusal is simulated where read_text opens it)
    path = tmp_path / "corpus.txt"
    path.write_text("to be or not to be, " * 100)
    assert load_data(f"text:{path}").vocab_size > 0  # control: readable, it loads

    unreadable_data_files()
    with pytest.raises(ValueError, match=r"data file '.*corpus\.txt' cannot be read \(Permission denied\)"):
        load_data(f"text:{path}")


def test_batches_depend_only_on_seed_and_step():
    data = load_data("embedded")
    x1, y1 = data.batch("train", 4, 16, seed=0, step=5)
    x2, y2 = data.batch("train", 4, 16, seed=0, step=5)
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])
    assert not torch.equal(x1, data.batch("train", 4, 16, seed=0, step=6)[0])
    assert not torch.equal(x1, data.batch("train", 4, 16, seed=1, step=5)[0])
    assert x1.dtype == torch.int64 and x1.shape == (4, 16)


def test_no_two_seeds_share_a_stream_of_batches():
    # The linear seed * 1_000_003 + 2 * step + val had given seed 0's batch 1,000,003 the
    # generator of seed 2's batch 0 (and so every later one: two "independent" seeds trained
    # on one stream, shifted). Control: the pairs below are the ones it made equal.
    def linear(seed, step, val):
        return (seed * 1_000_003 + step * 2 + int(val)) % (2**63 - 1)

    collided = [((0, 1_000_003, False), (2, 0, False)), ((5, 2_000_006, False), (9, 0, False)),
                ((0, 500_002, False), (1, 0, True))]
    data = load_data("embedded")
    for first, second in collided:
        assert linear(*first) == linear(*second)
        assert _batch_seed(*first) != _batch_seed(*second)
        (seed_a, step_a, val_a), (seed_b, step_b, val_b) = first, second
        if val_a == val_b:  # one split: the batches themselves (one generator seed had drawn one batch)
            split = "val" if val_a else "train"
            a = data.batch(split, 4, 16, seed=seed_a, step=step_a)[0]
            assert not torch.equal(a, data.batch(split, 4, 16, seed=seed_b, step=step_b)[0])



def test_a_seed_or_step_that_is_not_an_integer_is_refused_not_drawn_as_another_stream():
    """The generator seed is the decimal spelling of ``(seed, step)``: a float seed ``1.0``
    had drawn other batches than ``1`` ("1.0/5/train" vs "1/5/train"), and a tensor step
    (an optimizer's ``state["step"]``) those of the text "tensor(5.)", both without a word.
    Each is now a ValueError naming the argument; numpy integers are the same integers."""
    data = load_data("embedded")
    for name, seed, step in (("seed", 1.0, 5), ("seed", -1, 5), ("seed", True, 5),
                             ("step", 1, 5.0), ("step", 1, torch.tensor(5.0)), ("step", 1, -1)):
        with pytest.raises(ValueError, match=rf"{name} must be an integer >= 0"):
            data.batch("train", 2, 8, seed=seed, step=step)
    control = data.batch("train", 2, 8, seed=1, step=5)[0]
    assert torch.equal(data.batch("train", 2, 8, seed=np.int64(1), step=np.uint32(5))[0], control)

@pytest.mark.parametrize("magic, version", [(1234, 1), (20240801, 7), (20240520 + 1, 1)])
def test_an_llmc_header_with_another_magic_is_refused_not_read_as_tokens(tmp_path, magic, version):
    """Before: a header starting with 1234 was taken for a headerless nanoGPT file and its
    512 header "tokens" were trained on."""
    path = tmp_path / "fineweb_train_000001.bin"
    write_llmc_shard(path, np.arange(300, dtype=np.uint16), magic=magic, version=version)
    with pytest.raises(ValueError, match=rf"fineweb_train_000001\.bin.*starts like an llm\.c header \(magic {magic}"
                                         rf".*not 20240520"):
        read_shard(str(path))
    with open(path, "r+b") as f:  # truncated as well: the zero padding still gives the header away
        f.truncate(1024 + 2 * 100)
    with pytest.raises(ValueError, match="starts like an llm.c header"):
        read_shard(str(path))


def test_headerless_shards_whose_start_is_not_a_header_still_load(tmp_path):
    """The control: nanoGPT files (random GPT-2 tokens, and a 1024-byte-long run of one token
    that is not 0) are read as tokens, even when their size matches a "token count"."""
    rng = np.random.default_rng(1)
    for tokens in (rng.integers(0, 50257, size=2000).astype(np.uint16), np.full(1200, 11, dtype=np.uint16)):
        path = tmp_path / "train.bin"
        tokens.tofile(path)
        assert np.array_equal(read_shard(str(path)), tokens)


def test_char_splits_are_disjoint_and_their_windows_reach_every_token(tmp_path):
    """The first 90 % of the text is train, the rest val: together, in order, they are the
    encoded text. Windows of ``block_size + 1`` tokens start
    anywhere in ``[0, len - block_size - 1]`` — so the last token of each split is a target
    — and lie inside their split (a val window never reads train tokens)."""
    text = "".join(chr(0x3B1 + (i * 37) % 100) for i in range(100))  # 100 distinct characters: a token is a position
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    data = load_data(f"text:{path}")
    encoded = [data.itos.index(c) for c in text]
    assert len(data.train) == 90 and list(data.train) + list(data.val) == encoded
    T = 4
    for split, tokens in (("train", data.train), ("val", data.val)):
        starts = set()
        for step in range(200):  # 200 × 8 draws of ≤ 86 starts: each is missed with probability < 1e-8
            x, y = data.batch(split, 8, T, seed=3, step=step)
            for row_x, row_y in zip(x.tolist(), y.tolist()):
                start = list(tokens).index(row_x[0])
                assert row_x == list(tokens[start:start + T]) and row_y == list(tokens[start + 1:start + T + 1])
                starts.add(start)
        assert starts == set(range(len(tokens) - T)), split


def test_the_embedded_corpus_identity_is_its_source_and_the_hash_of_its_tokens():
    """What a checkpoint keeps of the embedded corpus: its source, vocabulary and split sizes,
    and a sha256 of the train then val tokens — recomputed here from the arrays."""
    import hashlib

    data = load_data("embedded")
    identity = data.identity
    assert identity["source"] == "embedded:pydoc_data.topics"
    assert identity["characters"] == "".join(data.itos) and identity["vocab_size"] == len(data.itos)
    assert (identity["train_tokens"], identity["val_tokens"]) == (len(data.train), len(data.val))
    digest = hashlib.sha256(np.ascontiguousarray(data.train).tobytes() + np.ascontiguousarray(data.val).tobytes())
    assert identity["sha256"] == digest.hexdigest()


def test_spec_source_is_the_source_load_data_gives(tmp_path):
    # train() refuses data whose source is not its config's spec; the two must agree for every form
    from geomuon.pretrain.data import load_data, spec_source

    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    for spec in ("embedded", f"text:{text}"):
        assert spec_source(spec) == load_data(spec).source
    assert spec_source(f"shakespeare:{text}:nocheck") == load_data(f"shakespeare:{text}:nocheck").source


def test_batch_refuses_another_split_and_windows_it_cannot_draw():
    """``batch`` had read the val tokens for any split but "train" ("validation", "Train"),
    seeded as train; a ``block_size`` ≥ the split's length had raised torch's "random_ expects
    'from' to be less than 'to'", a ``batch_size`` of 0 numpy's "need at least one array to
    stack", a ``block_size`` of 0 returned empty windows. Each is now a ValueError naming the
    argument."""
    data = load_data("embedded")
    for split in ("validation", "Train", "test"):
        with pytest.raises(ValueError, match=rf"unknown split '{split}'; use one of \('train', 'val'\)"):
            data.batch(split, 2, 8, seed=0, step=0)
    with pytest.raises(ValueError, match=rf"the val split has {len(data.val)} tokens, fewer than block_size \+ 1"):
        data.batch("val", 2, len(data.val), seed=0, step=0)
    for name, batch_size, block_size in (("batch_size", 0, 8), ("block_size", 2, 0), ("batch_size", 2.0, 8)):
        with pytest.raises(ValueError, match=rf"{name} must be a positive integer"):
            data.batch("train", batch_size, block_size, seed=0, step=0)
    # the largest window the val split holds, and numpy integers, are drawn
    x, y = data.batch("val", np.int64(2), len(data.val) - 1, seed=0, step=0)
    assert x.shape == (2, len(data.val) - 1) and torch.equal(y[0], torch.from_numpy(data.val[1:]))


def test_a_token_folder_named_with_glob_characters_loads_its_shards(tmp_path):
    """The folder had been read as a glob pattern: llm.c shards in ``run[1]`` matched nothing
    and the folder was reported to have no train shard."""
    folder = tmp_path / "run[1]"
    folder.mkdir()
    tokens = np.random.default_rng(0).integers(0, 50257, size=1500).astype(np.uint16)
    write_llmc_shard(folder / "fineweb_train_000001.bin", tokens[:1000])
    write_llmc_shard(folder / "fineweb_val_000000.bin", tokens[1000:])
    data = load_data(f"tokens:{folder}")
    assert np.array_equal(data.train, tokens[:1000]) and np.array_equal(data.val, tokens[1000:])
    # a file given as the folder had been reported as missing
    with pytest.raises(ValueError, match=r"fineweb_val_000000\.bin' is a file; tokens:DIR takes the folder"):
        load_data(f"tokens:{folder / 'fineweb_val_000000.bin'}")


def test_a_shard_named_for_both_splits_is_refused_not_trained_and_validated_on(tmp_path):
    """``approval_train_000001.bin`` holds "val" (appro-val) as well as "train": it had been
    both a train and a val shard, so validation measured the training tokens."""
    tokens = np.random.default_rng(0).integers(0, 50257, size=1500).astype(np.uint16)
    write_llmc_shard(tmp_path / "approval_train_000001.bin", tokens[:1000])
    write_llmc_shard(tmp_path / "approval_val_000000.bin", tokens[1000:])
    with pytest.raises(ValueError, match=r"approval_train_000001\.bin' match both \*train\*\.bin and \*val\*\.bin"):
        load_data(f"tokens:{tmp_path}")
    os.rename(tmp_path / "approval_train_000001.bin", tmp_path / "appro_train_000001.bin")  # the control
    assert len(load_data(f"tokens:{tmp_path}").val) == 500


def test_a_spec_without_a_file_or_not_a_string_is_refused_by_its_form():
    """``shakespeare::nocheck`` had passed ``spec_problem`` (the config's check, before any
    work) and failed at load as "data file '' does not exist"; a ``pathlib.Path`` spec had
    raised AttributeError 'partition'."""
    from pathlib import Path

    from geomuon.pretrain.data import spec_problem

    for spec in ("shakespeare::nocheck", "shakespeare:"):
        assert spec_problem(spec) == f"data spec {spec!r} names no file; use shakespeare:PATH[:nocheck]"
    with pytest.raises(ValueError, match=r"data spec PosixPath\('corpus.txt'\) is a PosixPath; give a string"):
        load_data(Path("corpus.txt"))
    for spec in ("shakespeare:a:b.txt", "shakespeare:nocheck", "text:x", "tokens:d", "embedded"):
        assert spec_problem(spec) is None, spec


def test_the_shakespeare_checksum_is_checked_without_the_shared_file(tmp_path, monkeypatch):
    """The path of ``shakespeare:PATH`` had been tested only where tiny Shakespeare lies in
    /work/shared (skipped elsewhere): a stand-in file whose sha256 is the expected one loads,
    a file with another sha256 is refused unless ``:nocheck``, and PATH may hold ':'."""
    import hashlib

    from geomuon.pretrain import data as data_module

    path = tmp_path / "col:on" / "tiny.txt"
    path.parent.mkdir()
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20)
    monkeypatch.setattr(data_module, "SHAKESPEARE_SHA256", hashlib.sha256(path.read_bytes()).hexdigest())
    data = load_data(f"shakespeare:{path}")
    assert data.source == f"shakespeare:{path}" and data.decode(data.train[:9].tolist()) == "First Cit"
    with open(path, "a") as f:
        f.write("x")
    with pytest.raises(ValueError, match=r"tiny\.txt'.*differs from the expected"):
        load_data(f"shakespeare:{path}")
    assert "x" in load_data(f"shakespeare:{path}:nocheck").itos


def test_a_seed_beyond_torchs_range_is_refused_by_the_config_before_any_data_is_read():
    """``--seed`` seeds the training batches and the initialisation (``torch.manual_seed``, whose
    range ends at 2**64 - 1). ``--seed 2**70`` had passed the config's check and failed after
    the data was read with torch's "Overflow when unpacking long long", naming no option.
    Control: the largest seed torch takes is valid, and torch does take it."""
    from geomuon.pretrain.config import MAX_SEED, TrainConfig

    torch.manual_seed(MAX_SEED)  # the bound is torch's own: this must not raise
    with pytest.raises(ValueError):
        torch.manual_seed(MAX_SEED + 1)
    TrainConfig(seed=MAX_SEED).validate()
    with pytest.raises(ValueError, match=rf"--seed must be in \[0, {MAX_SEED}\] \(got {MAX_SEED + 1}\)"):
        TrainConfig(seed=MAX_SEED + 1).validate()


def test_an_adamw_rate_no_parameter_of_the_model_takes_is_refused():
    """``--adamw-lr`` reaches the parameters a strategy leaves to AdamW and every vector. A
    Lipschitz model has no gains or biases, and ``symmetry`` gives each of its matrices another
    update, so the rate reached nothing; it had been accepted and ignored. Ground truth, on a
    real (small) model: no parameter is a vector, and symmetry names every role it has with an
    update other than AdamW (``assign`` would build no AdamW; building the optimizers is left
    out: its first call imports torch._dynamo, seconds). Controls: the same option with gains
    (``cpu-tiny``), with a strategy that leaves the embedding to AdamW, and the default rate."""
    from geomuon.optimizers.assign import STRATEGIES, classify
    from geomuon.pretrain.config import TrainConfig
    from geomuon.pretrain.model import GPT, get_config

    small = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
    roles = set(classify(GPT(get_config("cpu-lipschitz", **small))).values())
    assert "vector" not in roles and all(STRATEGIES["symmetry"][role].update != "adamw" for role in roles)
    with pytest.raises(ValueError, match=r"--adamw-lr 0\.01 would be ignored: .* --strategy symmetry has none on "
                                         r"the parameters of --config cpu-lipschitz"):
        TrainConfig(model="cpu-lipschitz", strategy="symmetry", adamw_lr=0.01, warmup_steps=0).validate()
    for model, strategy, rate in (("cpu-tiny", "symmetry", 0.01), ("cpu-lipschitz", "lipschitz", 0.01),
                                  ("cpu-lipschitz", "symmetry", TrainConfig().adamw_lr)):
        TrainConfig(model=model, strategy=strategy, adamw_lr=rate, warmup_steps=0).validate()
