"""The seed studies (``geomuon study NAME``): each command runs end to end at its tiny
size and writes a results page, figures and a JSON record of the right structure; the
statistics that decide what a page may claim; the seed-code reference pieces of the
manifolds study.

The tiny size trains every variant for 3 steps on a 16-character context, so these
tests check the machinery (every variant builds, trains, is evaluated and reported), not
the studies' numbers.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import re
import types
from pathlib import Path

import pytest
import torch

from geomuon import cli as geomuon_cli
from geomuon.optimizers.assign import STRATEGIES, Hyper
from geomuon.pretrain.model import GPT, get_config
from geomuon.pretrain.studies import STUDIES, common
from geomuon.pretrain.studies import lipschitz as lipschitz_study
from geomuon.pretrain.studies import manifolds as manifolds_study
from geomuon.pretrain.studies import manifolds_long as long_study
from geomuon.pretrain.studies import manifolds_long_arms as long_arms_study
from geomuon.pretrain.studies import sweep
from geomuon.pretrain.studies import symmetry as symmetry_study

REGISTERED_STRATEGIES = frozenset(STRATEGIES)
# CI copies the shared data beside the clone (../shared); the studies take it by --data.
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
needs_data = pytest.mark.skipif(not DATA.is_file(), reason=f"tiny Shakespeare not at {DATA}")

# study → an observable its extra_metrics must add to every evaluation
STUDY_KEYS = {
    manifolds_study: "qk_sigma_product",
    lipschitz_study: "max_weight_rms_norm",
    symmetry_study: "expert_imbalance",
    long_study: "val_acc",  # no observables of its own: the loop's
    long_arms_study: "qk_sigma_product",
}
SEEDS = (0, 1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--size", "tiny", "--seeds", ",".join(map(str, SEEDS)), "--jobs", "1", "--data", str(DATA),
            "--out", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work"), *extra]


def _run(study, tmp_path: Path, *extra: str) -> int:
    torch.set_num_threads(1)
    return common.main(study, _argv(tmp_path, *extra))


@pytest.fixture(scope="module")
def run_once(tmp_path_factory):
    """``run_once(study) -> (study, directory, exit code)``: each study runs at its tiny
    size once per module, whichever test asks first."""
    done = {}

    def run(study):
        if study not in done:
            tmp_path = tmp_path_factory.mktemp(study.NAME)
            done[study] = (study, tmp_path, _run(study, tmp_path))
        return done[study]

    return run


@pytest.fixture(params=list(STUDY_KEYS), ids=lambda s: s.NAME)
def study_run(request, run_once):
    return run_once(request.param)


@needs_data
def test_study_writes_page_figures_and_record(study_run):
    study, tmp_path, code = study_run
    assert code == 0
    page = (tmp_path / "results" / f"{study.NAME}.md").read_text()
    variant_names = [v.name for v in study.variants(study.SIZES["tiny"])]

    assert page.startswith(f"# {study.TITLE}\n")
    assert '!!! warning "Not a result"' in page  # a tiny run must never pass for a result
    # the results table: one row per variant, every cell of the first numeric column mean ± std
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([^`]*)`", row).group(1) for row in rows[: len(variant_names)]] == variant_names
    for row in rows[: len(variant_names)]:
        assert re.search(r"\| -?\d+\.\d+ ± \d+\.\d+ ", row), row
    assert "```json" in page and '"size": "tiny"' in page
    assert re.search(r"\| commit \| `([0-9a-f]{40}|unknown)", page)
    # the text the runs read, checked by its sha256 before they started (the page had not named it)
    from geomuon.pretrain.data import SHAKESPEARE_SHA256

    assert f"| data | `{DATA} (sha256 {SHAKESPEARE_SHA256})` |" in page
    assert re.search(r"\| wall time \| \d+ s", page)

    figures = re.findall(rf"!\[[^\]]*\]\({study.NAME}/([^)]+\.png)\)", page)
    assert len(figures) >= (2 if study is long_study else 3)  # the loss curves, then the study's observables
    for name in figures:
        assert (tmp_path / "results" / study.NAME / name).read_bytes()[:8] == PNG_MAGIC

    record = common.read_results(tmp_path / "results" / study.NAME)
    assert record["size"] == "tiny" and record["config"]["steps"] == study.SIZES["tiny"].steps
    assert record["data"] == f"{DATA} (sha256 {SHAKESPEARE_SHA256})"
    # strict JSON, as jq and JSON.parse read it (a NaN metric spelled "NaN", read back as the float)
    strict_json((tmp_path / "results" / study.NAME / common.RESULTS).read_bytes())
    assert list(record["runs"]) == variant_names
    for name, runs in record["runs"].items():
        assert [r["seed"] for r in runs] == list(SEEDS)
        for run in runs:
            assert run["completed"], (name, run["seed"])
            assert len(run["train_loss"]) == study.SIZES["tiny"].steps
            assert run["evals"][-1]["step"] == study.SIZES["tiny"].steps
            assert STUDY_KEYS[study] in run["evals"][-1]


def strict_json(compressed: bytes):
    """The gzip-compressed JSON parsed strictly: a bare NaN or Infinity token is refused."""
    def refuse(token):
        raise ValueError(f"not strict JSON: a bare {token}")

    return json.loads(gzip.decompress(compressed), parse_constant=refuse)


def test_the_published_results_are_strict_json():
    # symmetry's results.json.gz had held 42 bare NaN tokens (routing churn at the first
    # evaluation), which jq and JSON.parse refuse; read_results gives them back as floats
    pages = sorted((ROOT / "docs" / "results").glob(f"*/{common.RESULTS}"))
    assert pages
    for path in pages:
        strict_json(path.read_bytes())
    churn = [value for runs in common.read_results(ROOT / "docs" / "results" / "symmetry")["runs"].values()
             for run in runs for record in run["evals"] for value in (record.get("routing_churn") or {}).values()]
    assert any(isinstance(v, float) and math.isnan(v) for v in churn)
    with pytest.raises(ValueError, match="bare NaN"):  # control: the former encoding is refused
        strict_json(gzip.compress(json.dumps({"churn": math.nan}).encode()))


@needs_data
def test_the_page_states_the_number_of_seeds_it_ran(study_run):
    # every page had said "with three seeds" whatever --seeds gave; these runs have two
    study, tmp_path, code = study_run
    assert code == 0
    page = (tmp_path / "results" / f"{study.NAME}.md").read_text()
    assert f"with {len(SEEDS)} seeds per variant this is a rough screen" in page and "three seeds" not in page


@needs_data
def test_cli_dispatch_reuses_cached_runs(run_once, tmp_path, capsys):
    """``geomuon study NAME`` reaches the study; a rerun with the same settings trains
    nothing (every record comes from the work directory's cache)."""
    study, first, code = run_once(lipschitz_study)
    assert code == 0
    argv = _argv(first)
    argv[argv.index("--out") + 1] = str(tmp_path)
    assert geomuon_cli.main(["study", study.NAME, *argv]) == 0
    runs = len(study.variants(study.SIZES["tiny"])) * len(SEEDS)
    assert f"{runs} runs; {runs} complete, 0 to train" in capsys.readouterr().out
    assert (tmp_path / f"{study.NAME}.md").read_text().count("| `") >= len(study.variants(study.SIZES["tiny"]))


def test_a_run_whose_hook_source_changed_is_never_reused(tmp_path, monkeypatch):
    """A variant's ``customize`` lives in pretrain/studies, outside the code fingerprint: the
    run key hashes the file that defines it, so an edited hook trains again (it had reused the
    old records). Control: an unchanged file finds the same folder."""
    import importlib.util

    hook_file = tmp_path / "study_hooks.py"
    hook_file.write_text("def customize(model, assignment, hyper):\n    return assignment\n")
    spec = importlib.util.spec_from_file_location("study_hooks", hook_file)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    study = STUDIES["manifolds"]
    size = common.size_from(study, "tiny")
    variant = dataclasses.replace(study.variants(size)[0], customize=hooks.customize)

    def folder():
        return common.run_folder(tmp_path, study.NAME, variant, size, 0, str(DATA), 1)

    before = folder()
    assert folder() == before
    hook_file.write_text("def customize(model, assignment, hyper):\n    return assignment  # capped\n")
    assert folder() != before


def test_a_customize_hook_that_is_no_top_level_function_is_refused_by_name():
    """A variant's ``customize`` is named by module and name in its run key and sent to worker
    processes by that name: a ``functools.partial`` had failed inside ``identity`` (``AttributeError:
    __qualname__``), a lambda or a nested function at the first worker. Control: a top-level
    function of a study module is taken."""
    import functools

    def nested(model, assignment, hyper):
        return assignment

    for hook in (functools.partial(manifolds_study.column_cap_on_dgram), lambda model, assignment, hyper: assignment,
                 nested):
        with pytest.raises(ValueError, match=r"Variant 'arm': customize must be a function defined at the top level "
                                             r"of a module .*wrap what it does in one"):
            common.Variant("arm", "an arm", "hetero", customize=hook)
    arm = common.Variant("arm", "an arm", "hetero", customize=manifolds_study.column_cap_on_dgram)
    assert arm.identity()["customize"].endswith("manifolds.column_cap_on_dgram")


def _first_manifolds_run_folder(tmp_path):
    """``folder()``: the run folder the manifolds study's first tiny variant, seed 0, takes under
    ``tmp_path``, asked anew at each call (what the keys of the two tests below decide)."""
    study = STUDIES["manifolds"]
    size = common.size_from(study, "tiny")
    variant = study.variants(size)[0]
    return lambda: common.run_folder(tmp_path, study.NAME, variant, size, 0, str(DATA), 1)


def test_runs_of_another_thread_count_are_never_mixed_in(tmp_path, monkeypatch):
    """A CPU reduction split over another number of threads rounds otherwise (a manifolds run
    at its full size: val loss 3.066593 on 1 thread, 3.066618 on 2, after 8 steps), so a rerun
    with another ``--threads`` trains its runs again: it had read back the records of the other
    thread count and put both in one table under one "processes × threads". Control: the same
    thread count reads every record back."""
    study = STUDIES["lipschitz"]
    size = common.size_from(study, "tiny")
    planned = [(study.variants(size)[0], 0)]

    # what the run saw, in place of training
    monkeypatch.setattr(common, "train_run", _fake_train_run(threads=torch.get_num_threads))

    def run(n):  # (conftest's _keep_torch_threads restores the thread count after the test)
        records, cached = common.run_jobs(study, planned, size, str(DATA), tmp_path, 1, n, False, say=print)
        return records[(planned[0][0].name, 0)]["threads"], cached

    assert run(1) == (1, 0)
    assert run(1) == (1, 1)  # control: read back
    assert run(2) == (2, 0)  # trained again, on 2 threads


class _OsReplacingAfter:
    """``os`` as ``common`` sees it, with ``os.replace`` calling ``before_replace()`` first."""

    def __init__(self, before_replace):
        self.before_replace = before_replace

    def replace(self, *args):
        self.before_replace()
        return os.replace(*args)

    def __getattr__(self, name):
        return getattr(os, name)


def test_two_writers_of_one_run_folder_never_race_on_a_temporary_file(tmp_path, monkeypatch):
    """Two runs of one study sharing a work directory may finish the same run at once. Both writers had
    written ``record.json.tmp``, then replaced: with both writes done before either replace
    (forced here by a barrier), the second ``os.replace`` found the file gone
    (``FileNotFoundError``). Each writer now has its own temporary file: both succeed, the record
    is one writer's whole, and no temporary file stays. A write that fails leaves none either,
    and a folder holding only a temporary file is an unfinished run: it trains again."""
    import threading

    study = STUDIES["lipschitz"]
    size = common.size_from(study, "tiny")
    variant = study.variants(size)[0]
    threads = torch.get_num_threads()
    folder = common.run_folder(tmp_path, study.NAME, variant, size, 0, str(DATA), threads)
    job = common.Job(study.NAME, variant, 0, size, str(DATA), str(folder), threads)
    writers = {}

    fake_run = _fake_train_run(writer=lambda: threading.current_thread().name)  # each thread's own record
    monkeypatch.setattr(common, "train_run", fake_run)
    both_written = threading.Barrier(2, timeout=60)
    monkeypatch.setattr(common, "os", _OsReplacingAfter(both_written.wait))

    def write(name):
        try:
            writers[name] = common._run_job(job)
        except Exception as err:  # reported by the assertion below
            writers[name] = err

    pair = [threading.Thread(target=write, args=(name,), name=name) for name in ("a", "b")]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join()
    assert not [err for err in writers.values() if isinstance(err, Exception)], writers
    assert json.loads((folder / common.RECORD).read_text()) in list(writers.values())
    assert sorted(p.name for p in folder.iterdir()) == [common.RECORD]

    def full_disk():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common, "os", _OsReplacingAfter(full_disk))
    (folder / common.RECORD).unlink()
    with pytest.raises(OSError, match="No space left"):
        common._run_job(job)
    assert list(folder.iterdir()) == []
    monkeypatch.undo()

    (folder / f"{common.RECORD}.0123.tmp").write_text("{")  # a writer killed before its replace
    monkeypatch.setattr(common, "train_run", fake_run)
    records, cached = common.run_jobs(study, [(variant, 0)], size, str(DATA), tmp_path, 1, threads, False,
                                      say=lambda text: None)
    assert cached == 0 and records[(variant.name, 0)]["writer"] == threading.current_thread().name


