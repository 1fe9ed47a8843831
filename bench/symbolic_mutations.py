r"""Mutation testing of the symbolic certificates: does ``tests/test_symbolic.py`` notice?

Each mutation breaks one formula of the library's own code (a projection, an adjoint, a
retraction, an update map, a coefficient table, a constant) in a fresh copy of the
repository's tracked files; ``pytest tests/test_symbolic.py`` run alone in that copy must
**fail** (the mutant is *killed*). The unmutated copy must pass first, or nothing is
counted. The copy imports its own files: the editable install's path map is pointed at
the copy before pytest starts.

Usage (from the repository root; one copy at a time, a few minutes per mutant on a busy
machine)::

    python bench/symbolic_mutations.py                 # every mutation
    python bench/symbolic_mutations.py --only dgram    # labels containing "dgram"
    python bench/symbolic_mutations.py --list          # the catalogue, run nothing
    python bench/symbolic_mutations.py --range 28:     # the second half (split a run)
    python bench/symbolic_mutations.py --markdown docs/results/benchmarks/symbolic_mutations.md --overwrite

Exit status 0 when the unmutated copy passes and every mutation is killed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from geomuon.pretrain.provenance import git_commit, markdown_table

if __package__ in (None, ""):  # run as `python bench/symbolic_mutations.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import check_output_file, positive_seconds  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """Replace the one occurrence of ``old`` in ``path`` by ``new``."""

    label: str
    path: str
    old: str
    new: str


#: The catalogue: formulas the certificates claim to pin. One mutation a line,
#: ``label | old | new`` (``\\n`` a newline), under the ``## path`` of the file it edits.
_CATALOGUE = r"""
## manifolds/stiefel.py
stiefel constraint drops u'x | return x.mT @ u + u.mT @ x | return x.mT @ u
stiefel adjoint loses its factor 2 | return 2 * x @ sym(lam) | return x @ sym(lam)
stiefel projection drops sym | return u - x @ sym(x.mT @ u) | return u - x @ (x.mT @ u)
stiefel gram diagonal 4 -> 2 | n, n), 4.0, | n, n), 2.0,
stiefel defining map W'W - 2I | return x.mT @ x - eye | return x.mT @ x - 2 * eye
stiefel retraction steps along -u | return msign(x.to(compute) + u.to(compute) | return msign(x.to(compute) - u.to(compute)
stiefel retraction with Keller's quintic | u.to(compute), "polar_express" | u.to(compute), "newton_schulz"
stiefel constraint's sign flipped | return x.mT @ u + u.mT @ x | return x.mT @ u - u.mT @ x
stiefel projection adds W sym(W'X) | return u - x @ sym(x.mT @ u) | return u + x @ sym(x.mT @ u)
stiefel wide points not transposed | transposes_wide = True | transposes_wide = False
## manifolds/dgram.py
dgram adjoint keeps the diagonal | return 2 * x @ off_diagonal(sym(lam)) | return 2 * x @ sym(lam)
dgram projection divides by 2 d_i^2 | denominator = d2.unsqueeze(-1) + d2.unsqueeze(-2) | denominator = 2 * d2.unsqueeze(-1)
dgram gram diagonal doubled | return 2 * (d2.unsqueeze(-1) + d2.unsqueeze(-2)) | return 4 * (d2.unsqueeze(-1) + d2.unsqueeze(-2))
dgram retraction forgets the column norms' root | norms = d2.sqrt().unsqueeze(-2) * largest | norms = d2.unsqueeze(-2) * largest
dgram retraction steps along -u | y = x.to(compute) + u.to(compute) | y = x.to(compute) - u.to(compute)
dgram retraction rescales by the point's column norms | d2 = self._squared_column_norms(y / largest) | d2 = self._squared_column_norms(x.to(compute) / largest)
dgram retraction skips the columns' normalization | polar = msign(y / norms, "polar_express") | polar = msign(y, "polar_express")
dgram constraint's sign flipped | return off_diagonal(x.mT @ u + u.mT @ x) | return off_diagonal(x.mT @ u - u.mT @ x)
dgram defining map keeps the diagonal | return off_diagonal(x.mT @ x) | return x.mT @ x
dgram projection adds W Sigma | return u - x @ sigma | return u + x @ sigma
dgram column norms summed over columns | return x.square().sum(-2) | return x.square().sum(-1)
dgram projx forgets the column norms' root | return ((U @ Vh) * (d2.sqrt().unsqueeze(-2) * largest)) | return ((U @ Vh) * (d2.unsqueeze(-2) * largest))
dgram wide points not transposed | transposes_wide = True | transposes_wide = False
## manifolds/oblique.py
sphere constraint doubled | return (x * u).sum(dim) | return 2 * (x * u).sum(dim)
sphere adjoint doubled | return x * lam.unsqueeze(dim) | return 2 * x * lam.unsqueeze(dim)
sphere projection halved | return u - x * ((x * u) | return u - 0.5 * x * ((x * u)
sphere defining map loses 1/2 | return 0.5 * (x.square().sum(dim) - radius**2) | return (x.square().sum(dim) - radius**2)
sphere gram diagonal doubled | return x.square().sum(dim) | return 2 * x.square().sum(dim)
sphere retraction divides by the squared norm | (y * (radius / norms)) | (y * (radius / norms**2))
sphere retraction steps along -u | y = y + step.to(y.dtype) | y = y - step.to(y.dtype)
oblique projection on rows | return sphere_proju(x, u, -2) | return sphere_proju(x, u, -1)
oblique projx normalizes rows | return sphere_normalize(x, 1.0, -2, "Oblique.projx") | return sphere_normalize(x, 1.0, -1, "Oblique.projx")
oblique retraction normalizes rows | return sphere_normalize(x, 1.0, -2, "Oblique.retr", step=u) | return sphere_normalize(x, 1.0, -1, "Oblique.retr", step=u)
## manifolds/lpro.py
lpro constrains columns | return sphere_constraint(x, u, -1) | return sphere_constraint(x, u, -2)
lpro projection on columns | return sphere_proju(x, u, -1) | return sphere_proju(x, u, -2)
lpro defining map at radius 1 | return sphere_defining_map(x, self.radius, -1) | return sphere_defining_map(x, 1.0, -1)
lpro retraction to radius 1 | sphere_normalize(x, self.radius, -1, "LPRO.retr", step=u) | sphere_normalize(x, 1.0, -1, "LPRO.retr", step=u)
lpro projx to radius 1 | sphere_normalize(x, self.radius, -1, "LPRO.projx") | sphere_normalize(x, 1.0, -1, "LPRO.projx")
lpro without radius steps along -u | return x + u | return x - u
## manifolds/router.py
router constraint doubled | return broadcast_pair(x, u)[1].sum(-2) | return 2 * broadcast_pair(x, u)[1].sum(-2)
router projection does not center | return _centered(broadcast_pair(x, u)[1]) | return broadcast_pair(x, u)[1]
router gram diagonal uses n | x.size(-1)), x.size(-2)) | x.size(-1)), x.size(-1))
router retraction steps along -u | _centered(x.to(compute) + u.to(compute)) | _centered(x.to(compute) - u.to(compute))
router adjoint doubled | return lam.unsqueeze(-2).expand(*batch, *x.shape[-2:]) | return 2 * lam.unsqueeze(-2).expand(*batch, *x.shape[-2:])
router defining map is the column mean | return x.sum(-2) | return x.mean(-2)
router centering subtracts row means | return x - x.mean(-2, keepdim=True) | return x - x.mean(-1, keepdim=True)
router projx does not center | return _centered(x.double()).to(x.dtype) | return x.double().to(x.dtype)
## manifolds/euclidean.py
euclidean retraction steps along -u | return x + u | return x - u
euclidean projection is zero | return broadcast_pair(x, u)[1] | return 0 * broadcast_pair(x, u)[1]
## manifolds/base.py
matrix_method does not transpose wide results back | return out.mT if result == "matrix" else out | return out
## manifolds/linalg.py
off_diagonal keeps the diagonal | return S - torch.diag_embed(torch.diagonal(S, dim1=-2, dim2=-1)) | return S
off_diagonal of a tensor keeps the diagonal | out.diagonal(dim1=-2, dim2=-1).zero_() | out.diagonal(dim1=-2, dim2=-1)
msign forgets the input scale | clamp_min(floor) * schedule.input_scale | clamp_min(floor)
sym loses 1/2 | return 0.5 * (X + X.mT) | return (X + X.mT)
newton-schulz step swaps b and c | polynomial = fma(S, S, S, beta=b, alpha=c) | polynomial = fma(S, S, S, beta=c, alpha=b)
keller quintic a 3.4445 -> 3.4446 | ((3.4445, -4.7750, 2.0315),) | ((3.4446, -4.7750, 2.0315),)
polar express row 2 truncated to 9 digits | (3.9486908534822946, | (3.94869085,
polar express row 5 c perturbed | 0.37680408948524835) | 0.3768040894)
polar express safety 1.01 -> 1.02 (table) |         1.01,\n    ),\n    1.01, |         1.02,\n    ),\n    1.01,
polar express last row c 3/8 -> 0.376 | (1.875, -1.25, 0.375), | (1.875, -1.25, 0.376),
polar express 5 first a truncated | (8.156554524902461, | (8.1565545,
coupled inverse-sqrt step 3 -> 3.001 | T = 0.5 * (3.0 * eye - Z @ Y) | T = 0.5 * (3.001 * eye - Z @ Y)
coupled inverse-sqrt step 1/2 -> 0.49 | T = 0.5 * (3.0 * eye - Z @ Y) | T = 0.49 * (3.0 * eye - Z @ Y)
inverse sqrt default 25 -> 20 steps | A: torch.Tensor, steps: int = 25, | A: torch.Tensor, steps: int = 20,
inverse sqrt forgets the scale's root | return (Z / (scale.sqrt() * magnitude.sqrt())).to(out_dtype) | return (Z / (scale * magnitude.sqrt())).to(out_dtype)
sym is the skew part | return 0.5 * (X + X.mT) | return 0.5 * (X - X.mT)
safety factor on b squared (not cubed) | (a / safety, b / safety**3, c / safety**5) | (a / safety, b / safety**2, c / safety**5)
newton-schulz step halves a | fma(Y, *factors, beta=a) if out is None | fma(Y, *factors, beta=0.5 * a) if out is None
newton-schulz tall step multiplies on the wrong side | factors = (Y, polynomial) if tall else | factors = (polynomial, Y) if tall else
newton-schulz tall step's gram on the long side | left, right = (Y.mT, Y) if tall else | left, right = (Y, Y.mT) if tall else
inverse sqrt starts at Z = 2I | Z = eye.expand_as(A).clone() | Z = 2 * eye.expand_as(A).clone()
rms scale inverted | return math.sqrt(fan_in / fan_out) | return math.sqrt(fan_out / fan_in)
nuclear norm from msign'msign | return (X * msign(X, method=method)).sum(dim=(-2, -1)) | return (msign(X, method=method) * msign(X, method=method)).sum(dim=(-2, -1))
## manifolds/capabilities.py
inverse-sqrt series c2 0.375 -> 0.376 | (1.0, -0.5, 0.375, | (1.0, -0.5, 0.376,
stiefel gram projection divides by d_i^2 alone (twice sym at D = I) | return (M + M.mT) / (d2.unsqueeze(-1) + d2.unsqueeze(-2)) | return (M + M.mT) / d2.unsqueeze(-1)
dgram gram retraction factor inverted | * (root.unsqueeze(-2) / root.unsqueeze(-1)) | * (root.unsqueeze(-1) / root.unsqueeze(-2))
oblique gram retraction sqrt instead of rsqrt | torch.diag_embed(_diag(YtY).rsqrt()) | torch.diag_embed(_diag(YtY).sqrt())
inverse-sqrt series c5 -0.24609375 -> -0.2460937 | -0.24609375, | -0.2460937,
series radius with |c_K| (K + 3/2)/(K + 1) | (terms + 0.5) / (terms + 1) | (terms + 1.5) / (terms + 1)
stiefel gram newton increment E (not E/2) | return 0.5 * E | return E
dgram gram constraint keeps the diagonal | return off_diagonal(M + M.mT)\n | return M + M.mT\n
dgram gram adjoint keeps the diagonal | return off_diagonal(lam + lam.mT) | return lam + lam.mT
engine: Lyapunov operator X + X (not X + X') | return X + X.mT | return X + X
engine: Newton diagonal d_i^2 P_ii + P_jj d_j^2 | return 2 * (d2.unsqueeze(-1) * p.unsqueeze(-2) + p.unsqueeze(-1) * d2.unsqueeze(-2)) | return 2 * (d2.unsqueeze(-1) * p.unsqueeze(-1) + p.unsqueeze(-2) * d2.unsqueeze(-2))
engine: DGram Newton operator keeps the diagonal | return off_diagonal(_lyapunov(D, self.adjoint(lam), P)) | return _lyapunov(D, self.adjoint(lam), P)
engine: Lyapunov operator without D | X = (_diag(D).unsqueeze(-1) * S) @ P | X = S @ P
## optimizers/maps.py
row_norm normalizes columns | return _normalized(D, -1, eps) | return _normalized(D, -2, eps)
col_norm normalizes rows | return _normalized(D, -2, eps) | return _normalized(D, -1, eps)
polar maps: nuclear norm squared | scale = nuclear.clamp_min(0).pow(alpha) | scale = nuclear.clamp_min(0).pow(2 * alpha)
polar maps: nuclear norm from polar'polar | nuclear = _float64(s) * _float64((X * polar).sum | nuclear = _float64(s) * _float64((polar * polar).sum
polar maps: msign of |D| | polar = msign(X, "polar_express" | polar = msign(X.abs(), "polar_express"
hybrid normalizes columns | R = row_norm(D, eps=eps) | R = col_norm(D, eps=eps)
centered map does not re-center | return _center_rows(update(_center_rows(D), **kwargs)) | return update(_center_rows(D), **kwargs)
centered map does not center its input | return _center_rows(update(_center_rows(D), **kwargs)) | return _center_rows(update(D, **kwargs))
centering subtracts row means | return D - D.mean(dim=-2, keepdim=True) | return D - D.mean(dim=-1, keepdim=True)
row and col norms divide by the squared norm | return D / (D.norm(dim=dim, keepdim=True) + eps) | return D / (D.norm(dim=dim, keepdim=True) + eps) ** 2
sign map doubled | return torch.sign(D) | return 2 * torch.sign(D)
spectral map with Keller's quintic | D: torch.Tensor,\n    *,\n    method: str = "polar_express", | D: torch.Tensor,\n    *,\n    method: str = "newton_schulz",
hybrid nuclear norm from msign'msign | Q * _nuclear_power(_float64((R * Q).sum | Q * _nuclear_power(_float64((Q * Q).sum
## optimizers/gram.py
gram retract steps along +T1 | N1 = _axpy(eye, T1, -lr) | N1 = _axpy(eye, T1, lr)
gram retract drops the tangent part's sign | Z0, T2, -lr) | Z0, T2, lr)
gram dual Gram forgets S'F's transpose | return K + SF + SF.mT | return K + 2 * SF
gram dual Gram drops DS's 1/2 | torch.add(B0, DS, alpha=0.5) | torch.add(B0, DS, alpha=1.0)
engine: polish drops the tangent projection | x1, x2 = z1 - form.project(mulD.D, mulD(z1) + B0 @ z2), z2 | x1, x2 = z1, z2
engine: polish projects with W'(W T1) only | mulD(z1) + B0 @ z2) | mulD(z1))
engine: polish clips T1 only | z1, z2 = y1 @ clip, y2 @ clip | z1, z2 = y1 @ clip, y2
engine: polish's Gram cross term untransposed | cross + cross.mT | 2 * cross
engine: ADMM polish drops the momentum's term | b + start | b
engine: ADMM polish never updates its multiplier | u1, u2 = y1 - z1, y2 - z2 | u1, u2 = u1, u2
engine: ADMM polish starts its multiplier at Z0 alone | u1, u2 = S * inverse, start | u1, u2 = 0 * S, start
engine: ADMM penalty from Z0 instead of the dual iterate | _trace(Q).clamp_min(0).sqrt() * keep | _trace(K).clamp_min(0).sqrt() * keep
engine: polish clips at spectral norm 2 | lam.clamp_min(1.0).rsqrt() | lam.clamp_min(4.0).rsqrt()
engine: CG residual update sign | R = R - a * A_step | R = R + a * A_step
engine: CG without conjugation (steepest descent) | step = Y + (ry / previous.clamp_min(tiny)) * step | step = Y
engine: CG step length halved | a = ry / (step * A_step) | a = 0.5 * ry / (step * A_step)
engine: Newton closed form divides by f_i f_j | (f.unsqueeze(-1) + f.unsqueeze(-2)) | (f.unsqueeze(-1) * f.unsqueeze(-2))
engine: Newton closed form in the wrong basis | Ht = (Vl.mT @ form.constraint(M).to(low) @ Vl) | Ht = (Vl @ form.constraint(M).to(low) @ Vl.mT)
engine: Newton CG step along +H | return (-alpha) * newton_cg( | return alpha * newton_cg(
engine: Jacobi sigma over |A|_F (not |A|_F^2) | sigma = dual.value / dual.frobenius2.clamp_min(tiny) | sigma = dual.value / dual.frobenius2.clamp_min(tiny).sqrt()
engine: Jacobi divides by the root of diag(LL*) | H / diag.clamp_min(tiny) | H / diag.clamp_min(tiny).sqrt()
engine: dualizer value tr(PQP) for tr(QP) | value=(lam * f).sum(-1) | value=(lam * f * f).sum(-1)
## theory/lipschitz.py
residual rule drops a | return (1.0 - a) + (a * inner if a else 0.0) | return (1.0 - a) + (inner if a else 0.0)
GELU constant: e^-1 -> e^-1/2 | GELU_LIPSCHITZ = 0.5 * (1.0 + math.erf(1.0)) + math.exp(-1.0) / math.sqrt(math.pi) | GELU_LIPSCHITZ = 0.5 * (1.0 + math.erf(1.0)) + math.exp(-0.5) / math.sqrt(math.pi)
## optimizers/muon.py
shape factor n/m (not m/n) | return math.sqrt(max(1.0, rows / cols)) | return math.sqrt(max(1.0, cols / rows))
## optimizers/regulate.py
soft-cap threshold 62/81 -> 61/81 | SOFT_CAP_MIN_RATIO = 62.0 / 81.0 | SOFT_CAP_MIN_RATIO = 61.0 / 81.0
soft-cap root h(beta) with -2 beta^2 | return 1.0 - 3.0 * beta**2 + 3.0 * beta**3 - beta**4 | return 1.0 - 2.0 * beta**2 + 3.0 * beta**3 - beta**4
soft-cap polynomial g - alpha g^3 |     return g + alpha * g**3 |     return g - alpha * g**3
eta from the grid maximum, not the enclosure | return math.nextafter(float(high), math.inf) | return float(high) * (1 - 1e-6)
muon update norm without adjust_lr inverts the shape factor | shape_factor = math.sqrt(fan_out / fan_in) | shape_factor = math.sqrt(fan_in / fan_out)
soft-cap inner cubic g = sigma + alpha sigma^3 | g = sigma - alpha * sigma**3 | g = sigma + alpha * sigma**3
"""


def _parse(catalogue: str) -> tuple[Mutation, ...]:
    out, path = [], None
    for line in filter(None, catalogue.splitlines()):
        if line.startswith("## "):
            path = line[3:]
            continue
        label, old, new = line.split(" | ")
        out.append(Mutation(label, path, old.replace("\\n", "\n"), new.replace("\\n", "\n")))
    return tuple(out)


MUTATIONS: tuple[Mutation, ...] = _parse(_CATALOGUE)


def _copy_tree(destination: Path) -> None:
    """The repository's tracked files (as they are in the working tree) into ``destination``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        source = REPO / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


#: Points the editable install's path map (``geomuon.* -> /work/...``) at the copy, then
#: runs pytest there; argv: copy root, pytest arguments.
_BOOTSTRAP = """
import sys
import __editable___geomuon_0_1_0_finder as finder
root = sys.argv[1]
installed = finder.MAPPING["geomuon"].rsplit("/", 1)[0]
for name, path in list(finder.MAPPING.items()):
    finder.MAPPING[name] = path.replace(installed, root, 1)
import geomuon.manifolds.stiefel, geomuon.theory.symbolic
for module in (geomuon.manifolds.stiefel, geomuon.theory.symbolic):
    if not module.__file__.startswith(root):
        sys.exit(f"the copy is not what is imported: {module.__name__} from {module.__file__}")
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def _run_suite(root: Path, timeout: float) -> tuple[int, float, str]:
    start = time.perf_counter()
    command = [sys.executable, "-c", _BOOTSTRAP, str(root), "-q", "-x", "-p", "no:cacheprovider", "tests/test_symbolic.py"]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout)
        code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        code, tail = -1, ["timeout"]
    return code, time.perf_counter() - start, " ".join(tail)


def _check_pattern(root: Path, mutation: Mutation) -> str:
    text = (root / mutation.path).read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.label!r}: {mutation.path} holds {count} copies of the pattern "
                         "(need exactly 1); update the catalogue")
    return text


def _apply(root: Path, mutation: Mutation) -> None:
    text = _check_pattern(root, mutation)
    (root / mutation.path).write_text(text.replace(mutation.old, mutation.new))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="run the mutations whose label contains this text (comma-separated: any of them)")
    parser.add_argument("--range", default=":", help="a slice START:STOP of the catalogue (default all), to split a run")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--timeout", type=positive_seconds, default=900.0, help="seconds per suite run (default 900)")
    parser.add_argument("--markdown", type=Path, help="also write the result table to this file")
    parser.add_argument("--overwrite", action="store_true", help="let --markdown replace an existing file")
    args = parser.parse_args(argv)
    if args.list and args.markdown is not None:  # (--list had ignored it: exit 0, nothing written)
        parser.error("--list prints the catalogue and runs nothing, so --markdown would have no table; drop one")
    match = re.fullmatch(r"(-?\d*):(-?\d*)", args.range.strip())
    if match is None:
        parser.error(f"--range must be START:STOP (either may be empty, e.g. 0:40 or 40:), got {args.range!r}")
    start, stop = (int(bound) if bound else None for bound in match.groups())
    # blank entries are dropped: "" is in every label ("dgram," had chosen the whole catalogue)
    wanted = None if args.only is None else [part for part in args.only.split(",") if part.strip()]
    if wanted == []:
        parser.error(f"--only {args.only!r} names no label text; give comma-separated parts of labels (--list "
                     "prints the catalogue), or leave --only out for all")
    chosen = [m for m in MUTATIONS[start:stop] if wanted is None or any(part in m.label for part in wanted)]
    if not chosen:
        labels = "" if wanted is None else f" has a label containing any of {wanted}"
        parser.error(f"no mutation in --range {args.range}{labels} (--list prints the catalogue)")
    check_output_file(parser, "--markdown", args.markdown, args.overwrite)  # before hours of suite runs
    if args.list:
        for m in chosen:
            print(f"{m.label:55s} {m.path}")
        return 0
    commit, started = git_commit(), datetime.datetime.now(datetime.timezone.utc)  # the code being mutated
    with tempfile.TemporaryDirectory(prefix="geomuon-mutants-") as scratch:
        pristine = Path(scratch) / "pristine"
        _copy_tree(pristine)
        for m in chosen:  # every pattern must be found before anything runs
            _check_pattern(pristine, m)
        code, seconds, tail = _run_suite(pristine, args.timeout)
        print(f"unmutated copy: exit {code} in {seconds:.0f} s ({tail})", flush=True)
        if code != 0:
            return 1
        rows = []
        for m in chosen:
            copy = Path(scratch) / "mutant"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(pristine, copy)
            _apply(copy, m)
            code, seconds, tail = _run_suite(copy, args.timeout)
            verdict = "killed" if code not in (0, -1) else ("TIMEOUT" if code == -1 else "SURVIVED")
            rows.append((m, verdict, seconds, tail))
            print(f"{verdict:8s} {seconds:6.0f} s  {m.label}  [{tail}]", flush=True)
    killed = sum(v == "killed" for _, v, _, _ in rows)
    print(f"\n{killed}/{len(rows)} mutations killed by tests/test_symbolic.py")
    if args.markdown:
        provenance = markdown_table(["run", ""], [
            ["command", "`" + " ".join(["python", "bench/symbolic_mutations.py", *map(shlex.quote, argv or sys.argv[1:])]) + "`"],
            ["commit", f"`{commit}`"],
            ["date (UTC), duration", f"{started:%Y-%m-%d %H:%M}, {time.time() - started.timestamp():.0f} s"]])
        table = markdown_table(["mutation", "file", "verdict", "seconds"],
                               [[m.label, f"`{m.path}`", v, f"{s:.0f}"] for m, v, s, _ in rows])
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"{provenance}\n\n**{killed}/{len(rows)}** mutations of the library's code make "
                                 "`pytest tests/test_symbolic.py` fail (the unmutated copy passes).\n\n" + table + "\n")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
