"""The benchmark scripts of ``bench/``: each runs at its ``--quick`` size as a user runs it
(a subprocess, one thread), prints a table whose numbers make sense, and writes that table
with its provenance header through ``--markdown``.

The polar-kernel table is checked against what its numbers must be: the singular values of
an iterative ``msign`` are the scalar polynomial of its schedule applied to the normalized
input spectrum, which the test computes independently in float64; the SVD's error is at
fp32 round-off; a Polar Express output in bf16 has its singular values at 1 up to bf16
round-off.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import polar_kernels  # noqa: E402
from geomuon.manifolds.linalg import KELLER_QUINTIC, POLAR_EXPRESS, POLAR_EXPRESS_5  # noqa: E402

SCHEDULES = {s.name: s for s in (KELLER_QUINTIC, POLAR_EXPRESS_5, POLAR_EXPRESS)}
EPS32 = torch.finfo(torch.float32).eps
U_BF16 = torch.finfo(torch.bfloat16).eps / 2  # unit round-off 2^-8
SIGMA_RESOLUTION = 0.5e-5  # singular values are printed with 5 decimals


def run_script(name: str, markdown: Path, *options: str) -> str:
    """stdout of ``python bench/<name>.py --quick --threads 1 --markdown PATH [options]``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, f"bench/{name}.py", "--quick", "--threads", "1", "--markdown", str(markdown), *options],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the last Markdown table in ``text`` (the script's; a ``--markdown`` file
    has the provenance table above it), keyed by the header cells."""
    blocks = re.findall(r"(?:^\|.*\|$\n?)+", text, re.MULTILINE)
    assert blocks, text
    header, separator, *rows = [[cell.strip() for cell in line[1:-1].split("|")] for line in blocks[-1].splitlines()]
    assert set("".join(separator)) == {"-"} and rows and all(len(row) == len(header) for row in rows), text
    return [dict(zip(header, row)) for row in rows]


def sigma_range(cell: str) -> tuple[float, float]:
    low, high = re.fullmatch(r"\[(\S+), (\S+)\]", cell).groups()
    return float(low), float(high)


def printed_resolution(cell: str) -> float:
    """Half a unit of the last printed digit of ``cell`` (``7.57e-01`` -> 5e-3)."""
    mantissa, _, exponent = cell.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def check_provenance(markdown: Path, name: str, stdout: str) -> None:
    text = markdown.read_text()
    assert text.startswith('!!! warning "Quick run: not a result"'), text[:200]
    command = re.search(r"^\| command \| `(.*)` \|$", text, re.MULTILINE).group(1)
    assert command.startswith(f"python bench/{name}.py --quick") and str(markdown) in command
    assert re.search(r"^\| commit \| `([0-9a-f]{4,}(-dirty)?|unknown \(.*\))` \|$", text, re.MULTILINE), text
    # a timed run names its clock; one that times nothing names none
    assert re.search(rf"^\| torch \| {re.escape(torch.__version__)}, 1 thread\(s\)(, (wall|process) clock)? \|$", text,
                     re.MULTILINE), text
    assert re.search(r"^\| load average \(1, 5, 15 min\) \| [\d.]+, [\d.]+, [\d.]+ at the start, "
                     r"[\d.]+, [\d.]+, [\d.]+ at the end \|$", text, re.MULTILINE)
    # The thread settings the script ran under (run_script sets OMP_NUM_THREADS=1; the
    # wait policy is whatever conftest or the caller set) are recorded.
    environment = re.search(r"^\| environment \| (.*) \|$", text, re.MULTILINE).group(1)
    assert "OMP_NUM_THREADS=1" in environment
    assert f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" in environment
    # The file holds the very table the script printed.
    assert parse_table(text) == parse_table(stdout)


def predicted_sigmas(method: str, k: int) -> torch.Tensor:
    """Singular values of ``msign(X, method)`` in exact arithmetic for the bench's
    ``κ=1e3`` input with ``k`` singular values: the schedule's odd polynomial applied to
    the spectrum divided by ``input_scale * ||X||_F`` (float64)."""
    schedule = SCHEDULES[method]
    spectrum = polar_kernels.log_spectrum(k)
    x = spectrum / (spectrum.norm() * schedule.input_scale)
    for a, b, c in schedule.step_coefficients(schedule.default_steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.fixture(scope="module")
def polar_run(tmp_path_factory):
    markdown = tmp_path_factory.mktemp("bench") / "polar_kernels.md"
    # Process clock: with one thread it counts this process only, not the other tests.
    stdout = run_script("polar_kernels", markdown, "--clock", "process")
    return stdout, markdown


def test_polar_kernels_table_has_every_kernel_and_consistent_ratios(polar_run):
    stdout, markdown = polar_run
    rows = parse_table(stdout)
    shapes = [polar_kernels.shape_label(s) for s in polar_kernels.SHAPES["quick"]]
    assert [(r["shape"], r["kernel"], r["dtype"]) for r in rows] == [
        (shape, method, dtype) for shape in shapes for method, dtype in polar_kernels.KERNELS
    ]
    for shape in shapes:
        group = {(r["kernel"], r["dtype"]): r for r in rows if r["shape"] == shape}
        base = float(group[polar_kernels.BASELINE]["time (ms)"])
        assert group[polar_kernels.BASELINE]["ratio"] == "1.00"
        for row in group.values():
            seconds, ratio = float(row["time (ms)"]), float(row["ratio"])
            # times are printed to 3 significant digits (0.5% each), ratios to 2 decimals
            assert seconds > 0 and abs(ratio - seconds / base) <= 0.01 * ratio + 0.005, row
    # Which iteration counts were timed is stated, not inferred from the times (a timing
    # comparison in a test would flake on a shared machine; benchmarks report, tests check).
    assert "Steps: newton_schulz 5, polar_express_5 5, polar_express 12." in stdout
    check_provenance(markdown, "polar_kernels", stdout)


def test_polar_kernels_accuracy_matches_the_schedules_and_round_off(polar_run):
    rows = parse_table(polar_run[0])
    checked = set()
    for row in rows:
        k = min(int(side) for side in row["shape"].split(" × ")[-1].split("×"))
        spectrum = polar_kernels.log_spectrum(k)
        kappa_f = (spectrum.norm() / spectrum.min()).item()  # ||X||_F / sigma_min
        error, (low, high) = float(row["error κ=1e3"]), sigma_range(row["σ range κ=1e3"])
        method, dtype = row["kernel"], row["dtype"]
        if method == "svd":
            # Backward-stable SVD: the computed UV^T is the polar factor of X + E with
            # ||E||_2 <~ eps ||X||_F, which moves the polar factor by <= 2||E||_2 / sigma_min
            # (perturbation bound of the polar factor): 2 eps kappa_F (4.7e-4 here).
            assert error <= 2 * EPS32 * kappa_f, row
            for name in polar_kernels.INPUTS:
                low, high = sigma_range(row[f"σ range {name}"])
                # orthonormal columns to fp32 round-off (~sqrt(k) eps = 1e-6, below the printed 5e-6)
                assert 1 - 2 * SIGMA_RESOLUTION <= low <= high <= 1 + 2 * SIGMA_RESOLUTION, row
            checked.add(method)
        elif dtype == "fp32":
            # In exact arithmetic the output's singular values are p(sigma_i). Each step's
            # fp32 round-off is ~eps ||Y||_F = eps in absolute terms (Y is normalized), i.e.
            # eps kappa_F relative to the smallest singular value, and the odd polynomial
            # carries a relative perturbation of small singular values through unchanged:
            # at most steps * eps * kappa_F (2.8e-3 for 12 steps) in the worst alignment.
            predicted = predicted_sigmas(method, k)
            steps = SCHEDULES[method].default_steps
            tol = steps * EPS32 * kappa_f
            assert abs(low - predicted.min().item()) <= tol + SIGMA_RESOLUTION, row
            assert abs(high - predicted.max().item()) <= tol + SIGMA_RESOLUTION, row
            predicted_error = (predicted - 1).abs().max().item()
            assert abs(error - predicted_error) <= tol + printed_resolution(row["error κ=1e3"]), row
            checked.add(method)
        elif method == "polar_express":
            # bf16: the last steps are the fixed-point quintic (15/8, -5/4, 3/8), flat at 1,
            # so the output's singular values sit at 1 up to one step's bf16 round-off,
            # (|a| + |b| + |c|) u = 3.5 * 2^-8 = 0.014. (Small singular values below bf16's
            # resolution of the input are noise mapped to 1: the error is large, the range not.)
            bound = sum(abs(coefficient) for coefficient in POLAR_EXPRESS.coefficients[-1]) * U_BF16
            assert 1 - bound <= low <= high <= 1 + bound, row
    assert checked == {"svd", "newton_schulz", "polar_express_5", "polar_express"}
    by_kernel = {(r["shape"], r["kernel"], r["dtype"]): r for r in rows}
    for shape in {r["shape"] for r in rows}:
        # What the table is for: Polar Express (12 steps) is accurate in fp32, Keller Jordan's
        # quintic is not an exact polar factor (its singular values overshoot to ~1.2).
        assert float(by_kernel[(shape, "polar_express", "fp32")]["error κ=1e3"]) < 1e-2
        assert sigma_range(by_kernel[(shape, "newton_schulz", "fp32")]["σ range κ=1e3"])[1] > 1.15


def test_predicted_singular_values_tell_the_kernels_apart():
    # Negative control of the accuracy check: the kernels' predicted smallest singular
    # values differ by more than twice the largest tolerance (12 steps), so a row measured
    # on one kernel cannot pass as another's.
    k = 48
    spectrum = polar_kernels.log_spectrum(k)
    tol = 12 * EPS32 * (spectrum.norm() / spectrum.min()).item()
    minima = sorted(predicted_sigmas(method, k).min().item() for method in SCHEDULES)
    assert all(b - a > 2 * tol for a, b in zip(minima, minima[1:])), minima


def test_optimizer_step_writes_its_table(tmp_path):
    markdown = tmp_path / "optimizer_step.md"
    stdout = run_script("optimizer_step", markdown, "--clock", "process")
    rows = parse_table(stdout)
    assert [r["optimizer"] for r in rows] == [
        "torch.optim.Muon", "Muon (ours)", "ManifoldMuon Stiefel", "ManifoldMuon DGram",
        "ManifoldMuon Stiefel, projected", "ManifoldMuon DGram, projected", "RiemannianAdam Stiefel",
    ]
    steps = {r["optimizer"]: float(r["step (ms)"]) for r in rows}
    for row in rows:
        # The ratio is to the row named in "vs". Step times are printed to 0.1 ms (+-0.05
        # each), which moves t / v by up to 0.05 (1 + t / v) / v; the ratio has 2 decimals.
        expected = steps[row["optimizer"]] / steps[row["vs"]]
        assert abs(float(row["ratio"]) - expected) <= 0.005 + 0.05 * (1 + expected) / steps[row["vs"]], row
    state = {r["optimizer"]: float(r["state (MiB)"]) for r in rows}
    # Muon keeps one momentum buffer per matrix; Adam two moments.
    assert state["Muon (ours)"] == state["torch.optim.Muon"] > 0
    assert state["RiemannianAdam Stiefel"] == pytest.approx(2 * state["Muon (ours)"], abs=0.1)
    assert all(float(r["page faults / step"]) >= 0 for r in rows)
    check_provenance(markdown, "optimizer_step", stdout)


def test_minor_page_faults_count_fresh_memory_touched():
    """The step table's fault counter sees memory faulted in: 64 MiB of fresh pages written
    raise it (by 16k with 4 KiB pages, fewer with huge pages, never none); control: reading
    it twice in a row costs at most a few."""
    from bench.optimizer_step import minor_page_faults

    quiet = minor_page_faults()
    assert minor_page_faults() - quiet <= 8
    before = minor_page_faults()
    fresh = torch.ones(16 * 2**20)
    assert minor_page_faults() > before and fresh.sum() > 0


def test_the_device_check_counts_host_reads_and_trains(tmp_path):
    """``bench/device_check.py --quick`` on the CPU (what a GPU session runs with ``--device
    cuda``): the optimizers' matrix work reads nothing back, both pretraining smokes lower
    their loss; control: the counter it relies on counts a read."""
    from bench import device_check

    counter = [0]
    with device_check.counting_host_reads("cpu", counter):
        torch.ones(3).sum().item()
        bool(torch.ones(1))
    assert counter == [2]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "bench/device_check.py", "--device", "cpu", "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = (tmp_path / "device_check.md").read_text()
    tables = re.findall(r"(?:^\|.*\|$\n?)+", report, re.MULTILINE)
    reads = parse_table(tables[0])
    assert [r["optimizer"] for r in reads] == ["Muon (ours)", "ManifoldMuon Stiefel", "ManifoldMuon DGram",
                                                "ManifoldMuon Stiefel, projected", "ManifoldMuon DGram, projected"]
    assert all(r["matrix work (must be 0)"] == "0" for r in reads)
    smoke = parse_table(tables[-1])
    assert [(r["strategy"], r["finite and lower"]) for r in smoke] == [("unconstrained", "yes"), ("hetero", "yes")]
    assert (tmp_path / "optimizer_step_cpu.md").exists()


def test_manifold_frontier_writes_its_table(tmp_path):
    markdown = tmp_path / "manifold_frontier.md"
    stdout = run_script("manifold_frontier", markdown, "--clock", "process", "--dual", "0", "2",
                        "--solver", "dual", "projected", "--polish", "0", "2", "--reference", "4")
    rows = parse_table(stdout)
    # both dual updates x 0 and 2 dual steps x warm and cold, then the projected solver's
    # rows by polish rounds; the default solver (Stiefel: Newton, two dual steps and the
    # carried one, warm) is the one row marked so
    expected = [(update, dual, start) for update in ("newton", "jacobi") for dual in ("0", "2") for start in ("warm", "cold")]
    expected += [("-", "0 (polish 0)", "projection"), ("-", "0 (polish 2)", "projection")]
    assert [(r["dual update"], r["dual steps"], r["start"].replace(" (default)", "")) for r in rows] == expected
    assert [r for r in rows if r["start"].endswith("(default)")] == [rows[2]]
    assert [r["path"] for r in rows[-2:]] == ["Gram space, projected"] * 2
    for row in rows:
        # a certified ratio is primal / dual of a feasible direction: in (0, 1]
        assert 0 < float(row["min"]) <= float(row["mean certified ratio"]) <= 1, row
        assert float(row["step cost / Muon"]) > 0, row
    check_provenance(markdown, "manifold_frontier", stdout)


def test_manifold_inrun_reads_the_certificates_of_a_real_run(tmp_path):
    markdown = tmp_path / "manifold_inrun.md"
    runs = ROOT / "runs"  # where a run's default out_dir template puts its folder
    before = set(os.listdir(runs)) if runs.is_dir() else set()
    stdout = run_script("manifold_inrun", markdown, "--solver", "dual", "projected")
    # the benchmark's runs stay in memory: it had left a folder with two checkpoints per run in ./runs
    assert (set(os.listdir(runs)) if runs.is_dir() else set()) == before
    rows = parse_table(stdout)
    # per solver and manifold: one row per orientation the model has, then "all" (their
    # union); both forms declare a Newton step (Stiefel's closed form, DGram's conjugate
    # gradients), which the projected solver does not take
    assert [(r["solver"], r["manifold"], r["matrices"]) for r in rows] == [
        (s, m, kind) for s in ("dual", "projected") for m in ("stiefel", "dgram") for kind in ("square", "tall", "wide", "all")]
    assert {r["dual update"] for r in rows if r["solver"] == "dual"} == {"newton (default)"}
    assert {(r["dual update"], r["dual steps"], r["start"]) for r in rows if r["solver"] == "projected"} == {
        ("-", "0", "projection")}
    assert {r["reference dual steps"] for r in rows} == {"0"}  # the step's own dual iterate
    for solver, manifold in itertools.product(("dual", "projected"), ("stiefel", "dgram")):
        mine = [r for r in rows if (r["solver"], r["manifold"]) == (solver, manifold)]
        # 1 layer: c_attn (tall), c_proj (square), mlp in (tall) and out (wide), certified at
        # steps 2 and 4 of 4: 2 x (2 tall, 1 square, 1 wide)
        assert [int(r["certified steps x matrices"]) for r in mine] == [2, 4, 2, 8]
        for row in mine:
            # a certified ratio is primal / dual of a feasible direction: in (0, 1]
            assert 0 < float(row["min"]) <= float(row["mean certified ratio"]) <= 1, row
        assert float(mine[-1]["min"]) == min(float(r["min"]) for r in mine[:-1])
    check_provenance(markdown, "manifold_inrun", stdout)


def test_lipschitz_tightness_table_never_shows_a_violation(tmp_path):
    markdown = tmp_path / "lipschitz_tightness.md"
    stdout = run_script("lipschitz_tightness", markdown)
    rows = parse_table(stdout)
    assert [(r["model"], r["norm"]) for r in rows] == [
        ("2 layers, 2 heads", "per token"), ("2 layers, 2 heads", "whole sequence (T = 4)")]
    for row in rows:
        simple, tight, aligned, joint, estimate = (float(row[key]) for key in (
            "simple bound", "tight bound", "aligned bound", "joint bound", "best estimate"))
        # the estimate is a lower bound on the constant, each bound an upper bound, and each
        # method is never above the one before (4 significant digits printed: 5e-4 relative)
        assert 0 < estimate <= joint * (1 + 5e-4), row
        assert joint <= aligned * (1 + 5e-4) and aligned <= tight * (1 + 5e-4) and tight <= simple * (1 + 5e-4), row
        # ratios printed with one decimal
        for name, bound in (("tight", tight), ("aligned", aligned), ("joint", joint)):
            assert abs(float(row[f"{name} / estimate"]) - bound / estimate) <= 0.05 + 1e-3 * bound / estimate, row
    # the a-priori bound at the cap for the Shakespeare shape is stated, and is far from "below 2"
    cap = re.search(r"A-priori bound at the cap .*?: simple (\S+), tight (\S+), aligned (\S+), joint (\S+) \(joint is "
                    r"the default\)", markdown.read_text())
    assert cap and 2 < float(cap.group(4)) <= float(cap.group(3)) <= float(cap.group(2)) <= float(cap.group(1))
    check_provenance(markdown, "lipschitz_tightness", stdout)


def test_equivariance_checker_catalogue_has_no_false_verdicts(tmp_path):
    markdown = tmp_path / "equivariance_checker.md"
    stdout = run_script("equivariance_checker", markdown)
    blocks = re.findall(r"(?:^\|.*\|$\n?)+", stdout, re.MULTILINE)
    summary = parse_table(blocks[-2])
    assert [row["route"] for row in summary] == ["cli", "api"]
    for row in summary:
        # The catalogue's verdicts are known: a checker that misjudges any entry fails here.
        assert row["false positives"] == row["false negatives"] == "0", row
        assert row["unexpected errors"] == row["missed errors"] == row["inconclusive"] == "0", row
        assert int(row["checks"]) >= 20 and float(row["median time per check (s)"]) > 0
    entries = parse_table(stdout)
    assert len(entries) == int(summary[0]["checks"])
    assert all(row["API"] == row["CLI"] == row["expected"] for row in entries)
    assert {row["expected"] for row in entries} == {"holds", "violated", "error"}
    assert re.search(r"import included: [\d.]+ s wall, [\d.]+ s CPU", stdout)
    check_provenance(markdown, "equivariance_checker", stdout)


def test_every_symbolic_mutation_finds_its_pattern_once():
    """A mutation whose pattern no longer occurs in the code (the formula was rewritten) would
    abort the mutation run; each must match exactly one place and change it, so the catalogue
    keeps pace with the library. The negative control: a pattern that is not in the file is
    refused by the same check."""
    from bench import symbolic_mutations as sm

    for mutation in sm.MUTATIONS:
        assert mutation.old != mutation.new, mutation.label
        text = sm._check_pattern(ROOT, mutation)
        assert text.replace(mutation.old, mutation.new) != text, mutation.label
    missing = sm.Mutation("absent", sm.MUTATIONS[0].path, "this text is not in the file", "x")
    with pytest.raises(SystemExit, match="0 copies"):
        sm._check_pattern(ROOT, missing)


def usage_error(script: str, *argv: str, **environment: str) -> str:
    """stderr of ``python bench/<script>.py ARGV`` (``environment`` added to this process's),
    which must exit 2 (a usage error) within seconds: every refusal below comes before
    anything is measured or trained."""
    result = subprocess.run([sys.executable, f"bench/{script}.py", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1", **environment))
    assert result.returncode == 2, (argv, result.returncode, result.stderr[-2000:])
    return result.stderr


def test_bad_options_are_usage_errors_before_any_work(tmp_path):
    # each had been a traceback after minutes to hours of work, a silent normal-looking table
    # (manifold_inrun --alpha -1), or a published table replaced by a smoke run
    published = tmp_path / "published.md"
    published.write_text("a published table\n")
    (tmp_path / "afile").write_text("")
    cases = [
        ("polar_kernels", ["--quick", "--markdown", str(published)], "exists (a published table?); pass --overwrite"),
        ("optimizer_step", ["--quick", "--markdown", str(tmp_path)], "is a folder; give a file path"),
        ("optimizer_step", ["--quick", "--markdown", str(tmp_path / "afile" / "t.md")], "afile is a file, not a folder"),
        ("optimizer_step", ["--quick", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        ("optimizer_step", ["--quick", "--layers", "0"], "argument --layers: must be >= 1"),
        ("distributed_step", ["--worlds", "1,x"], "--worlds must be comma-separated process counts"),
        ("distributed_step", ["--repeats", "0"], "argument --repeats: must be >= 1"),
        ("manifold_inrun", ["--quick", "--manifold", "stiefel", "--alpha", "-1"], "--alpha (on stiefel): ManifoldMuon "
                                                                                  "refuses it: group 0: dual_alpha"),
        ("manifold_inrun", ["--quick", "--manifold", "stiefel", "--reference", "-1"], "--reference (on stiefel)"),
        ("manifold_inrun", ["--manifold", "stiefel", "--steps", "21"], "--steps must be >= 40"),
        ("manifold_frontier", ["--quick", "--msign", "nope"], "ManifoldMuon refuses them: group 0: msign_method"),
        ("manifold_frontier", ["--quick", "--dual", "0", "-1"], "argument --dual: must be >= 0"),
        ("symbolic_mutations", ["--only", "no such label"], "no mutation in --range : has a label containing"),
        ("symbolic_mutations", ["--range", "5"], "--range must be START:STOP"),
        ("symbolic_mutations", ["--markdown", str(published)], "exists (a published table?)"),
    ]
    for script, argv, message in cases:
        assert message in usage_error(script, *argv), (script, argv)
    assert published.read_text() == "a published table\n"
    # control: --overwrite is what lets a table be replaced (the path check passes; --threads 0 stops it)
    assert "exists" not in usage_error("polar_kernels", "--quick", "--markdown", str(published), "--overwrite",
                                       "--threads", "0")
    # a clock for a run that times nothing had been taken and printed in the header as if used; and
    # libgomp's GOMP_SPINCOUNT=0, PASSIVE's sleep under another name, had been neither refused nor recorded
    assert "--clock process: this run times nothing; drop --clock" in usage_error(
        "manifold_inrun", "--quick", "--clock", "process")
    # (a folder as --markdown stops a timed run just after the wait check: the control needs no timing)
    assert "GOMP_SPINCOUNT=0 is set" in usage_error("polar_kernels", "--markdown", str(tmp_path), GOMP_SPINCOUNT="0",
                                                    OMP_WAIT_POLICY="active")
    assert "is a folder" in usage_error("polar_kernels", "--markdown", str(tmp_path), GOMP_SPINCOUNT="100",
                                        OMP_WAIT_POLICY="active")


def test_a_table_that_appeared_during_the_run_is_kept(tmp_path, monkeypatch):
    # two runs into one --markdown path had both passed the start's check and both printed "written",
    # the second replacing the first's table; now the file is created exclusively at the end
    from bench.timing import Provenance, add_arguments

    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # recorded: every OMP_/GOMP_/KMP_/MKL_ variable is
    parser = argparse.ArgumentParser()
    add_arguments(parser, repeats=1)
    target = tmp_path / "table.md"
    args = parser.parse_args(["--quick", "--markdown", str(target)])
    provenance = Provenance("bench/example.py", args, [], parser)
    target.write_text("the other run's table\n")  # written while this run measured
    written = provenance.write(target, "| a |\n|---|\n| 1 |")
    assert written == tmp_path / "table-2.md" and target.read_text() == "the other run's table\n"
    assert "| a |" in written.read_text() and "GOMP_SPINCOUNT=1000" in written.read_text()
    # control: with --overwrite the path is replaced
    args = parser.parse_args(["--quick", "--markdown", str(target), "--overwrite"])
    assert Provenance("bench/example.py", args, [], parser).write(target, "| b |\n|---|\n| 2 |") == target
    assert "| b |" in target.read_text()


def test_the_device_checks_cuda_paths_count_and_name_the_device(monkeypatch):
    """What the device check does only on a GPU, simulated on the CPU (no test here runs CUDA):
    (1) a timed call on ``cuda:1`` waits for that device (``torch.cuda.synchronize()`` waits for
    the current one: ``cuda:1``'s kernels had been timed unfinished); (2) the pretraining smoke
    passes ``geomuon pretrain`` a device it takes (it refused ``cuda:1``), the GPU chosen through
    ``CUDA_VISIBLE_DEVICES`` (among those already visible); (3) on CUDA the whole step's count of
    syncs includes its matrix work's, as on the CPU (the matrix work's context had recorded them
    away from the step's). Controls: nothing synchronized on the CPU, no variable set for a bare
    ``cuda``."""
    import warnings

    from bench import device_check
    from bench.timing import synchronizer

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    synchronizer("cuda:1")()
    synchronizer("cpu")()
    assert waited == ["cuda:1"]

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_check.device_for_pretrain("cpu")[0] == "cpu"
    kind, env = device_check.device_for_pretrain("cuda")
    assert kind == "cuda" and "CUDA_VISIBLE_DEVICES" not in env
    kind, env = device_check.device_for_pretrain("cuda:1")
    assert (kind, env["CUDA_VISIBLE_DEVICES"]) == ("cuda", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b")
    assert device_check.device_for_pretrain("cuda:1")[1]["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    for visible in ("0", ""):  # a GPU it does not list (an empty list hides every GPU)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with pytest.raises(ValueError, match=f"--device cuda:1: CUDA_VISIBLE_DEVICES='{visible}' lists no GPU 1"):
            device_check.device_for_pretrain("cuda:1")
    # the smoke's runs get it: each `geomuon pretrain` on the device type, in that environment
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    launched = []

    def run(command, **kwargs):
        launched.append((command[command.index("--device") + 1], kwargs["env"]["CUDA_VISIBLE_DEVICES"]))
        return subprocess.CompletedProcess(command, 1, "", "not run")

    monkeypatch.setattr(device_check.subprocess, "run", run)
    device_check.pretrain_smoke("cuda:1", Path("unused"), quick=True)
    assert launched == [("cuda", "GPU-b")] * 2

    class Synchronizing:
        """An optimizer whose step syncs once around its matrix work and once inside it."""
        param_groups = [{"params": [torch.zeros(1)]}]

        def step(self):
            warnings.warn("called a synchronizing CUDA operation")
            self._matrix_step()

        def _matrix_step(self):
            warnings.warn("called a synchronizing CUDA operation")

    names = ("Muon (ours)", "ManifoldMuon Stiefel", "ManifoldMuon DGram", "ManifoldMuon Stiefel, projected",
             "ManifoldMuon DGram, projected")
    monkeypatch.setattr(device_check.optimizer_step, "build",
                        lambda *args, **kwargs: ({name: Synchronizing() for name in names}, [torch.zeros(1)]))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    with warnings.catch_warnings():  # (the warm-up steps' syncs, which nothing counts)
        warnings.filterwarnings("ignore", "called a synchronizing CUDA operation")
        assert device_check.host_reads("cuda", []) == [[name, "2", "1"] for name in names]


def test_the_device_check_refuses_a_folder_that_holds_a_report(tmp_path):
    (tmp_path / "device_check.md").write_text("the first report\n")
    assert "already holds files" in usage_error("device_check", "--device", "cpu", "--quick", "--out", str(tmp_path))
    assert (tmp_path / "device_check.md").read_text() == "the first report\n"


def test_lipschitz_tightness_reuses_only_the_finished_run_it_asked_for(tmp_path, monkeypatch):
    # an interrupted run's checkpoint (fewer steps), or another shape's, had been read as the
    # catalogue model and its reached radius reported as a violation of the bound
    from bench import lipschitz_tightness
    from geomuon.pretrain import train

    spec = lipschitz_tightness.Model(2, 2, 30)
    path = tmp_path / "ckpt.pt"
    path.write_text("stand-in: load_checkpoint is patched")
    finished = {"step": 30, "config": {"seed": 0, "strategy": "lipschitz"}, "model_config": {"n_layer": 2, "n_head": 2}}
    for checkpoint, reused in ((finished, True), ({**finished, "step": 12}, False),
                               ({**finished, "model_config": {"n_layer": 3, "n_head": 4}}, False),
                               ({**finished, "config": {"seed": 1, "strategy": "lipschitz"}}, False)):
        monkeypatch.setattr(train, "load_checkpoint", lambda _path, c=checkpoint: c)
        assert (lipschitz_tightness._reusable(path, spec, seed=0) is not None) == reused, checkpoint



def refused_in_process(main, capsys, *argv: str) -> str:
    """stderr of a bench script's ``main(ARGV)`` in this process (seconds less than a fresh
    interpreter), which must stop with a usage error (exit status 2) before any work."""
    with pytest.raises(SystemExit) as stopped:
        main(list(argv))
    assert stopped.value.code == 2, argv
    return capsys.readouterr().err


def test_device_option_refuses_a_device_that_cannot_be_timed(tmp_path, monkeypatch, capsys):
    # an unusable --device had been a traceback from the first tensor moved (device_check:
    # after making its --out folder); another accelerator would be timed without a synchronize
    from bench import device_check, optimizer_step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report"
    assert "argument --device: 'cuda'" in refused_in_process(optimizer_step.main, capsys, "--quick", "--device", "cuda")
    assert "argument --device: 'cuda'" in refused_in_process(device_check.main, capsys, "--quick", "--device", "cuda",
                                                              "--out", str(out))
    assert not out.exists()
    from bench.timing import device_option

    assert device_option("cpu") == "cpu"
    for text, message in (("nonsense", "expected cpu, cuda or cuda:N"), ("mps", "only cpu and cuda"),
                          ("cuda", "sees no CUDA device")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            device_option(text)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_option("cuda") == "cuda" and device_option("cuda:0") == "cuda:0"
    with pytest.raises(argparse.ArgumentTypeError, match="has 1 CUDA device"):
        device_option("cuda:1")


def test_the_gpt2_small_set_takes_no_gpt_sizes(tmp_path, capsys):
    # --layers and --width had been ignored by the fixed block, and --quick had timed the full
    # block; the size check comes before the output path's (the control: that path exists)
    from bench import optimizer_step

    published = tmp_path / "published.md"
    published.write_text("a published table\n")
    for option in (["--layers", "2"], ["--width", "64"], ["--quick"]):
        stderr = refused_in_process(optimizer_step.main, capsys, "--set", "gpt2-small", *option,
                                    "--markdown", str(published))
        assert f"--set gpt2-small is one d = 768 block of fixed size; it takes no {option[0]}" in stderr, option
    assert published.read_text() == "a published table\n"


def test_a_timing_run_under_passive_openmp_waits_is_refused(monkeypatch, capsys):
    # the tests' OMP_WAIT_POLICY=PASSIVE slows ManifoldMuon's small kernels (7.0x our Muon
    # instead of 5.1x at two threads): a table measured so had been written as a result
    from bench import optimizer_step
    from bench.timing import Provenance, add_arguments

    parser = argparse.ArgumentParser(prog="bench")
    add_arguments(parser, repeats=1)

    def provenance(*argv, timed=True):
        return Provenance("bench/x.py", parser.parse_args(list(argv)), list(argv), parser, timed=timed)

    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    with pytest.raises(SystemExit) as refused:
        provenance()
    assert refused.value.code == 2
    # controls: a smoke run, a script that times nothing, and the default wait policy pass
    provenance("--quick")
    provenance(timed=False)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    for name in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME"):  # (the caller's: either would refuse the run too)
        monkeypatch.delenv(name, raising=False)
    provenance()
    # a script: a full-size run is refused before it measures
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OMP_WAIT_POLICY=PASSIVE is set" in refused_in_process(optimizer_step.main, capsys, "--layers", "1")


def test_equivariance_checker_times_each_check_on_the_clock_asked_for():
    # --clock process had been recorded in the header while every check was timed on the wall clock
    from bench import equivariance_checker

    ticks = iter([10.0, 13.5, 20.0, 20.25])  # differences exact in binary: 3.5 and 0.25

    def clock():
        return next(ticks)

    entry = equivariance_checker.CATALOGUE[0]
    assert entry.target.endswith(":svd_msign") and entry.expected == "holds"
    assert equivariance_checker.run_api(entry, "6x4", "float64", 0, clock) == ("holds", 3.5)
    assert equivariance_checker.run_cli(entry, "6x4", "float64", 0, clock) == ("holds", 0.25)


def test_equivariance_checker_catches_its_structured_and_stacked_entries_only_with_their_options():
    # The maps broken only at ties, zeros and D = 0 (or only in a stack) are caught by
    # --structured (a batched shape) alone: each route must pass the entry's option on, since
    # without it the same map holds (negative control: the option, not the map, decides).
    from dataclasses import replace

    from bench import equivariance_checker

    special = [entry for entry in equivariance_checker.CATALOGUE if entry.structured or entry.batch]
    assert {entry.expected for entry in special} == {"holds", "violated"}
    assert any(entry.structured for entry in special) and any(entry.batch for entry in special)
    for entry in special:
        if entry.expected != "violated":
            continue
        plain = replace(entry, structured=False, batch=())
        for runner in (equivariance_checker.run_api, equivariance_checker.run_cli):
            assert runner(entry, entry.shape("6x4"), "float64", 0)[0] == "violated", (entry.label, runner.__name__)
            assert runner(plain, "6x4", "float64", 0)[0] == "holds", (entry.label, runner.__name__)


def test_symbolic_mutations_refuses_a_timeout_that_is_not_positive(capsys):
    # --timeout 0 or less had copied the repository and timed the unmutated suite out at once (exit 1)
    from bench import symbolic_mutations

    assert "argument --timeout: must be a finite number of seconds > 0, got 0" in refused_in_process(
        symbolic_mutations.main, capsys, "--timeout", "0", "--only", "GELU")
    from bench.timing import positive_seconds

    assert positive_seconds("0.5") == 0.5
    for text in ("-1", "nan", "inf", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_seconds(text)


def test_distributed_step_quick_keeps_the_repeats_asked_for(monkeypatch):
    # --quick had fixed 2 timed steps whatever --repeats said (and the header echoed --repeats)
    from bench import distributed_step

    class Measured(Exception):
        pass

    def first_measurement(name, mode, steps, *sizes):
        raise Measured(steps)  # the steps the run asked for, before any work

    monkeypatch.setattr(distributed_step, "measure", first_measurement)
    for argv, steps in ((["--repeats", "1"], 2), (["--repeats", "4"], 5), ([], 1 + distributed_step.QUICK_REPEATS)):
        with pytest.raises(Measured) as measured:
            distributed_step.main(["--quick", "--worlds", "1", *argv])
        assert measured.value.args == (steps,), argv


def test_manifold_frontier_polish_needs_the_projected_solver(capsys):
    # --polish without --solver projected had been ignored (the dual rows take the default rounds)
    from bench import manifold_frontier

    stderr = refused_in_process(manifold_frontier.main, capsys, "--quick", "--polish", "1")
    assert "--polish sets the projected solver's rows, and --solver dual has none" in stderr


def test_manifold_inrun_refuses_a_data_spec_it_cannot_read(capsys):
    # an unknown spec had been a ValueError traceback from inside train(), after the set-up
    from bench import manifold_inrun

    stderr = refused_in_process(manifold_inrun.main, capsys, "--quick", "--data", "bogus")
    assert "--data: unknown data spec 'bogus'" in stderr


def test_manifold_frontier_dual_options_need_the_dual_solver(monkeypatch, capsys):
    # with --solver projected alone, --dual, --starts, --retraction, --update and --alpha had been
    # ignored (the projected rows take none of them) and --alpha printed in the caption as used
    from bench import manifold_frontier

    for option in (["--dual", "3"], ["--starts", "cold"], ["--retraction", "manifold"], ["--update", "jacobi"],
                   ["--alpha", "1.5"]):
        stderr = refused_in_process(manifold_frontier.main, capsys, "--quick", "--solver", "projected", *option)
        assert f"{option[0]} set the dual solver's rows, and --solver projected has none" in stderr, option

    class Measured(Exception):
        pass

    def first_row(shapes, manifold, dual_steps, warm, *rest, **options):
        raise Measured(dual_steps, warm)  # the first dual row's settings, before any work

    # controls: with the dual solver the options are taken, and their defaults (--quick's dual steps) still apply
    monkeypatch.setattr(manifold_frontier, "run_config", first_row)
    for argv, first in ((["--solver", "dual", "projected", "--dual", "3", "--starts", "cold"], (3, False)),
                        ([], (manifold_frontier.QUICK["dual"][0], True))):
        with pytest.raises(Measured) as measured:
            manifold_frontier.main(["--quick", "--repeats", "0", *argv])
        assert measured.value.args == first, argv


def test_manifold_inrun_dual_options_need_the_dual_solver(monkeypatch, capsys):
    # with --solver projected alone, the dual options had been ignored: one projected run, its
    # table silent about the --dual, --alpha, ... that were asked for
    from bench import manifold_inrun

    for option in (["--update", "jacobi"], ["--dual", "3"], ["--polish-method", "alternating"],
                   ["--starts", "cold"], ["--smoothing", "0.03"], ["--alpha", "1.5"]):
        stderr = refused_in_process(manifold_inrun.main, capsys, "--quick", "--solver", "projected", *option)
        assert f"{option[0]} set the dual solver's rows, and --solver projected has none" in stderr, option

    class Trained(Exception):
        pass

    def first_run(manifold, settings, *rest):
        raise Trained(settings)  # the first run's ManifoldMuon settings, before any training

    # controls: with the dual solver the options are taken; without them ManifoldMuon's defaults stand
    monkeypatch.setattr(manifold_inrun, "certified_run", first_run)
    for argv, expected in ((["--solver", "dual", "projected", "--dual", "3", "--starts", "cold"],
                            {"dual_steps": 3, "warm_start": False}),
                           ([], {"warm_start": True})):
        with pytest.raises(Trained) as trained:
            manifold_inrun.main(["--quick", "--manifold", "stiefel", *argv])
        settings = trained.value.args[0]
        assert {key: settings.get(key) for key in expected} == expected, argv


def test_equivariance_checker_refuses_to_time_a_failed_cli_process(monkeypatch):
    # the whole-process time had been measured with the exit status unread: a CLI process that
    # crashed at import had its seconds published as the time of a check (the real process is
    # timed by test_equivariance_checker_catalogue_has_no_false_verdicts's --quick run)
    from bench import equivariance_checker

    def finished_with(status):
        return lambda command, **options: subprocess.CompletedProcess(command, status, "", "ImportError: stand-in")

    monkeypatch.setattr(equivariance_checker.subprocess, "run", finished_with(1))
    with pytest.raises(SystemExit, match=r"exited 1, not 0 \(svd_msign holds\)(.|\n)*ImportError: stand-in"):
        equivariance_checker.cli_process_time(1)
    # control: a process that exits 0 is timed
    monkeypatch.setattr(equivariance_checker.subprocess, "run", finished_with(0))
    assert len(equivariance_checker.cli_process_time(1)) == 2


def test_results_prose_on_cold_starts_and_jacobi_steps_holds_for_the_frontier_tables():
    # the Results page had said "cold starts cost less than one dual step of quality", which
    # DGram's rows contradict (1 step cold below 0 steps warm), and that Jacobi steps certify as
    # Newton's "at a lower cost", comparing step costs measured at bf16/fp32 rates of 0.5 and 7.5
    page = " ".join((ROOT / "docs" / "results" / "index.md").read_text().split())  # lines unwrapped
    tables = ROOT / "docs" / "results" / "benchmarks"
    rows = {name: parse_table((tables / f"{name}.md").read_text())
            for name in ("manifold_frontier", "manifold_frontier_jacobi")}

    def row(table, manifold, steps, start):
        [found] = [r for r in rows[table] if r["manifold"] == manifold and r["dual steps"].split()[0] == str(steps)
                   and r["start"].split()[0] == start]
        return found

    def quote(table, manifold, steps, start):
        found = row(table, manifold, steps, start)
        return f"{found['mean certified ratio']} / {found['min']}"

    def mean(*key):
        return float(row(*key)["mean certified ratio"])

    cold = page[page.index("* A cold start costs"):page.index("The Jacobi rows")]
    assert "costs Stiefel less than one dual step" in cold and "DGram more in the mean" in cold, cold
    assert mean("manifold_frontier", "stiefel", 1, "cold") >= mean("manifold_frontier", "stiefel", 0, "warm")
    assert mean("manifold_frontier", "dgram", 1, "cold") < mean("manifold_frontier", "dgram", 0, "warm")
    for key in (("stiefel", 1, "cold"), ("stiefel", 0, "warm"), ("dgram", 1, "cold"), ("dgram", 0, "warm"),
                ("dgram", 1, "warm"), ("dgram", 2, "cold")):
        assert quote("manifold_frontier", *key) in cold, key
    jacobi = page[page.index("The Jacobi rows"):page.index("Newton is the default")]
    for table, manifold, steps in (("manifold_frontier_jacobi", "stiefel", 2), ("manifold_frontier", "stiefel", 2),
                                   ("manifold_frontier_jacobi", "dgram", 2), ("manifold_frontier_jacobi", "dgram", 4),
                                   ("manifold_frontier", "dgram", 2), ("manifold_frontier", "dgram", 4)):
        assert quote(table, manifold, steps, "warm") in jacobi, (table, manifold, steps)
    rates = {name: re.search(r"^\| bf16 / fp32 matmul rate \| ([\d.]+)x ", (tables / f"{name}.md").read_text(),
                             re.MULTILINE).group(1) for name in rows}
    assert rates["manifold_frontier_jacobi"] != rates["manifold_frontier"]  # so the costs are not comparable
    assert f"bf16 at {rates['manifold_frontier_jacobi']}× its fp32 rate" in jacobi
    assert f"where it runs at {rates['manifold_frontier']}×" in jacobi and "not comparable" in jacobi


def test_results_page_names_every_table_whose_header_lacks_the_rate_or_the_cpu():
    # the Results page had said every table's header records the machine (CPU model) and the
    # bf16 / fp32 rate the step ratios depend on, while older tables it includes record neither
    page_text = (ROOT / "docs" / "results" / "index.md").read_text()
    page = " ".join(page_text.split())  # lines unwrapped
    caveat = page[page.index("Tables older than these header rows"):page.index("### Polar-factor kernels")]
    included = [file or name for name, file in re.findall(r"^<!-- geomuon:benchmark (\w+)(?: (\w+))? -->$",
                                                          page_text, re.MULTILINE)]
    assert "polar_kernels" in included and "optimizer_step_amx" in included, included
    lacking = []
    for name in included:
        header = (ROOT / "docs" / "results" / "benchmarks" / f"{name}.md").read_text()
        commit = re.search(r"^\| commit \| `([0-9a-f]+)(?:-dirty)?` \|", header, re.MULTILINE).group(1)
        no_rate = re.search(r"^\| bf16 / fp32 matmul rate \| ", header, re.MULTILINE) is None
        no_cpu = re.search(r"^\| machine \| [^|]*CPU\(s\) \|$", header, re.MULTILINE) is not None
        if no_rate or no_cpu:
            lacking.append(name)
            assert f"`{commit}`" in caveat, (name, commit, "lacks", "the rate" if no_rate else "the CPU model")
    assert lacking, "no included table lacks a header row: drop the caveat from the Results page"


def test_manifold_frontier_general_path_rows_take_no_gram_option(monkeypatch, capsys):
    # --retraction manifold had passed the Gram path's dual_update to ManifoldMuon, which refuses
    # it there: a traceback at the first general-path row, after every Gram-space row before it
    from bench import manifold_frontier

    stderr = refused_in_process(manifold_frontier.main, capsys, "--quick", "--retraction", "manifold",
                                "--dualizer", "eigh")
    assert "ManifoldMuon refuses them: group 0: gram_dualizer='eigh' would be ignored" in stderr

    class Measured(Exception):
        pass

    def first_row(shapes, manifold, dual_steps, warm, steps, seed, alpha, reference, **options):
        raise Measured(options)  # the first row's ManifoldMuon options, before any work

    monkeypatch.setattr(manifold_frontier, "run_config", first_row)
    for retraction, expected in (("manifold", {"retraction": "manifold"}),
                                 ("fused", {"retraction": "fused", "dual_update": "jacobi"})):  # control
        with pytest.raises(Measured) as measured:
            manifold_frontier.main(["--quick", "--repeats", "0", "--retraction", retraction, "--update", "jacobi"])
        assert measured.value.args == (expected,), retraction


def test_every_table_header_records_the_machine_and_its_bf16_fp32_rate(monkeypatch):
    # the step ratios depend on the bf16 / fp32 rate (ManifoldMuon 1.9x our Muon at 0.5x, 10.6x at
    # 7.4x): no script test read that row or the CPU model, so a header without them had passed
    from bench.timing import Provenance, add_arguments
    from geomuon.pretrain.provenance import machine

    parser = argparse.ArgumentParser(prog="bench")
    add_arguments(parser, repeats=1, threads=1)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):  # a timed run under none of the sleeps
        monkeypatch.delenv(name, raising=False)
    header = Provenance("bench/x.py", parser.parse_args([]), [], parser).header()
    assert f"| machine | {machine()} |" in header
    ratio, bf16, fp32 = (float(value) for value in re.search(
        r"^\| bf16 / fp32 matmul rate \| (\S+)x \((\S+) vs (\S+) GFLOP/s, 1024\^3 products\) \|$", header,
        re.MULTILINE).groups())
    # the ratio is printed to 2 significant digits (5 % relative), each rate to 3 (0.5 % each)
    assert ratio > 0 and abs(ratio - bf16 / fp32) <= 0.05 * ratio + 0.01 * bf16 / fp32


class Started(Exception):
    """Raised by a stand-in for a script's first piece of work: the run got past its checks."""


def start_work(*args, **kwargs):
    raise Started(args)


@pytest.fixture
def script_settings(monkeypatch):
    """Run a script's ``main`` in this process and leave the process as it was: the scripts set
    torch's thread count, and equivariance_checker ``OMP_NUM_THREADS`` when it is unset."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # restored after the test
    yield
    torch.set_num_threads(threads)


#: Each script that takes --markdown, with its quick options and the function where its work begins.
MARKDOWN_SCRIPTS = {
    "polar_kernels": ([], "measure"),
    "optimizer_step": ([], "build"),
    "manifold_frontier": ([], "run_config"),
    "manifold_inrun": ([], "certified_run"),
    "lipschitz_tightness": ([], "capped_shakespeare_bounds"),
    "equivariance_checker": ([], "measure"),
    "distributed_step": (["--worlds", "1"], "measure"),
    "symbolic_mutations": (["--only", "GELU"], "_copy_tree"),
}


def test_every_markdown_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, capsys,
                                                                                script_settings):
    # --markdown /proc/... had been found unwritable only by the write at the end, a
    # FileNotFoundError traceback after the whole benchmark
    import importlib

    for name, (options, work) in MARKDOWN_SCRIPTS.items():
        script = importlib.import_module(f"bench.{name}")
        monkeypatch.setattr(script, work, start_work)
        quick = [] if name == "symbolic_mutations" else ["--quick"]
        stderr = refused_in_process(script.main, capsys, *quick, *options, "--markdown", "/proc/geomuon_bench/t.md")
        assert "--markdown '/proc/geomuon_bench' cannot be created or written" in stderr, name
        # control: a path in folders that do not exist yet passes, and the check leaves nothing behind
        # (the write at the end creates them: a run stopped before it had left them empty)
        with pytest.raises(Started):
            script.main([*quick, *options, "--markdown", str(tmp_path / name / "sub" / "t.md")])
        assert not (tmp_path / name).exists(), name


def test_output_folders_are_checked_before_any_work(tmp_path, monkeypatch, capsys, script_settings):
    # lipschitz_tightness --checkpoints onto a file had been refused after the bounds at the cap
    # (~20 s), naming the training's --out-dir; device_check --out /proc/x had been a traceback
    from bench import device_check, lipschitz_tightness

    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(lipschitz_tightness, "capped_shakespeare_bounds", start_work)
    monkeypatch.setattr(device_check, "host_reads", start_work)
    for argv, message in ((["--checkpoints", str(tmp_path / "afile")], f"--checkpoints {tmp_path / 'afile'} is a file"),
                          (["--checkpoints", str(tmp_path / "afile" / "runs")], f"{tmp_path / 'afile'} is a file, not "
                                                                                 "a folder"),
                          (["--checkpoints", "/proc/geomuon_bench"], "--checkpoints '/proc/geomuon_bench' cannot be "
                                                                     "created or written")):
        assert message in refused_in_process(lipschitz_tightness.main, capsys, "--quick", *argv), argv
    assert "--out '/proc/geomuon_bench' cannot be created or written" in refused_in_process(
        device_check.main, capsys, "--device", "cpu", "--quick", "--out", "/proc/geomuon_bench")
    # a later refusal (--markdown onto a published table) leaves no --checkpoints folder behind
    (tmp_path / "published.md").write_text("table")
    assert "exists (a published table?)" in refused_in_process(
        lipschitz_tightness.main, capsys, "--quick", "--checkpoints", str(tmp_path / "left" / "ck"),
        "--markdown", str(tmp_path / "published.md"))
    assert not (tmp_path / "left").exists()
    # controls: a new folder passes (the training creates it; device_check's report is written there)
    with pytest.raises(Started):
        lipschitz_tightness.main(["--quick", "--checkpoints", str(tmp_path / "checkpoints")])
    with pytest.raises(Started):
        device_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "report")])
    assert (tmp_path / "report").is_dir() and not any((tmp_path / "report").iterdir())


def test_manifold_inrun_refuses_data_it_cannot_load_before_any_output(tmp_path, monkeypatch, capsys, script_settings):
    # a missing or wrong data file had printed the table's header, then a DataRefusal traceback
    # from the first run's train(), never naming --data
    from bench import manifold_inrun
    from geomuon.pretrain.data import spec_source

    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not the corpus\n")
    monkeypatch.setattr(manifold_inrun, "certified_run", start_work)
    for spec, reason in ((f"shakespeare:{tmp_path / 'missing.txt'}", "does not exist"),
                         (f"shakespeare:{wrong}", "differs from the expected"),
                         (f"tokens:{tmp_path / 'no_shards'}", "does not exist")):
        with pytest.raises(SystemExit) as stopped:
            manifold_inrun.main(["--quick", "--manifold", "stiefel", "--data", spec])
        printed = capsys.readouterr()
        assert stopped.value.code == 2 and printed.out == "", spec
        assert f"--data {spec}: " in printed.err and reason in printed.err, (spec, printed.err)
    # control: data that loads reaches the runs, read once and handed to them with its spec
    with pytest.raises(Started) as started:
        manifold_inrun.main(["--quick", "--manifold", "stiefel", "--data", "embedded"])
    *_, spec, seed, tokens = started.value.args[0]
    assert spec == "embedded" and tokens.source == spec_source("embedded")


def test_repeated_list_values_are_refused(monkeypatch, capsys, script_settings):
    # a value given twice had measured its rows (or its world size) twice
    from bench import distributed_step, manifold_frontier, manifold_inrun, optimizer_step

    monkeypatch.setattr(manifold_frontier, "run_config", start_work)
    monkeypatch.setattr(manifold_inrun, "certified_run", start_work)
    monkeypatch.setattr(distributed_step, "measure", start_work)
    monkeypatch.setattr(optimizer_step, "build", start_work)
    cases = [(manifold_frontier, ["--manifold", "stiefel", "stiefel"], "--manifold lists stiefel more than once; give each once"),
             (manifold_frontier, ["--dual", "1", "2", "1"], "--dual lists 1 more than once; give each once"),
             (manifold_inrun, ["--manifold", "dgram", "dgram"], "--manifold lists dgram more than once; give each once"),
             (manifold_inrun, ["--alpha", "1.5", "1.50"], "--alpha lists 1.5 more than once; give each once"),  # equal as numbers
             (distributed_step, ["--worlds", "1,2,2"], "--worlds lists 2 more than once; give each once"),
             (optimizer_step, ["--solver", "dual", "dual"], "--solver lists dual more than once; give each once"),
             # a second --manifold had replaced the first one's list: dgram silently dropped
             (manifold_frontier, ["--manifold", "stiefel", "dgram", "--manifold", "stiefel"],
              "--manifold is given twice; list all its values after one --manifold")]
    for script, argv, message in cases:
        stderr = refused_in_process(script.main, capsys, "--quick", *argv)
        assert message in stderr, argv
    # controls: each value once passes
    for script, argv in ((manifold_frontier, ["--manifold", "stiefel", "dgram"]),
                         (manifold_inrun, ["--manifold", "stiefel", "dgram", "--alpha", "1.5", "1.25"]),
                         (distributed_step, ["--worlds", "1,2"]), (optimizer_step, ["--solver", "dual", "projected"])):
        with pytest.raises(Started):
            script.main(["--quick", *argv])


def test_symbolic_mutations_only_ignores_empty_entries_and_list_takes_no_markdown(tmp_path, capsys):
    # --only "dgram," had chosen the whole catalogue ("" is in every label), and --only "," run it
    # all; --list --markdown PATH had exited 0 with nothing written
    from bench import symbolic_mutations

    def listed(only: str) -> list[str]:
        assert symbolic_mutations.main(["--list", "--only", only]) == 0
        return capsys.readouterr().out.splitlines()

    dgram = listed("dgram")
    assert 0 < len(dgram) < len(symbolic_mutations.MUTATIONS)
    assert listed("dgram,") == listed(",dgram, ") == dgram  # (a space in an entry is text to match, as in labels)
    assert len(listed("dgram,stiefel")) > len(dgram)  # control: a second entry still counts
    for only in (",", "", " , "):
        assert f"--only {only!r} names no label text" in refused_in_process(symbolic_mutations.main, capsys,
                                                                            "--list", "--only", only)
    markdown = tmp_path / "catalogue.md"
    stderr = refused_in_process(symbolic_mutations.main, capsys, "--list", "--markdown", str(markdown))
    assert "--list prints the catalogue and runs nothing, so --markdown would have no table" in stderr
    assert not markdown.exists()


def test_the_header_records_the_thread_settings_the_script_was_launched_with(tmp_path, monkeypatch, script_settings):
    # equivariance_checker sets OMP_NUM_THREADS for its CLI runs when unset, and the header (read at
    # the end) had recorded it as the user's setting; the caption now says what the checks ran under
    from bench import equivariance_checker

    monkeypatch.setattr(equivariance_checker, "measure", lambda size, seed, clock: (
        [], {"api": ["ok"], "cli": ["ok"]}, {"api": [0.5], "cli": [0.5]}))
    monkeypatch.setattr(equivariance_checker, "cli_process_time", lambda repeats: (1.0, 1.0))

    def written(name: str) -> tuple[str, str]:
        markdown = tmp_path / name
        assert equivariance_checker.main(["--quick", "--markdown", str(markdown)]) == 0
        text = markdown.read_text()
        return re.search(r"^\| environment \| (.*) \|$", text, re.MULTILINE).group(1), text

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    environment, text = written("unset.md")
    assert "OMP_NUM_THREADS" not in environment and "under OMP_NUM_THREADS=1, import included" in text
    # control: a setting the run was launched with is recorded, and is the one the timed CLI process
    # ran under; the in-process checks ran on --threads torch threads whatever it is (the CLI in-process
    # sets its own only where OMP_NUM_THREADS is unset)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    environment, text = written("set.md")
    assert "OMP_NUM_THREADS=3" in environment and "under OMP_NUM_THREADS=3, import included" in text
    assert "and the API, on 1 torch thread(s)." in text