def test_a_run_made_by_other_code_is_never_reused(tmp_path, monkeypatch):
    """The run folder's key holds the training code's fingerprint: after the engine changes,
    a resumed study trains its runs again (in new folders) instead of reading back records
    the old code wrote. Control: the same code finds the same folder."""
    folder = _first_manifolds_run_folder(tmp_path)
    before = folder()
    assert folder() == before
    monkeypatch.setattr(common, "code_fingerprint", lambda: "0" * 16)
    assert folder() != before


def test_a_run_whose_definition_in_the_study_runner_changed_is_never_reused(tmp_path, monkeypatch):
    """What a study makes of a (variant, size, seed) is written in ``studies/common.py``
    (``train_config``, ``train_run``, ``VAL_SEED``), which the code fingerprint leaves out: the
    key had not changed when they did, so records scored on other validation windows, or
    trained with other options, were read back as this code's. Control: unchanged, the same
    folder."""
    folder = _first_manifolds_run_folder(tmp_path)
    before = folder()
    assert folder() == before
    with monkeypatch.context() as patched:
        patched.setattr(common, "VAL_SEED", common.VAL_SEED + 1)
        assert folder() != before
    assert folder() == before

    def train_config(size, variant, seed, data_path):  # another definition of a run
        return dataclasses.replace(original(size, variant, seed, data_path), log_every=1)

    original = common.train_config
    monkeypatch.setattr(common, "train_config", train_config)
    assert folder() != before


def test_the_code_fingerprint_sees_a_changed_source_file(tmp_path, monkeypatch):
    """:func:`code_fingerprint` hashes the source files themselves (uncommitted edits
    included), not a version string: a copy of a training module with one byte changed
    gives another fingerprint; pretrain/studies (page writing) does not count."""
    import importlib
    import shutil

    from geomuon.pretrain import provenance

    copies = {}
    for package in provenance._TRAINING_CODE:
        source = Path(importlib.import_module(f"geomuon.{package}").__file__).parent
        copies[package] = tmp_path / package
        shutil.copytree(source, copies[package], ignore=shutil.ignore_patterns("__pycache__"))
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: types.SimpleNamespace(
        __file__=str(copies[name.split(".")[1]] / "__init__.py")) if name.startswith("geomuon.") else real_import(name))

    def fingerprint():
        provenance.code_fingerprint.cache_clear()
        return provenance.code_fingerprint()

    first = fingerprint()
    assert fingerprint() == first
    (copies["pretrain"] / "studies" / "common.py").write_text("# a page-writing change\n")
    assert fingerprint() == first
    engine = copies["optimizers"] / "gram.py"
    engine.write_bytes(engine.read_bytes() + b" ")
    assert fingerprint() != first
    provenance.code_fingerprint.cache_clear()


