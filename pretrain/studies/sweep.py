r"""Learning-rate sweeps: every arm of a study at its own best learning rate.

A comparison of optimizers is fair only when each arm runs at its own tuned rate, so a
sweep study (``geomuon study manifolds-sweep``, ``geomuon study symmetry-sweep``) trains
every arm (variant) of its base study on a log grid around the arm's default rate and
reports the curve, its minimum, and the comparisons at the minima.

**The grid.** An arm's swept rate is the matrix learning rate ``lr``, or ``adamw_lr`` for an
arm whose strategy is AdamW on every parameter; its default $\eta_0$ is the arm's own
override or the size's value. The grid is $\eta_k = \eta_0 \cdot f^{k}$ for
$k = -h, \dots, h$ (:class:`Grid`: $f = 2$, $2h + 1 = 5$ points), each point trained with
two seeds. The **best point** is the one with the lowest mean final validation loss over
those seeds (a point with a diverged or non-finite run ranks last). A best point on the
grid's edge extends the grid by one point beyond it, and the search repeats, up to
``max_extensions`` new points per arm (a best point still on the edge then is reported as
such). Finally the best point gets a third seed, and the arms are compared there on three
seeds.

**Stages and resuming.** The sweep runs in stages (the grid, each extension, the third
seeds); within a stage every arm's missing runs train together, ``--jobs`` at a time. Each
run has its own folder under the work directory holding its record once complete
(:func:`geomuon.pretrain.studies.common.run_jobs`), and every decision (which point is
best, whether to extend) is a function of the records alone, so a sweep interrupted
anywhere continues where it stopped: complete runs are read back and the same decisions
come out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from geomuon.optimizers.assign import strategy_table
from geomuon.pretrain.provenance import markdown_table

from . import common
from .common import Size, Variant


@dataclass(frozen=True)
class Grid:
    """The learning-rate grid of a sweep: ``points`` values spaced by ``factor`` (log grid,
    centred on the default), ``seeds`` per point, ``best_seeds`` at each arm's best point,
    at most ``max_extensions`` points added per arm when the best sits on an edge."""

    factor: float = 2.0
    points: int = 5
    seeds: tuple[int, ...] = (0, 1)
    best_seeds: tuple[int, ...] = (0, 1, 2)
    max_extensions: int = 2

    def __post_init__(self):
        if self.points < 3 or self.points % 2 == 0:
            raise ValueError(f"Grid(points={self.points}): use an odd number >= 3 (the default sits in the middle)")
        if not 1 < self.factor < math.inf:
            raise ValueError(f"Grid(factor={self.factor}): the spacing of a log grid must be finite and exceed 1")
        if isinstance(self.max_extensions, bool) or not isinstance(self.max_extensions, int) or self.max_extensions < 0:
            raise ValueError(f"Grid(max_extensions={self.max_extensions!r}): use an integer >= 0")
        for option, seeds in (("seeds", self.seeds), ("best_seeds", self.best_seeds)):
            # no seeds had divided by zero in the score; a seed twice had counted one run twice
            if not seeds or len(set(seeds)) != len(seeds) or any(
                    isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
                raise ValueError(f"Grid({option}={seeds!r}): use at least one seed, each an integer >= 0, once")
        if not set(self.seeds) <= set(self.best_seeds):
            raise ValueError(f"Grid: best_seeds {self.best_seeds} must contain the grid's seeds {self.seeds}")

    def seeds_text(self) -> str:
        """The grid's seeds in words, ``"0,1 per point, 0,1,2 at each arm's best point"``: one text for a
        sweep's ``--seeds`` help, its page's Configuration block and its refusal of other seeds."""
        return (f"{','.join(map(str, self.seeds))} per point, {','.join(map(str, self.best_seeds))} at each "
                "arm's best point")

    @property
    def reach(self) -> int:
        """The farthest grid step from the default a sweep can reach, edges extended included."""
        return self.points // 2 + self.max_extensions


def swept_parameter(arm: Variant) -> str:
    """``"adamw_lr"`` for an arm whose strategy is AdamW on every parameter, else ``"lr"``
    (the matrix learning rate; the AdamW parts keep the size's rate)."""
    _, table = strategy_table(arm.strategy)
    return "adamw_lr" if all(rule.update == "adamw" for rule in table.values()) else "lr"


def default_rate(arm: Variant, size: Size) -> float:
    """The arm's own rate: its ``hyper`` override, else the size's."""
    parameter = swept_parameter(arm)
    return arm.hyper.get(parameter, getattr(size, parameter))


def point(arm: Variant, size: Size, grid: Grid, k: int) -> Variant:
    r"""The arm at grid exponent ``k``: $\eta_0 f^k$ set as a hyperparameter override, named
    ``"<arm> @ <parameter>=<rate>"``."""
    parameter = swept_parameter(arm)
    rate = default_rate(arm, size) * grid.factor ** k
    return dataclasses.replace(arm, name=f"{arm.name} @ {parameter}={rate:.4g}", hyper={**arm.hyper, parameter: rate})


def _score(records: list[dict]) -> float:
    """Mean final val loss of a point's runs; +inf when any run diverged or is not finite."""
    losses = [r["final_val_loss"] for r in records]
    if any(r["diverged"] for r in records) or len(common.finite(losses)) < len(losses):
        return math.inf
    return sum(losses) / len(losses)


def best_exponent(exponents: list[int], scores: dict[int, float]) -> int:
    """The exponent of the lowest score (ties: the smaller rate)."""
    return min(exponents, key=lambda k: (scores[k], k))


def extend(exponents: list[int], best: int, extensions: int, grid: Grid) -> list[int]:
    """The exponents after one search stage: one more beyond the edge the best sits on, if
    the arm has extensions left; unchanged otherwise."""
    if extensions >= grid.max_extensions:
        return exponents
    if best == exponents[0]:
        return [best - 1, *exponents]
    if best == exponents[-1]:
        return [*exponents, best + 1]
    return exponents


@dataclass
class ArmSweep:
    """What a sweep found for one arm: the points (exponent → variant), their records, the best."""
    arm: Variant
    parameter: str
    points: dict[int, Variant]
    records: dict[tuple[str, int], dict]
    best: int

    def runs(self, k: int, seeds) -> list[dict]:
        return [self.records[(self.points[k].name, s)] for s in seeds]

    def rate(self, k: int) -> float:
        return self.points[k].hyper[self.parameter]

    @property
    def on_edge(self) -> bool:
        return self.best in (min(self.points), max(self.points))


#: The grids of a sweep's sizes: the full size's (see the module docstring) and the tiny
#: smoke size's (3 points, one extension: every stage runs, in seconds).
GRIDS = {"full": Grid(), "tiny": Grid(points=3, max_extensions=1)}


class LearningRateSweep:
    """A sweep study over the arms of ``base`` (a study module), registered in
    :data:`geomuon.pretrain.studies.STUDIES` under ``name``. It runs at the base study's
    sizes (it tunes the size it is compared at), with the grid :data:`GRIDS` gives each;
    ``comparisons`` are ``(arm, arm)`` pairs the page compares at their best points; ``note``
    ends the page's introduction."""

    #: ``geomuon study``'s ``--seeds`` is refused: the grid sets the seeds (:class:`Grid`)
    TAKES_SEEDS = False

    def __init__(self, base, name: str, title: str, comparisons: list[tuple[str, str]],
                 grids: dict[str, Grid] = GRIDS, note: str = ""):
        self.base, self.NAME, self.TITLE, self.SIZES = base, name, title, base.SIZES
        self.comparisons, self.grids, self.note = comparisons, grids, note
        #: ``--help`` of ``--seeds``: :meth:`run` takes no seeds but its grid's
        self.SEEDS_HELP = "not for a sweep, which trains its grid's seeds: " + "; ".join(
            f"{name}: {g.seeds_text()}" for name, g in grids.items()) + " (leave --seeds out)"
        self.__doc__ = f"Learning-rate sweep of the {base.NAME} study."

    def grid(self, size: Size) -> Grid:
        """The grid of ``size`` (one of :attr:`SIZES`, whatever its seeds: a sweep's seeds are its grid's)."""
        for name, known in self.SIZES.items():
            if dataclasses.replace(known, seeds=size.seeds) == size:
                return self.grids[name]
        raise ValueError(f"study {self.NAME}: a size other than {sorted(self.SIZES)} has no grid")

    def swept_settings(self, size: Size) -> dict[str, str]:
        """What the page's Configuration block says in place of the size's settings a sweep
        varies per run: ``seeds`` (the grid's) and each swept rate (``lr``, ``adamw_lr``), with
        the grid and the arms that sweep it (:func:`geomuon.pretrain.studies.common.write_page`)."""
        g = self.grid(size)
        arms = self.variants(size)
        settings = {"seeds": f"the grid's: {g.seeds_text()}"}
        for parameter in ("lr", "adamw_lr"):
            swept = [arm for arm in arms if swept_parameter(arm) == parameter]
            if swept:
                around = ", ".join(sorted({f"{default_rate(arm, size):g}" for arm in swept}))
                others = f"; {getattr(size, parameter):g} for the other arms" if len(swept) < len(arms) else ""
                settings[parameter] = (f"swept for {', '.join(a.name for a in swept)}: {g.points} rates spaced "
                                       f"×{g.factor:g} around {around}, at most {g.max_extensions} more beyond an "
                                       f"edge{others}")
        return settings

    def variants(self, size: Size) -> list[Variant]:
        """The arms: the base study's variants."""
        return self.base.variants(size)

    def extra_metrics(self, model, evaluation, memory) -> dict:
        """None: a sweep compares final losses (the base study's page has the mechanisms)."""
        return {}

    def search(self, size: Size, run) -> list[ArmSweep]:
        """The staged search. ``run(planned) -> {(name, seed): record}`` trains or reads back
        the ``(variant, seed)`` runs asked for (each at most once)."""
        g = self.grid(size)
        arms = self.variants(size)
        exponents = {arm.name: list(range(-(g.points // 2), g.points // 2 + 1)) for arm in arms}
        extensions = dict.fromkeys(exponents, 0)
        records: dict[tuple[str, int], dict] = {}
        while True:
            planned = [(point(arm, size, g, k), s) for arm in arms for k in exponents[arm.name] for s in g.seeds]
            records.update(run([(v, s) for v, s in planned if (v.name, s) not in records]))
            changed = False
            for arm in arms:
                ks = exponents[arm.name]
                scores = {k: _score([records[(point(arm, size, g, k).name, s)] for s in g.seeds]) for k in ks}
                grown = extend(ks, best_exponent(ks, scores), extensions[arm.name], g)
                if grown != ks:
                    exponents[arm.name], extensions[arm.name], changed = grown, extensions[arm.name] + 1, True
            if not changed:
                break
        found = []
        for arm in arms:
            points = {k: point(arm, size, g, k) for k in exponents[arm.name]}
            scores = {k: _score([records[(points[k].name, s)] for s in g.seeds]) for k in points}
            found.append(ArmSweep(arm, swept_parameter(arm), points, records, best_exponent(list(points), scores)))
        third = [(a.points[a.best], s) for a in found for s in g.best_seeds if s not in g.seeds]
        records.update(run(third))
        return found

    def run(self, study, size: Size, data_path: str, work_dir: Path, jobs: int, threads: int, fresh: bool,
            say=print):
        """The sweep's runs (see :meth:`search`), in the form of
        :func:`geomuon.pretrain.studies.common.run_all`: ``({point: [records]}, {point: variant},
        number read back)``; a point lists its grid seeds, the best point its best seeds."""
        g = self.grid(size)
        if size.seeds not in {known.seeds for known in self.SIZES.values()}:
            raise ValueError(f"--seeds: a sweep's seeds are its grid's ({g.seeds_text()}); drop --seeds")
        self.check(size)
        read_back = 0

        def run(planned):
            nonlocal read_back
            if not planned:
                return {}
            records, cached = common.run_jobs(self, planned, size, data_path, work_dir, jobs, threads, fresh, say)
            read_back += cached
            return records

        found = self.search(size, run)
        results, variants = {}, {}
        for a in found:
            for k, v in sorted(a.points.items()):
                results[v.name] = a.runs(k, g.best_seeds if k == a.best else g.seeds)
                variants[v.name] = v
        return results, variants, read_back

    def check(self, size: Size) -> None:
        """Refuse, before any run, a sweep whose page or grid cannot come out right: a
        comparison naming an arm it does not train (had been a ``KeyError`` after every run),
        an arm whose default rate is not finite and positive (no log grid around it; 0 had
        trained one run for all its points), and a grid too fine for the points' names
        (``<arm> @ <parameter>=<rate, 4 significant digits>``, which key the records: two points
        of one name had shared one record)."""
        g = self.grid(size)
        arms = self.variants(size)
        names = [arm.name for arm in arms]
        unknown = sorted({name for pair in self.comparisons for name in pair} - set(names))
        if unknown:
            raise ValueError(f"study {self.NAME}: its comparisons name {unknown}, which are not among its arms "
                             f"{names}; compare arms it trains")
        reach = g.reach
        for arm in arms:
            rate = default_rate(arm, size)
            if not 0 < rate < math.inf:
                raise ValueError(f"study {self.NAME}: arm {arm.name!r} has default {swept_parameter(arm)} {rate!r}; "
                                 "a log grid needs a finite rate > 0")
            if len({point(arm, size, g, k).name for k in range(-reach, reach + 1)}) != 2 * reach + 1:
                raise ValueError(f"study {self.NAME}: Grid(factor={g.factor}) is too fine: arm {arm.name!r}'s rates "
                                 "print alike at 4 significant digits; use a larger factor")

    def arm_sweeps(self, results: dict[str, list[dict]], size: Size, arms=None) -> list[ArmSweep]:
        """The per-arm view of ``results`` (as :meth:`run` returns them), for the page; ``arms``:
        the names of the arms to view (default: every arm). ``ValueError`` naming an arm that
        ``results`` hold no run of on the grid."""
        g = self.grid(size)
        reach = g.reach
        found = []
        for arm in self.variants(size):
            if arms is not None and arm.name not in arms:
                continue
            points = {k: point(arm, size, g, k) for k in range(-reach, reach + 1)}
            points = {k: v for k, v in points.items() if v.name in results}
            if not points:  # (had been min()'s "arg is an empty sequence")
                raise ValueError(f"the results hold no runs of arm {arm.name!r} on the {self.NAME} grid")
            records = {(v.name, r["seed"]): r for v in points.values() for r in results[v.name]}
            scores = {k: _score([records[(v.name, s)] for s in g.seeds]) for k, v in points.items()}
            found.append(ArmSweep(arm, swept_parameter(arm), points, records, best_exponent(list(points), scores)))
        return found

    # ------------------------------------------------------------------------- page

    def report(self, results, size, meta, figure_dir) -> str:
        """The page body: one table and one loss-vs-rate figure per arm, the best points on
        three seeds, and the comparisons there."""
        g = self.grid(size)
        found = self.arm_sweeps(results, size)
        best = {a.arm.name: [r["final_val_loss"] for r in a.runs(a.best, g.best_seeds)] for a in found}
        sections = []
        for a in found:
            rows = []
            for k in sorted(a.points):
                runs = a.runs(k, g.seeds)
                note = "**best**" + (" (grid edge)" if a.on_edge else "") if k == a.best else ""
                rows.append([f"{a.rate(k):.4g}", *(f"{r['final_val_loss']:.4f}" + (" (diverged)" if r["diverged"] else "")
                                                   for r in runs), common.fmt([r["final_val_loss"] for r in runs], 4),
                             note])
            header = [a.parameter, *(f"seed {s}" for s in g.seeds), "mean ± std", ""]
            figure = self._figure(a, g, figure_dir)
            sections.append(f"### `{a.arm.name}`\n\n{a.arm.label}.\n\n" + markdown_table(header, rows)
                            + f"\n\n![{a.arm.name}: final val loss against {a.parameter}]({self.NAME}/{figure})")
        together = self._together(found, g, figure_dir)
        best_rows = [[f"`{a.arm.name}`", a.parameter, f"{a.rate(a.best):.4g}",
                      f"{min(a.rate(k) for k in a.points):.4g} – {max(a.rate(k) for k in a.points):.4g}",
                      "yes" if a.on_edge else "no", common.fmt(best[a.arm.name], 4),
                      ", ".join(f"{v:.4f}" for v in best[a.arm.name])] for a in found]
        best_table = markdown_table(["arm", "swept", "best rate", "grid", "best on the edge", "final val loss",
                                     "per seed"], best_rows)
        findings = [common.compare_sentence(x, best[x], y, best[y], "Final val loss at each arm's best rate",
                                            digits=4) for x, y in self.comparisons]
        rates = {a.arm.name: a.rate(a.best) for a in found if a.parameter == "lr"}
        same = len(set(rates.values())) == 1
        findings.append(
            "Best matrix learning rate per arm (grid spacing ×" + f"{g.factor:g}): "
            + ", ".join(f"`{n}` {r:.4g}" for n, r in rates.items()) + ". "
            + ("Every arm's best rate is the same grid point." if same else
               "The best rate is not the same for every arm at this grid's resolution."))
        edge = [a.arm.name for a in found if a.on_edge]
        if edge:
            findings.append("Still on the grid's edge after the extensions: " + ", ".join(f"`{n}`" for n in edge)
                            + " (its best rate may lie beyond the grid).")
        return "\n\n".join([
            f"Every arm of the [{self.base.NAME} study]({self.base.NAME}.md) at its own learning rate, at the "
            f"study's size ({size.steps} steps). Grid: {g.points} rates spaced ×{g.factor:g} around the arm's "
            f"default (the matrix rate, or the AdamW rate for an arm that is AdamW everywhere; the other rate "
            f"stays at the size's value), seeds {', '.join(map(str, g.seeds))} per point; a best point on the "
            f"edge extends the grid by one point beyond it (at most {g.max_extensions} such point(s) per arm); "
            f"then the best point "
            f"gets seed(s) {', '.join(str(s) for s in g.best_seeds if s not in g.seeds)} and the arms are "
            f"compared there on seeds {', '.join(map(str, g.best_seeds))}. The best point is the lowest mean "
            "final validation loss over the grid's seeds; a point with a diverged run ranks last. " + self.note,
            f"## Best points ({len(g.best_seeds)} seeds)\n\n" + best_table
            + f"\n\n![every arm's mean final val loss against the matrix rate]({self.NAME}/{together})",
            "## What the numbers say\n\nA difference is called resolved only when the two mean ± std bands do "
            "not overlap (a rough screen, not a significance test).\n\n" + "\n".join(f"* {f}" for f in findings),
            "## Sweeps per arm\n\nFinal validation loss per seed at every rate tried.\n\n" + "\n\n".join(sections),
        ])

    def _together(self, found: list[ArmSweep], g: Grid, figure_dir: Path) -> str:
        """One axis: the mean curve of every arm that sweeps the matrix rate (where the minima sit)."""
        plt = common.pyplot()
        colour = common.colours([a.arm.name for a in found])
        fig, ax = plt.subplots(figsize=(7.0, 4.2))
        for a in found:
            if a.parameter != "lr":
                continue
            ks = sorted(a.points)
            ax.plot([a.rate(k) for k in ks], [_score(a.runs(k, g.seeds)) for k in ks], "-o", ms=3, lw=1.2,
                    color=colour[a.arm.name], label=a.arm.name)
            ax.plot([a.rate(a.best)], [_score(a.runs(a.best, g.seeds))], "*", ms=11, color=colour[a.arm.name])
        ax.set(xscale="log", xlabel="lr (matrix learning rate)", ylabel=f"mean final val loss, seeds {g.seeds}",
               title="every arm against its matrix learning rate (star: its best)")
        ax.legend(fontsize=7)
        return common.save(fig, figure_dir, "lr_all_arms.png")

    def _figure(self, a: ArmSweep, g: Grid, figure_dir: Path) -> str:
        plt = common.pyplot()
        fig, ax = plt.subplots(figsize=(5.0, 3.4))
        ks = sorted(a.points)
        rates = [a.rate(k) for k in ks]
        for s in g.seeds:
            ax.plot(rates, [a.records[(a.points[k].name, s)]["final_val_loss"] for k in ks], "o", ms=4, alpha=0.6,
                    label=f"seed {s}")
        ax.plot(rates, [_score(a.runs(k, g.seeds)) for k in ks], "-", color="k", lw=1.2, label="mean")
        ax.plot([a.rate(a.best)], [_score(a.runs(a.best, g.seeds))], "*", color="red", ms=12, label="best")
        ax.set(xscale="log", xlabel=a.parameter, ylabel="final val loss (nats)", title=a.arm.name)
        ax.set_xticks(rates, [f"{r:.3g}" for r in rates])  # the grid's own rates, not log-axis decades
        ax.minorticks_off()
        ax.legend(fontsize=7)
        return common.save(fig, figure_dir, "lr_" + re.sub(r"[^A-Za-z0-9_.=+-]", "_", a.arm.name) + ".png")
