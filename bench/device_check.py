r"""The one prepared check for a session that draws an accelerator: host syncs, step time, a pretraining smoke.

A session lent a GPU has minutes of it, so everything a GPU must confirm runs in one call
(``python bench/device_check.py --device cuda --out DIR``, a few minutes on an H200) and
writes one report, ``DIR/device_check.md``:

1. **Host reads per step.** The optimizers on one GPT-2-small block (d = 768) after two
   warm-up steps: the host reads of one whole ``step()`` and of its per-batch matrix work
   (``_matrix_step``: momentum, direction, retraction) — on CUDA every synchronizing call
   (``torch.cuda.set_sync_debug_mode("warn")``), on the CPU every read of a tensor's value
   into Python (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``), the
   tests' stand-in. The matrix work must read nothing (the tests hold the CPU path to it);
   the whole step's count (the matrix work's included) shows whether anything around it does
   (0 on the CPU).
2. **Step time**: :mod:`bench.optimizer_step` on the same device, on the default set and on
   one GPT-2-small block, with the device's bf16/fp32 rate in the header
   (``DIR/optimizer_step*.md``).
3. **Pretraining smoke**: ``geomuon pretrain`` for a few steps of unconstrained Muon and of
   hetero Manifold Muon on the device; the train loss must fall and stay finite.

``--quick`` shrinks every part to seconds (the test suite runs it on the CPU). The script
exits 1 when one of the report's "must" lines fails, and refuses an ``--out`` folder that
already holds files (a second run had replaced the first report).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from geomuon.pretrain.train import read_log

if __package__ in (None, ""):  # run as `python bench/device_check.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import optimizer_step  # noqa: E402
from bench.timing import check_output_folder, device_option, markdown_table, refuse_passive_wait  # noqa: E402

#: Tensor methods that read a value back to Python (each a device sync on CUDA).
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def counting_host_reads(device: str, counter: list[int]):
    """Count into ``counter[0]`` every host sync (CUDA) or host read of a tensor (CPU) in the block;
    nested, an enclosing count counts them too (on CUDA the block's warnings are issued again once
    counted: recorded here, an enclosing block's record had never seen them)."""
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        counter[0] += sum("synchroniz" in str(w.message) for w in caught)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name):
        def read(self, *args, **kwargs):
            counter[0] += 1
            return saved[name](self, *args, **kwargs)
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counted(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def host_reads(device: str, shapes: list[tuple[int, int]]) -> list[list[str]]:
    """Rows ``[optimizer, reads per step(), reads in the matrix work]`` after two warm-up steps."""
    optimizers, grads = optimizer_step.build(shapes, seed=0, device=device, solvers=("dual", "projected"))
    rows = []
    for name in ("Muon (ours)", "ManifoldMuon Stiefel", "ManifoldMuon DGram", "ManifoldMuon Stiefel, projected",
                 "ManifoldMuon DGram, projected"):
        opt = optimizers[name]
        params = [p for group in opt.param_groups for p in group["params"]]
        whole, inner = [0], [0]
        matrix_step = opt._matrix_step

        def counted_matrix_step(*args, **kwargs):
            with counting_host_reads(device, inner):
                return matrix_step(*args, **kwargs)

        for step in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if step < 2:  # warm-up: the first step checks every weight is on its manifold
                opt.step()
                continue
            opt._matrix_step = counted_matrix_step
            with counting_host_reads(device, whole):
                opt.step()
            del opt._matrix_step
        rows.append([name, str(whole[0]), str(inner[0])])
    return rows


def device_for_pretrain(device: str) -> tuple[str, dict[str, str]]:
    """``geomuon pretrain``'s ``--device`` for ``device`` and its process environment: it takes a
    device type (a CUDA run uses its first visible GPU), so ``cuda:N`` becomes ``cuda`` with
    ``CUDA_VISIBLE_DEVICES`` naming GPU N (the N-th of those it lists, when it is set)."""
    chosen, env = torch.device(device), dict(os.environ)
    if chosen.type == "cuda" and chosen.index is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        listed = [entry.strip() for entry in visible.split(",")] if visible is not None else None
        if listed is not None and (chosen.index >= len(listed) or not listed[chosen.index]):
            raise ValueError(f"--device {device}: CUDA_VISIBLE_DEVICES={visible!r} lists no GPU {chosen.index}; "
                             "choose one it lists, or unset it")
        env["CUDA_VISIBLE_DEVICES"] = listed[chosen.index] if listed is not None else str(chosen.index)
    return chosen.type, env


def pretrain_smoke(device: str, out: Path, quick: bool) -> list[list[str]]:
    """Rows ``[strategy, steps, first train loss, last, finite and lower]`` of short ``geomuon pretrain`` runs."""
    config, steps = ("cpu-tiny", 6) if quick else ("gpt2-small", 40)
    kind, env = device_for_pretrain(device)
    rows = []
    for strategy in ("unconstrained", "hetero"):
        folder = out / f"pretrain-{strategy}"
        command = [sys.executable, "-m", "geomuon", "pretrain", "--config", config, "--strategy", strategy,
                   "--steps", str(steps), "--warmup-steps", str(steps // 4), "--device", kind, "--out-dir",
                   str(folder), "--eval-every", str(steps), "--no-progress", "--no-compile", "--log-every", "1"]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            rows.append([strategy, "-", "-", "-", f"failed: {result.stderr.strip().splitlines()[-1:]}"])
            continue
        # read_log: a "NaN" loss is spelled as a string in the log, and read back as a float there
        losses = [r["loss"] for r in read_log(str(folder / "log.jsonl")) if r.get("kind") == "train" and "loss" in r]
        ok = all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]
        rows.append([strategy, str(len(losses)), f"{losses[0]:.4f}", f"{losses[-1]:.4f}", "yes" if ok else "NO"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_option, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default cuda where there is one)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the report (created; must be new or empty)")
    parser.add_argument("--quick", action="store_true", help="seconds-long sizes: checks the script, not a result")
    args = parser.parse_args(argv)
    if not args.quick:  # its step times are a result (bench/optimizer_step.py would refuse them mid-report)
        refuse_passive_wait(parser)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        # a second run into the same folder had replaced the first report, and its smoke runs
        # failed on their own earlier run folders
        parser.error(f"--out {args.out} is a file or already holds files (an earlier report?); give a new folder")
    check_output_folder(parser, "--out", args.out)  # (an unwritable one had been a traceback)
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [(64, 64), (256, 64), (64, 256)] if args.quick else optimizer_step.gpt2_small_shapes()
    reads = host_reads(args.device, shapes)
    sections = [f"# Device check on {args.device}",
                "## Host reads per step\n\n" + markdown_table(
                    ["optimizer", "whole step()", "matrix work (must be 0)"], reads)]
    timing = ["--quick"] if args.quick else ["--repeats", "5"]
    sets = [("optimizer_step", [])] + ([] if args.quick else [("optimizer_step_gpt2_small", ["--set", "gpt2-small"])])
    for name, extra in sets:
        path = args.out / f"{name}_{args.device.replace(':', '')}.md"
        optimizer_step.main([*timing, *extra, "--device", args.device, "--markdown", str(path)])
        sections.append(f"## Step time ({' '.join(extra) or 'default set'})\n\n" + path.read_text())
    smoke = pretrain_smoke(args.device, args.out, args.quick)
    sections.append("## Pretraining smoke\n\n" + markdown_table(
        ["strategy", "steps logged", "first loss", "last loss", "finite and lower"], smoke))
    report = args.out / "device_check.md"
    report.write_text("\n\n".join(sections) + "\n")
    print(report.read_text())
    # the report's "must" lines: matrix work without host reads, smoke runs finite and lower
    failed = [row[0] for row in reads if row[2] != "0"] + [row[0] for row in smoke if row[4] != "yes"]
    if failed:
        print(f"device check FAILED for: {', '.join(failed)} (see {report})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