def test_the_machine_counts_the_cpus_the_process_may_use(monkeypatch):
    """A run confined to 3 of a host's 64 CPUs (taskset, a batch scheduler) had been recorded
    as run on 64: ``machine()`` read ``os.cpu_count()``, the host's count. Both counts are
    faked here, so the test reads the same on any machine."""
    from geomuon.pretrain import provenance

    monkeypatch.setattr(provenance.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(provenance.os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    assert ", 3 CPU(s)" in provenance.machine()


@needs_data
def test_mapping_variants_register_nothing_and_keep_their_table(run_once):
    """Variants with a ``{role: Rule}`` strategy go to ``assign`` as mappings: the registry is
    left as it was, and the stored assignment table shows the variant's own rules."""
    study, tmp_path, code = run_once(symmetry_study)
    assert code == 0
    assert frozenset(STRATEGIES) == REGISTERED_STRATEGIES
    variants = common.read_results(tmp_path / "results" / study.NAME)["variants"]
    table = variants["router AdamW"]["assignment"]
    assert table.startswith("strategy: custom (") and "router" not in table.splitlines()[0]
    assert re.search(r"h\.0\.mlp\.router\.weight .* router +adamw$", table, re.MULTILINE)
    assert re.search(r"h\.0\.mlp\.router\.weight .* router +centered left_polar$",
                     variants["symmetry"]["assignment"], re.MULTILINE)


def test_variant_hooks_build_what_the_variant_says():
    """The ``build_assignment`` hook of a variant applies its hyperparameter overrides and its
    ``customize``; the run config scores the fixed validation windows, in memory."""
    tiny = lipschitz_study.SIZES["tiny"]
    capped = {v.name: v for v in lipschitz_study.variants(tiny)}["muon+softcap w_max=1"]
    model = GPT(get_config("cpu-lipschitz"))
    assignment = common.assignment_factory(capped)(model, Hyper(w_max=2.0))
    caps = {group["regulate"]["w_max"] for group in assignment.param_groups if group.get("regulate")}
    assert caps == {1.0}  # the variant's w_max, not the size's 2.0

    reference = {v.name: v for v in manifolds_study.variants(tiny)}["hetero_inv+reference"]
    built = common.assignment_factory(reference)(GPT(get_config("cpu-tiny")), Hyper())
    assert isinstance(built.optimizers["manifold_muon_reference"], manifolds_study.ReferenceManifoldMuon)
    plain = common.assignment_factory(dataclasses.replace(reference, customize=None))(GPT(get_config("cpu-tiny")),
                                                                                     Hyper())
    assert "manifold_muon_reference" not in plain.optimizers  # control: the customize made the difference

    cfg = common.train_config(tiny, capped, seed=3, data_path=str(DATA))
    assert (cfg.val_seed, cfg.seed, cfg.out_dir) == (common.VAL_SEED, 3, None)
    assert (cfg.eval_batches, cfg.final_eval_batches, cfg.eval_every) == (
        tiny.eval_batches, tiny.final_eval_batches, tiny.eval_every)


def test_bad_arguments_are_reported(tmp_path, capsys):
    assert _run(lipschitz_study, tmp_path, "--data", str(tmp_path / "missing.txt")) == 2
    assert "--data" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
    with pytest.raises(SystemExit):
        common.main(lipschitz_study, ["--size", "huge"])


def test_data_is_required_and_names_what_to_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert common.main(lipschitz_study, ["--size", "tiny"]) == 2
    assert "--data PATH is required" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before any work


def test_bad_seeds_are_refused_by_name(tmp_path, capsys, monkeypatch):
    # "--seeds a,b" had named no option; "--seeds 0,0" counted one run twice and compared it
    # with itself as a seed spread
    monkeypatch.chdir(tmp_path)
    # "--seeds ," had run the size's default seeds, "--seeds -1" was refused as "--seed" by the runner
    for seeds, message in (("a,b", "--seeds must be comma-separated integers"), ("0,1,0", "--seeds lists 0 more than once"),
                           (",", "--seeds must name at least one seed"), ("0,-1", "--seeds must be integers >= 0")):
        assert common.main(lipschitz_study, ["--size", "tiny", "--seeds", seeds]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_jobs_threads_and_seeds_are_each_refused_in_their_own_message(tmp_path, capsys, monkeypatch):
    # all three had printed one message naming all three options
    monkeypatch.chdir(tmp_path)
    for option, value, message, others in (
            ("--jobs", "0", "--jobs 0: it counts parallel runs and must be >= 1", ("--threads", "--seeds")),
            ("--threads", "0", "--threads 0: it counts torch threads per run and must be >= 1", ("--jobs", "--seeds")),
            ("--seeds", ",", "--seeds must name at least one seed, got ','", ("--jobs", "--threads"))):
        assert common.main(lipschitz_study, ["--size", "tiny", option, value]) == 2
        err = capsys.readouterr().err
        assert message in err and not any(other in err for other in others)
    assert not (tmp_path / "runs").exists()


@needs_data
def test_an_output_folder_that_cannot_be_created_is_refused_before_training(tmp_path, capsys, monkeypatch):
    # /proc refuses new folders: the page's mkdir had raised FileNotFoundError after every run trained
    monkeypatch.chdir(tmp_path)
    trained = []
    monkeypatch.setattr(common, "run_all", lambda *args: trained.append(args))
    argv = ["--size", "tiny", "--data", str(DATA), "--jobs", "1", "--seeds", "0"]
    for option in ("--out", "--work-dir"):
        assert common.main(lipschitz_study, [*argv, option, "/proc/geomuon_no_such_folder"]) == 2
        assert f"{option} '/proc/geomuon_no_such_folder' cannot be created or written" in capsys.readouterr().err
    # a refused --work-dir had left the page folder made just before it (runs/studies/lipschitz-<time>/, or --out's)
    assert common.main(lipschitz_study, [*argv, "--out", "new/page", "--work-dir", "/proc/geomuon_no_such_folder"]) == 2
    assert "--work-dir '/proc/geomuon_no_such_folder' cannot be created" in capsys.readouterr().err
    assert not trained and sorted(tmp_path.iterdir()) == []


@needs_data
def test_an_empty_folder_option_is_refused_by_name(tmp_path, capsys, monkeypatch):
    # Path("") is the current directory: "--out $UNSET" had written the page there, and an
    # empty --work-dir had silently meant the default
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "run_all", lambda *args: pytest.fail("trained with an empty folder option"))
    argv = ["--size", "tiny", "--data", str(DATA), "--jobs", "1", "--seeds", "0"]
    for option in ("--out", "--work-dir"):
        assert common.main(lipschitz_study, [*argv, option, ""]) == 2
        assert f"{option} is empty; give a folder, or leave {option} out" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == []


@needs_data
def test_an_unregistered_study_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """A user's own sweep, not listed in ``STUDIES``, had failed with a ``KeyError`` traceback (the
    run keys and the workers find a study by name). Control: registered, it reaches training."""
    from geomuon.pretrain import studies

    monkeypatch.chdir(tmp_path)
    mine = sweep.LearningRateSweep(manifolds_study, "my-sweep", "mine", comparisons=[("hetero", "unconstrained")])
    argv = ["--size", "tiny", "--data", str(DATA), "--jobs", "1"]
    assert common.main(mine, argv) == 2
    assert "study 'my-sweep' is not registered: add it to geomuon.pretrain.studies.STUDIES" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == []
    monkeypatch.setitem(studies.STUDIES, mine.NAME, mine)
    monkeypatch.setattr(common, "run_jobs", lambda *args, **kwargs: pytest.fail("reached training"))
    with pytest.raises(pytest.fail.Exception, match="reached training"):
        common.main(mine, argv)


@needs_data
def test_a_wrong_corpus_is_refused_before_any_folder_or_worker(tmp_path, capsys, monkeypatch):
    # had been refused by sha256 only inside the runs, after the cache folder and the pool existed
    monkeypatch.chdir(tmp_path)
    wrong = tmp_path / "notes.txt"
    wrong.write_text("not Shakespeare\n")
    monkeypatch.setattr(common, "run_all", lambda *args: pytest.fail("trained on the wrong corpus"))
    assert common.main(lipschitz_study, ["--size", "tiny", "--data", str(wrong), "--jobs", "2",
                                         "--work-dir", "wd"]) == 2
    err = capsys.readouterr().err
    assert f"--data {wrong}:" in err and "not the expected corpus" in err
    assert not (tmp_path / "wd").exists() and not (tmp_path / "runs").exists()


@needs_data
def test_a_data_path_with_a_colon_is_read(tmp_path):
    # "col:on/tiny.txt" had failed as data spec 'shakespeare:col:on/tiny.txt': unknown flag 'on/tiny.txt'
    folder = tmp_path / "col:on"
    folder.mkdir()
    (folder / "tiny.txt").write_bytes(DATA.read_bytes())
    path = str(folder / "tiny.txt")
    assert common.resolve_data(path) == path
    common.load_text.cache_clear()
    assert common.load_text(path).vocab_size == 65
    from geomuon.pretrain.data import load_data

    assert load_data(f"shakespeare:{path}").vocab_size == 65
    assert load_data(f"shakespeare:{path}:nocheck").vocab_size == 65


@needs_data
def test_a_data_path_that_is_no_readable_file_says_what_it_is(tmp_path, capsys, monkeypatch, unreadable_data_files):
    """``--data`` given a directory had been refused as "no such file", and so had a path through
    a file; an unreadable file had been a ``PermissionError`` traceback. Each is refused by what
    it is, before any folder exists. Control: a missing file is still "no such file"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared").mkdir()
    (tmp_path / "notes.txt").write_text("")
    argv = ["--size", "tiny", "--jobs", "1", "--seeds", "0", "--work-dir", "wd"]
    for path, message in ((tmp_path / "shared", f"--data {tmp_path / 'shared'}: is a directory; pass the file "
                                                f"itself (e.g. {tmp_path / 'shared' / 'tinyshakespeare.txt'})"),
                          (tmp_path / "notes.txt" / "input.txt", f"--data {tmp_path / 'notes.txt' / 'input.txt'}: "
                                                                 f"'{tmp_path / 'notes.txt'}' above it is a file"),
                          (f"{tmp_path / 'notes.txt'}/", f"--data {tmp_path / 'notes.txt'}/: "
                                                           f"'{tmp_path / 'notes.txt'}' above it is a file"),
                          (tmp_path / "missing.txt", f"--data {tmp_path / 'missing.txt'}: no such file")):
        assert common.main(lipschitz_study, [*argv, "--data", str(path)]) == 2
        assert message in capsys.readouterr().err
    unreadable_data_files()
    assert common.main(lipschitz_study, [*argv, "--data", str(DATA)]) == 2
    assert f"--data {DATA}: data file {str(DATA)!r} cannot be read (Permission denied); pass the path of a copy of" \
        in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "shared"]


def test_one_seed_prints_its_value_without_a_spread():
    # "4.136 ± 0.000" had read as a measured zero spread under "Mean ± sample standard deviation"
    assert common.fmt([4.1357]) == "4.136 (n = 1)"
    assert common.fmt([4.1357], 2, scientific=True) == "4.14e+00 (n = 1)"
    assert common.fmt([4.1357, float("nan")]) == "4.136 (1 of 2 finite)"
    assert math.isnan(common.mean_std([4.0])[1])
    assert common.fmt([1.0, 3.0]) == "2.000 ± 1.414"


@needs_data
def test_an_output_folder_that_is_a_file_is_refused_by_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    argv = ["--size", "tiny", "--data", str(DATA), "--jobs", "1", "--seeds", "0"]
    for option in ("--out", "--work-dir"):
        assert common.main(lipschitz_study, [*argv, option, "afile"]) == 2  # had been a FileExistsError traceback
        assert f"{option} 'afile' is a file, not a folder" in capsys.readouterr().err
        # under a file: had trained every run, then raised NotADirectoryError
        assert common.main(lipschitz_study, [*argv, option, "afile/sub"]) == 2
        assert f"{option} 'afile/sub': 'afile' above it is a file" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@needs_data
def test_results_never_overwrite_a_page(tmp_path, capsys, monkeypatch):
    """Without --out a study writes a new run folder under the current directory; --out
    refuses a directory that holds the study's page; --publish refuses a tiny run. All
    three are decided before training (nothing is written)."""
    monkeypatch.chdir(tmp_path)
    argv = ["--size", "tiny", "--data", str(DATA), "--jobs", "1", "--seeds", "0"]
    first, second = (common.output_dir(lipschitz_study, common_args(argv)) for _ in range(2))
    assert first.parent == Path("runs") / "studies" and first.name.startswith("lipschitz-")
    first.mkdir(parents=True)
    assert common.output_dir(lipschitz_study, common_args(argv)) != first  # taken: a fresh one

    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "lipschitz.md").write_text("# committed page\n")
    assert common.main(lipschitz_study, [*argv, "--out", str(tmp_path / "published")]) == 2
    assert "already holds lipschitz.md" in capsys.readouterr().err
    assert (tmp_path / "published" / "lipschitz.md").read_text() == "# committed page\n"

    assert common.main(lipschitz_study, [*argv, "--publish"]) == 2
    assert "only a --size full run may replace" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "studies" / "cache").exists()


def common_args(argv):
    parser = __import__("argparse").ArgumentParser()
    common.add_arguments(parser, lipschitz_study)
    return parser.parse_args(argv)


def test_claims_need_separated_bands():
    low, high = [1.0, 1.1, 0.9], [2.0, 2.1, 1.9]
    assert common.mean_std(low) == pytest.approx((1.0, 0.1, 3))
    assert common.separated(low, high) is True
    assert common.separated(low, [1.05, 1.3, 0.8]) is False
    assert common.separated(low, [2.0]) is None  # one seed: no claim either way
    assert "better by more than the seed spread" in common.compare_sentence("a", low, "b", high, "loss")
    assert "no difference resolved" in common.compare_sentence("a", low, "b", [1.05, 1.3, 0.8], "loss")
    assert common.fmt([1.0, float("nan"), 3.0]) == "2.000 ± 1.414 (2 of 3 finite)"


def test_sorted_sigma_map_is_not_a_retraction():
    """The seed code's DGram map moves a point whose column norms are unsorted (negative
    control), while the library's retraction fixes it; both land on DGram."""
    from geomuon.manifolds import DGram

    gen = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(12, 4, generator=gen, dtype=torch.float64))
    W = (Q * torch.tensor([1.0, 3.0, 2.0, 0.5], dtype=torch.float64)).float()  # unsorted column norms
    zero = torch.zeros_like(W)
    ours = DGram().retr(W, zero)
    reference = manifolds_study.SortedSigmaDGram().retr(W, zero)
    # fp32 retraction of an exact point: round-off of a few ulps times the norm ratio 6
    assert torch.allclose(ours, W, atol=1e-5)
    # bf16 polar factor: 3 significant digits, far below the column swap tested here
    assert (reference - W).norm() > 1.0
    assert DGram().check_point_on_manifold(reference, atol=2e-2)


def test_reference_optimizer_steps_on_dgram():
    from geomuon.manifolds import DGram

    gen = torch.Generator().manual_seed(1)
    W = torch.nn.Parameter(DGram().projx(torch.randn(24, 8, generator=gen)))
    before = W.detach().clone()
    opt = manifolds_study.ReferenceManifoldMuon([{"params": [W], "manifold": manifolds_study.SortedSigmaDGram()}],
                                                lr=0.05)
    W.grad = torch.randn(24, 8, generator=gen)
    opt.step()
    assert not torch.allclose(W.detach(), before)
    assert opt.param_groups[0]["retraction"] == "manifold"  # its step uses the sorted-σ map
    # bf16 polar factor in the map: cosines between columns at bf16 resolution
    assert DGram().check_point_on_manifold(W.detach(), atol=2e-2)


def test_reference_optimizer_takes_a_step_of_its_learning_rate():
    """On DGram's own retraction the seed solver moves the weights by about lr ||A||_F
    (||A||_F <= sqrt(n) for a direction of spectral norm 1, bf16 polar factor: x 1.01; the
    retraction's second-order term adds O(lr^2 n)), not to the direction itself (what
    writing the batch's direction as its new point did). Control: ten times the rate moves
    the weights further than that bound allows."""
    from geomuon.manifolds import DGram

    def moved(lr):
        gen = torch.Generator().manual_seed(1)
        W = torch.nn.Parameter(DGram().projx(torch.randn(24, 8, generator=gen)))
        before = W.detach().clone()
        opt = manifolds_study.ReferenceManifoldMuon([{"params": [W], "manifold": DGram()}], lr=lr, weight_decay=0.0)
        W.grad = torch.randn(24, 8, generator=gen)
        opt.step()
        return (W.detach() - before).norm().item()

    bound = 0.01 * 8 ** 0.5 * 1.01 + 8 * 0.01 ** 2
    assert 0 < moved(0.01) <= bound
    assert moved(0.1) > bound


def test_reference_optimizer_stops_its_dual_ascent_on_the_device(monkeypatch):
    """The seed solver stops at the first dual step whose constraint RMS is below 1e-6; that
    test was read on the host (``bool(...)``: a device synchronisation at every dual step of
    every optimizer step). Now a device flag freezes Λ and A instead. Checked twice, on the
    study's own pairing with the sorted-σ map: the step reads no tensor on the host (control:
    the guard catches ``bool`` of a tensor), and with
    convergence forced at the third dual step it leaves the weights the stopping loop does
    (written out below: the seed code's loop; same operations in the same order, so equal)."""
    from geomuon.manifolds import DGram
    from geomuon.manifolds.linalg import msign

    def problem(steps=20):
        gen = torch.Generator().manual_seed(1)
        W = torch.nn.Parameter(DGram().projx(torch.randn(24, 8, generator=gen)))
        W.grad = torch.randn(24, 8, generator=gen)
        return W, manifolds_study.ReferenceManifoldMuon([{"params": [W], "manifold": manifolds_study.SortedSigmaDGram()}],
                                                        lr=0.05, weight_decay=0.0, reference_steps=steps)

    W, optimizer = problem()
    with monkeypatch.context() as guarded:
        def host_read(self, *args):
            raise AssertionError("a tensor was read on the host")
        for method in ("__bool__", "item", "tolist", "__float__", "__int__"):
            guarded.setattr(torch.Tensor, method, host_read)
        with pytest.raises(AssertionError, match="read on the host"):
            bool(torch.ones(()))
        optimizer.step()

    calls, rms = [], manifolds_study._rms

    def rms_converging_at_third_step(H):  # the real RMS, scaled below 1e-6 from the third dual step on
        calls.append(None)
        return rms(H) * (1e-12 if len(calls) >= 3 else 1.0)

    monkeypatch.setattr(manifolds_study, "_rms", rms_converging_at_third_step)
    directions = []  # the momentum each _direction call receives (what the dual ascent is run on)
    direction = manifolds_study.ReferenceManifoldMuon._direction
    monkeypatch.setattr(manifolds_study.ReferenceManifoldMuon, "_direction",
                        lambda self, group, M, params, keep=None: (directions.append(M.clone()),
                                                                   direction(self, group, M, params, keep))[1])
    W, optimizer = problem()
    before = W.detach().clone()
    optimizer.step()
    (G,) = directions  # ManifoldMuon batches same-shape matrices: [1, 24, 8]
    before = before.unsqueeze(0)

    calls.clear()
    manifold, K = manifolds_study.SortedSigmaDGram(), 20
    lam = -0.25 * manifold.constraint(before, G)
    for k in range(K):
        A = msign(G + manifold.constraint_adjoint(before, lam), "polar_express", compute_dtype=torch.bfloat16)
        H = manifold.constraint(before, A)
        if bool((manifolds_study._rms(H) < 1e-6).all()):
            break
        lam = lam - 0.1 * (1 - k / K) * H
    assert k == 2  # the forced stop happened where intended
    assert torch.equal(W.detach(), manifold.retr(before, -0.05 * A)[0])
    with pytest.raises(ValueError, match="reference_steps must be an integer >= 1"):
        problem(steps=0)


# ----------------------------------------------------------------------------- learning-rate sweeps


def _fake_record(name: str, seed: int, loss: float, diverged: bool = False) -> dict:
    return {"variant": name, "seed": seed, "final_val_loss": loss, "diverged": diverged}


def _fake_train_run(loss=lambda variant: 1.0, **fields):
    """A stand-in for ``common.train_run``: the :func:`_fake_record` of ``loss(variant)``, taking
    no time, with each of ``fields`` the value its function returns as the run is made."""
    def run(study, variant, size, seed, data_path):
        return {**_fake_record(variant.name, seed, loss(variant)), "wall_time": 0.0,
                **{name: value() for name, value in fields.items()}}
    return run


def _landscape(best_rate: float, diverge_above: float = math.inf):
    """A fake ``run`` for :meth:`LearningRateSweep.search`: the loss of a rate is its squared
    log-distance to ``best_rate`` (plus a seed offset); rates above ``diverge_above`` diverge.
    It records every (name, seed) asked for, and refuses one asked twice."""
    asked = []

    def run(planned):
        out = {}
        for variant, seed in planned:
            assert (variant.name, seed) not in asked, f"{variant.name} seed {seed} trained twice"
            asked.append((variant.name, seed))
            rate = next(iter(variant.hyper.values()))
            out[(variant.name, seed)] = _fake_record(variant.name, seed, math.log2(rate / best_rate) ** 2 + 0.01 * seed,
                                                     diverged=rate > diverge_above)
        return out

    return run, asked


def _one_arm_sweep(grid):
    base = types.SimpleNamespace(NAME="fake", SIZES={"full": manifolds_study.SIZES["tiny"]},
                                 variants=lambda size: [common.Variant("muon", "Muon", "unconstrained")])
    return sweep.LearningRateSweep(base, "fake-sweep", "fake", comparisons=[], grids={"full": grid})


def test_sweep_extends_a_grid_whose_best_is_on_the_edge():
    """Default 0.02, grid 0.005–0.08: a landscape whose minimum is at 0.32 puts the best on the
    upper edge, so the grid grows by one point at a time until the best is inside (0.32 after
    two extensions, 0.64 tried); then only the best point gets its third seed."""
    grid = sweep.Grid(max_extensions=3)
    study = _one_arm_sweep(grid)
    run, asked = _landscape(best_rate=0.32)
    (found,) = study.search(study.SIZES["full"], run)
    assert [round(found.rate(k), 6) for k in sorted(found.points)] == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64]
    assert round(found.rate(found.best), 6) == 0.32 and not found.on_edge
    assert [s for name, s in asked if name == found.points[found.best].name] == [0, 1, 2]
    assert {s for name, s in asked if name != found.points[found.best].name} == {0, 1}
    assert len(asked) == 8 * 2 + 1


def test_sweep_stops_extending_after_its_budget_and_says_so():
    """Minimum far beyond the grid: the grid grows by ``max_extensions`` points only and the best
    is reported on the edge. Control: a landscape with its minimum inside never extends."""
    run, asked = _landscape(best_rate=100.0)
    (found,) = _one_arm_sweep(sweep.Grid(max_extensions=2)).search(manifolds_study.SIZES["tiny"], run)
    assert len(found.points) == 7 and found.best == max(found.points) and found.on_edge
    run, asked = _landscape(best_rate=0.02)
    (inside,) = _one_arm_sweep(sweep.Grid(max_extensions=2)).search(manifolds_study.SIZES["tiny"], run)
    assert len(inside.points) == 5 and round(inside.rate(inside.best), 6) == 0.02


def test_a_diverged_point_ranks_last():
    """Rates above 0.05 diverge although their loss would be lowest: the best is 0.04, inside."""
    run, _ = _landscape(best_rate=0.32, diverge_above=0.05)
    (found,) = _one_arm_sweep(sweep.Grid()).search(manifolds_study.SIZES["tiny"], run)
    assert round(found.rate(found.best), 6) == 0.04 and not found.on_edge


def test_each_arm_sweeps_its_own_rate():
    """An arm that is AdamW everywhere sweeps the AdamW rate; every other arm the matrix rate,
    around its own default (a variant's override wins over the size's)."""
    size = symmetry_study.SIZES["full"]
    arms = {v.name: v for v in symmetry_study.variants(size)}
    assert sweep.swept_parameter(arms["all AdamW"]) == "adamw_lr"
    assert sweep.default_rate(arms["all AdamW"], size) == size.adamw_lr
    assert {sweep.swept_parameter(v) for n, v in arms.items() if n != "all AdamW"} == {"lr"}
    assert sweep.default_rate(arms["symmetry"], size) == size.lr
    override = dataclasses.replace(arms["symmetry"], hyper={"lr": 0.3})
    assert sweep.point(override, size, sweep.Grid(), -1).hyper == {"lr": 0.15}
    with pytest.raises(ValueError, match="odd number"):
        sweep.Grid(points=4)


SWEEP_ARMS = [common.Variant("muon", "Muon", "unconstrained"), common.Variant("adamw", "AdamW", "adamw")]


@pytest.fixture
def tiny_sweep(monkeypatch):
    """A two-arm sweep at the manifolds study's tiny size, registered for the duration of the test."""
    from geomuon.pretrain import studies

    base = types.SimpleNamespace(NAME="manifolds", SIZES=manifolds_study.SIZES, variants=lambda size: SWEEP_ARMS)
    study = sweep.LearningRateSweep(base, "tiny-sweep", "A two-arm sweep", comparisons=[("muon", "adamw")])
    monkeypatch.setitem(studies.STUDIES, study.NAME, study)
    return study


def _tables(page: str) -> list[str]:
    """The page's table rows, without the provenance rows (times and dates vary)."""
    return [line for line in page.splitlines() if line.startswith("|") and not re.match(
        r"\| (command|commit|date|wall time|summed run time|machine|processes) ", line)]


@needs_data
def test_an_interrupted_sweep_resumes_where_it_stopped(tiny_sweep, tmp_path, monkeypatch, capsys):
    """SIGINT (a real one) after the 5th run stops the sweep; the rerun reads the 5 complete
    runs back, trains only the others, and writes the same tables as an uninterrupted fresh
    sweep in another work directory."""
    import signal

    real, trained = common.train_run, []

    def counting(study, variant, size, seed, data_path):
        record = real(study, variant, size, seed, data_path)
        trained.append((variant.name, seed))
        if len(trained) == 5 and interrupting:
            signal.raise_signal(signal.SIGINT)
        return record

    monkeypatch.setattr(common, "train_run", counting)
    interrupting = True
    argv = ["--size", "tiny", "--jobs", "1", "--data", str(DATA), "--work-dir", str(tmp_path / "work")]
    # Python's own SIGINT handler for the interrupted call: a suite started in the background
    # by a non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert common.main(tiny_sweep, [*argv, "--out", str(tmp_path / "first")]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    hint = capsys.readouterr().err
    assert "interrupted" in hint and f"Continue with: geomuon study tiny-sweep {' '.join(argv)}" in hint
    assert len(trained) == 5 and len(list((tmp_path / "work").glob(f"*/{common.RECORD}"))) == 4
    # the 5th run was interrupted as its record was about to be written: its folder holds none
    interrupting, first_five = False, list(trained)
    trained.clear()
    assert common.main(tiny_sweep, [*argv, "--out", str(tmp_path / "resumed")]) == 0
    assert "4 complete" in capsys.readouterr().out
    assert not set(first_five[:4]) & set(trained) and first_five[4] in trained
    total = len(trained) + 4

    trained.clear()
    fresh = [*argv[:-1], str(tmp_path / "other"), "--out", str(tmp_path / "fresh")]
    assert common.main(tiny_sweep, fresh) == 0 and len(trained) == total
    resumed = (tmp_path / "resumed" / "tiny-sweep.md").read_text()
    assert _tables(resumed) == _tables((tmp_path / "fresh" / "tiny-sweep.md").read_text())
    assert "### `muon`" in resumed and "| `adamw` | adamw_lr |" in resumed
    figures = sorted(p.name for p in (tmp_path / "fresh" / "tiny-sweep").glob("lr_*.png"))
    assert figures == ["lr_adamw.png", "lr_all_arms.png", "lr_muon.png"]  # one per arm, and every arm together
    for name in figures:
        assert f"(tiny-sweep/{name})" in resumed


def _configuration(page: str) -> tuple[str, dict]:
    """The sentence and the settings of a page's Configuration block."""
    sentence, block = re.search(r"## Configuration\n\n(.*?):\n\n```json\n(.*?)\n```", page, re.DOTALL).groups()
    return sentence, json.loads(block)


@needs_data
def test_a_sweeps_configuration_says_what_it_sweeps(tiny_sweep, run_once, tmp_path, monkeypatch):
    """A sweep's page had listed the size's lr, adamw_lr and seeds under "Every variant uses these
    settings", while its runs trained at other rates and seeds. Its block now describes those
    per-run settings in their place, with the grid, and keeps the others; the runs are faked (the
    page, not the training, is tested). Control: a study that sweeps nothing keeps its sentence and
    the size's values."""
    study, folder, code = run_once(lipschitz_study)  # (trained before train_run is faked: the run is shared)
    assert code == 0
    sentence, config = _configuration((folder / "results" / f"{study.NAME}.md").read_text())
    assert sentence == ("Every variant uses these settings (the variants' own changes are listed above and in "
                        f"`{common.RESULTS}`)")
    assert config == {"size": "tiny", **dataclasses.asdict(dataclasses.replace(study.SIZES["tiny"], seeds=list(SEEDS)))}

    fake_run = _fake_train_run(lambda variant: math.log(next(iter(variant.hyper.values()))) ** 2,  # the swept rate's
                               assignment=lambda: "")
    monkeypatch.setattr(common, "train_run", fake_run)
    argv = ["--size", "tiny", "--jobs", "1", "--data", str(DATA), "--work-dir", str(tmp_path / "work")]
    assert common.main(tiny_sweep, [*argv, "--out", str(tmp_path / "out")]) == 0
    sentence, config = _configuration((tmp_path / "out" / "tiny-sweep.md").read_text())
    size = tiny_sweep.SIZES["tiny"]
    # one text of the grid's seeds: the block's, the --seeds help's and the refusal of other seeds' (the
    # three had each been written out, in three wordings)
    seeds = "0,1 per point, 0,1,2 at each arm's best point"
    assert f"tiny: {seeds} (leave --seeds out)" in tiny_sweep.SEEDS_HELP
    with pytest.raises(ValueError, match=re.escape(f"--seeds: a sweep's seeds are its grid's ({seeds}); drop")):
        tiny_sweep.run(tiny_sweep, dataclasses.replace(size, seeds=(5,)), str(DATA), tmp_path / "refused", 1, 1, False)
    assert sentence.startswith("Every run uses these settings except those the sweep sets per run (seeds, lr, "
                               "adamw_lr: described in place of a value")
    assert config == {"size": "tiny", **dataclasses.asdict(size), **{
        "seeds": f"the grid's: {seeds}",
        "lr": "swept for muon: 3 rates spaced ×2 around 0.02, at most 1 more beyond an edge; 0.02 for the other arms",
        "adamw_lr": "swept for adamw: 3 rates spaced ×2 around 0.003, at most 1 more beyond an edge; 0.003 for the "
                    "other arms"}}


def _fresh_tables(tmp_path: Path, name: str, *options: str) -> list[str]:
    argv = ["--size", "tiny", "--data", str(DATA), "--work-dir", str(tmp_path / "work"), "--fresh"]
    assert common.main(long_study, [*argv, *options, "--out", str(tmp_path / name)]) == 0
    return _tables((tmp_path / name / f"{long_study.NAME}.md").read_text())


@needs_data
def test_fresh_runs_reproduce_every_number(tmp_path):
    """Two ``--fresh`` runs of a study into the same work directory (every run trained again)
    write identical tables, digit for digit. Control: other seeds change them, so the
    comparison can fail."""
    first = _fresh_tables(tmp_path, "a", "--jobs", "1")
    assert _fresh_tables(tmp_path, "b", "--jobs", "1") == first and len(first) >= 5
    assert _fresh_tables(tmp_path, "c", "--jobs", "1", "--seeds", "3,4,5") != first


@pytest.mark.slow  # two spawned workers import torch: a minute on 2 busy cores
@needs_data
def test_worker_processes_reproduce_the_in_process_numbers(tmp_path):
    """A published run trains in ``--jobs 2`` worker processes; a check may run in one: both
    write the same tables, digit for digit."""
    assert _fresh_tables(tmp_path, "one", "--jobs", "1") == _fresh_tables(tmp_path, "two", "--jobs", "2")


@needs_data
@pytest.mark.parametrize("name", [n for n, s in STUDIES.items() if isinstance(s, sweep.LearningRateSweep)])
def test_a_sweeps_help_offers_no_seeds_it_refuses(name, tmp_path, capsys):
    # the help of every study had offered "--seeds (default: the size's, 3 seeds)", and a sweep
    # refuses every --seeds but its grid's
    with pytest.raises(SystemExit):
        common.main(STUDIES[name], ["--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    grid_seeds = ",".join(map(str, STUDIES[name].grids["full"].seeds))
    assert f"--seeds SEEDS not for a sweep, which trains its grid's seeds: full: {grid_seeds} per point" in help_text
    assert common.main(STUDIES[name], ["--size", "tiny", "--data", str(DATA), "--seeds", "0,1",
                                       "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]) == 2
    assert "--seeds: a sweep's seeds are its grid's" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any run or folder


@needs_data
@pytest.mark.parametrize("name", [n for n, s in STUDIES.items() if isinstance(s, sweep.LearningRateSweep)])
def test_a_sweep_refuses_seeds_equal_to_a_sizes_default(name, tmp_path, capsys, monkeypatch):
    """A sweep trains its grid's seeds whatever ``--seeds`` says; its check compared the size's
    seeds with its sizes' defaults, so ``--seeds 0,1,2`` (every size's default) passed it and was
    ignored, the page's command still listing it. Control: without --seeds the sweep goes on to
    train (stopped here at its first batch of runs)."""
    default = ",".join(map(str, STUDIES[name].SIZES["tiny"].seeds))

    def no_training(*args, **kwargs):
        raise RuntimeError("the sweep started training")

    monkeypatch.setattr(common, "run_jobs", no_training)
    argv = ["--size", "tiny", "--data", str(DATA), "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
    assert common.main(STUDIES[name], [*argv, "--seeds", default]) == 2
    assert f"--seeds: a sweep's seeds are its grid's, whatever --seeds says (got '{default}')" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any run or folder
    with pytest.raises(RuntimeError, match="started training"):
        common.main(STUDIES[name], argv)


@pytest.mark.parametrize("name", [n for n, s in STUDIES.items() if isinstance(s, sweep.LearningRateSweep)])
def test_every_registered_sweep_compares_arms_it_has(name):
    """At every size, the pairs a sweep's page compares are arms it trains (a typo would only
    surface as a KeyError after an hour of training); control: a pair naming no arm is caught."""
    study = STUDIES[name]
    for size in study.SIZES.values():
        arms = {v.name for v in study.variants(size)}
        assert study.comparisons and all({a, b} <= arms for a, b in study.comparisons), (name, arms)
    assert not {"hetero", "no such arm"} <= {v.name for v in manifolds_study.variants(manifolds_study.SIZES["full"])}


@needs_data
def test_a_sweep_that_cannot_come_out_right_is_refused_before_any_run(tiny_sweep, tmp_path, capsys, monkeypatch):
    """Before any run: a comparison naming no arm (had been a ``KeyError`` after every run), an
    arm whose default rate is 0 (its points had all been named ``@ lr=0``: one record for all)
    or negative, a grid too fine for the points' names. Control: the sweep as it is reaches
    training (stopped there)."""
    monkeypatch.setattr(common, "run_jobs", lambda *args, **kwargs: pytest.fail("reached training"))
    argv = ["--size", "tiny", "--data", str(DATA), "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]

    def arms_at(rate):
        return types.SimpleNamespace(NAME="manifolds", SIZES=manifolds_study.SIZES, variants=lambda size: [
            dataclasses.replace(SWEEP_ARMS[0], hyper={"lr": rate}), SWEEP_ARMS[1]])

    for attribute, value, message in [
            ("comparisons", [("muon", "adamww")], "its comparisons name ['adamww'], which are not among its arms"),
            ("base", arms_at(0.0), "arm 'muon' has default lr 0.0; a log grid needs a finite rate > 0"),
            ("base", arms_at(-0.02), "arm 'muon' has default lr -0.02; a log grid needs a finite rate > 0"),
            ("grids", {"tiny": sweep.Grid(points=3, factor=1.0001)}, "Grid(factor=1.0001) is too fine: arm 'muon'")]:
        with monkeypatch.context() as patched:
            patched.setattr(tiny_sweep, attribute, value)
            assert common.main(tiny_sweep, argv) == 2
        assert message in capsys.readouterr().err
        assert not list(tmp_path.iterdir())
    with pytest.raises(pytest.fail.Exception, match="reached training"):
        common.main(tiny_sweep, argv)


@pytest.mark.parametrize("grid, message", [
    (dict(seeds=(), best_seeds=(0,)), "Grid(seeds=()): use at least one seed"),
    (dict(seeds=(0, 0)), "Grid(seeds=(0, 0)): use at least one seed, each an integer >= 0, once"),
    (dict(best_seeds=(0, 1, -2)), "Grid(best_seeds=(0, 1, -2))"),
    (dict(max_extensions=-1), "Grid(max_extensions=-1): use an integer >= 0"),
    (dict(factor=math.inf), "Grid(factor=inf): the spacing of a log grid must be finite and exceed 1"),
])
def test_a_grid_without_seeds_or_with_a_bad_spacing_is_refused(grid, message):
    # no seeds had divided by zero in a point's score; an infinite factor had made every other rate inf or 0
    with pytest.raises(ValueError, match=re.escape(message)):
        sweep.Grid(**grid)
    sweep.Grid(seeds=(0,), best_seeds=(0,), max_extensions=0, factor=1e6)  # control: the edges of what is valid


def test_the_long_arms_run_at_the_rates_their_published_sweep_found():
    """``manifolds-long-arms`` trains each arm at :data:`TUNED_LR`, copied by hand from the
    400-step sweep's page: it must be that sweep's best rate (inside its grid) for every arm, so a
    re-published sweep whose best moved cannot leave the longer study at a stale rate."""
    published = common.read_results(ROOT / "docs" / "results" / manifolds_study.SWEEP.NAME)
    size = common.size_from(manifolds_study.SWEEP, published["size"])
    found = {a.arm.name: a for a in manifolds_study.SWEEP.arm_sweeps(published["runs"], size)}
    best = {name: found[name].rate(found[name].best) for name in long_arms_study.TUNED_LR}
    assert published["size"] == "full" and not any(found[name].on_edge for name in best)
    # a grid rate is 0.02·2^k: a power-of-two multiple of the double 0.02, the same double as the literal 0.04
    assert best == long_arms_study.TUNED_LR
    assert {v.name: v.hyper["lr"] for v in long_arms_study.variants(size)} == best


def test_the_view_of_a_sweep_without_runs_of_an_arm_names_the_arm():
    """:meth:`LearningRateSweep.arm_sweeps` of results holding no run of an arm on its grid names
    the arm (it had failed with min()'s "arg is an empty sequence", which ``--rates-from`` had
    guarded against by building every grid point a second time). Control: the published results
    give every arm its view."""
    published = common.read_results(ROOT / "docs" / "results" / manifolds_study.SWEEP.NAME)
    size = common.size_from(manifolds_study.SWEEP, published["size"])
    runs = {name: records for name, records in published["runs"].items() if not name.startswith("hetero @ ")}
    with pytest.raises(ValueError, match=re.escape("the results hold no runs of arm 'hetero' on the manifolds-sweep "
                                                   "grid")):
        manifolds_study.SWEEP.arm_sweeps(runs, size)
    assert [a.arm.name for a in manifolds_study.SWEEP.arm_sweeps(runs, size, ["unconstrained"])] == ["unconstrained"]
    assert len(manifolds_study.SWEEP.arm_sweeps(published["runs"], size)) == len(manifolds_study.SWEEP.variants(size))


def _sweep_results(tmp_path: Path, name: str, edit) -> str:
    """The published manifolds-sweep results, changed by ``edit(payload)``, written as ``name``."""
    from geomuon.pretrain.train import spell_nonfinite

    payload = common.read_results(ROOT / "docs" / "results" / manifolds_study.SWEEP.NAME)
    edit(payload)
    path = tmp_path / name
    path.write_bytes(gzip.compress(json.dumps(spell_nonfinite(payload), default=str).encode()))
    return str(path)


@needs_data
def test_the_long_arms_take_their_rates_from_a_rerun_sweep(tmp_path, capsys, monkeypatch):
    """``--rates-from PATH`` trains each arm at the best rate of the sweep in PATH: the published
    sweep gives :data:`TUNED_LR`; a sweep whose hetero runs are best at 0.02 trains hetero at 0.02
    (another lr, so another run key), and the page's rows say where the rate came from. A file that
    cannot be read, of another study, or without an arm is refused by name before any folder."""
    trained = {}

    def capture(study, size, data_path, work_dir, jobs, threads, fresh):  # what would train, in place of it
        trained.update({v.name: v for v in study.variants(size)})
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "run_all", capture)
    argv = ["--size", "tiny", "--data", str(DATA), "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]

    def rates(*extra):
        trained.clear()
        assert common.main(long_arms_study, [*argv, *extra]) == 130
        return {name: v.hyper["lr"] for name, v in trained.items()}

    published = str(ROOT / "docs" / "results" / manifolds_study.SWEEP.NAME / common.RESULTS)
    assert rates() == rates("--rates-from", published) == long_arms_study.TUNED_LR
    default = dict(trained)

    def hetero_best_at_002(payload):
        for run in payload["runs"]["hetero @ lr=0.02"]:
            run["final_val_loss"] = 0.0

    moved = _sweep_results(tmp_path, "moved.json.gz", hetero_best_at_002)
    assert rates("--rates-from", moved) == {**long_arms_study.TUNED_LR, "hetero": 0.02}
    assert trained["hetero"].label.endswith(f"(lr 0.02, best of the 400-step sweep in {moved})")
    size = long_arms_study.SIZES["tiny"]
    assert common.run_folder(tmp_path, long_arms_study.NAME, trained["hetero"], size, 0, str(DATA), 1) != \
        common.run_folder(tmp_path, long_arms_study.NAME, default["hetero"], size, 0, str(DATA), 1)
    assert common.run_folder(tmp_path, long_arms_study.NAME, trained["unconstrained"], size, 0, str(DATA), 1) == \
        common.run_folder(tmp_path, long_arms_study.NAME, default["unconstrained"], size, 0, str(DATA), 1)
    capsys.readouterr()

    (tmp_path / "notes.txt").write_text("not gzip\n")
    no_hetero = _sweep_results(tmp_path, "no-hetero.json.gz", lambda payload: [
        payload["runs"].pop(name) for name in list(payload["runs"]) if name.startswith("hetero @ ")])
    off_grid = _sweep_results(tmp_path, "off-grid.json.gz", lambda payload: [
        payload["runs"].__setitem__(name.replace("=", "=9"), payload["runs"].pop(name))
        for name in list(payload["runs"]) if name.startswith("hetero @ ")])
    listed_size = _sweep_results(tmp_path, "listed-size.json.gz", lambda payload: payload.update(size=[payload["size"]]))
    other = str(ROOT / "docs" / "results" / long_arms_study.NAME / common.RESULTS)
    for path, message in ((tmp_path / "notes.txt", "cannot be read as a study's results (Not a gzipped file"),
                          (tmp_path / "missing.json.gz", "cannot be read as a study's results ([Errno 2]"),
                          (other, "the results of study 'manifolds-long-arms', not of manifolds-sweep"),
                          (no_hetero, "the results hold no runs of arm 'hetero' on the manifolds-sweep grid at size"),
                          # (had been "min() arg is an empty sequence")
                          (off_grid, "the results hold no runs of arm 'hetero' on the manifolds-sweep grid at size"),
                          (listed_size, "a sweep at size [")):  # (had been a TypeError: unhashable type)
        assert common.main(long_arms_study, [*argv, "--rates-from", str(path)]) == 2
        assert f"--rates-from {path}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    # an arm this study does not train may be missing (it had been required)
    unused = next(v.name for v in manifolds_study.SWEEP.variants(size) if v.name not in long_arms_study.TUNED_LR)
    no_unused = _sweep_results(tmp_path, "no-unused.json.gz", lambda payload: [
        payload["runs"].pop(name) for name in list(payload["runs"]) if name.startswith(f"{unused} @ ")])
    assert long_arms_study.rates_from(no_unused) == (long_arms_study.TUNED_LR, manifolds_study.SWEEP.SIZES["full"].steps)
    # the page's note says where the rates came from (it had still said they were tuned at 400 steps)
    monkeypatch.setattr(common, "loss_figures", lambda *args: [])
    monkeypatch.setattr(common, "plot_panels", lambda *args, **kwargs: None)
    monkeypatch.setattr(long_study, "page", lambda study, results, size, figure_dir, comparisons, note, figures: note)
    note = long_arms_study.configured(types.SimpleNamespace(rates_from=moved)).report({}, size, {}, tmp_path)
    assert f"The rates are the best points of the 400-step sweep in `{moved}`;" in note and "400 steps (" not in note
    assert "The rates were tuned at 400 steps;" in long_arms_study.report({}, size, {}, tmp_path)  # control


def test_the_width_sweep_doubles_the_width_and_nothing_else():
    size = manifolds_study.SIZES["full"]
    wide = {v.name: v for v in manifolds_study.wide_variants(size)}
    arms = {v.name: v for v in manifolds_study.variants(size)}
    assert sorted(wide) == ["hetero wide", "unconstrained wide"]
    for name, arm in wide.items():
        base = arms[name.removesuffix(" wide")]
        assert arm.model == {"n_embd": 2 * size.model_overrides["n_embd"]} == {"n_embd": 256}
        assert (arm.strategy, arm.hyper, arm.customize) == (base.strategy, base.hyper, base.customize)
        config = common.train_config(size, arm, seed=0, data_path=str(DATA))
        assert {**config.model_overrides} == {**size.model_overrides, "n_embd": 256}


@needs_data
def test_the_peer_rows_train_torchs_muon_and_adamw(run_once):
    """The long configuration's rows are what their names say, read from the assignment tables
    the runs stored: torch's Muon on the hidden matrices, the library's Muon there, AdamW everywhere."""
    study, tmp_path, code = run_once(long_study)
    assert code == 0
    tables = {name: v["assignment"] for name, v in
              common.read_results(tmp_path / "results" / study.NAME)["variants"].items()}
    assert re.search(r"^h\.0\.attn\.c_attn\.weight .* attn_qkv +torch_muon$", tables["torch_muon"], re.MULTILINE)
    assert re.search(r"^h\.0\.attn\.c_attn\.weight .* attn_qkv +muon$", tables["unconstrained"], re.MULTILINE)
    assert re.search(r"^wte\.weight .* embedding +adamw$", tables["torch_muon"], re.MULTILINE)
    assert not re.search(r" (torch_muon|muon)$", tables["adamw"], re.MULTILINE)


def test_the_manifolds_page_describes_the_solver_the_optimizer_defaults_to(monkeypatch):
    """The page's sentence on Manifold Muon's solver is read off the optimizer's defaults: a
    form declaring other defaults changes it (a page once described one Jacobi step while the
    engine took two Newton steps and two polish rounds)."""
    from geomuon.manifolds.capabilities import OrthonormalGram

    before = manifolds_study.engine_defaults()
    monkeypatch.setattr(OrthonormalGram, "dual_steps", 3)
    monkeypatch.setattr(OrthonormalGram, "polish_rounds", 1)
    after = manifolds_study.engine_defaults()
    assert after.startswith("Stiefel 3 warm-started newton dual steps and 1 polish round; DGram ")
    assert after != before and after.split("; ")[1:] == before.split("; ")[1:]  # DGram's part unchanged
