"""``streamrl report --out DIR``: PNG charts and a Markdown summary of a run.

Sources, all read-only: the learner's ``metrics`` stream (reward, step and wait seconds,
staleness per step), the trajectories and evaluation results (live streams and the
archive, deduplicated), and the entry ids of the work streams (an entry id is the time its
producer wrote it: the throughput of each stage).

Charts (matplotlib, Agg backend): ``reward.png`` (training reward per domain over policy
versions), ``eval.png`` (held-out reward per domain over policy versions; an eval-only
domain such as ``general`` dashed); with more than :data:`LINES_UP_TO` domains each is a
heatmap instead (a row per domain, a column per policy version, the reward as colour; an
eval-only domain's label starts with ``*``, a forgetting one's ends with ``!``), so 100+
domains stay legible; ``throughput.png`` (entries per minute each stage
produced), ``learner_busy.png`` (step / (step + wait) per step), ``staleness.png`` (max
staleness per step); ``summary.md`` holds the numbers behind them, and each domain's
held-out reward at its first and last evaluated version: a drop of more than
``scheduler.forgetting_margin`` on an eval-only domain is flagged as forgetting. A chart
with no data is left out and the summary says so.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.actors.archiver import archive_dir
from streamrl.cli.replay import Query, select
from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import MessageError, decode
from streamrl.queues.operations import read_range
from streamrl.queues.stats import stream_length

PRODUCED_BY = {
    N.TASKS: "scheduler", N.ROLLOUTS: "generator", N.EXECUTED: "executor",
    N.TRAJECTORIES: "verifier", N.EVALS: "verifier (eval)",
}  # fmt: skip
MAX_ENTRIES = 100_000
MIN_RATE_SPAN_S = 10.0
"""A rate over a shorter span is not printed (it would say nothing)."""
LINES_UP_TO = 12
"""A reward chart draws a line per domain up to this many domains, else a heatmap."""


@dataclass
class RunData:
    steps: list[StepMetrics] = field(default_factory=list)
    reward: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    """domain -> policy version -> rewards of training samples."""
    evals: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    """domain -> policy version -> rewards of held-out samples."""
    produced: dict[str, list[float]] = field(default_factory=dict)
    """stage -> times (unix s) of the entries it produced, still in the streams."""
    dead_letters: int = 0


async def collect(
    client: RedisClient, names: N.Names, archive: Path | None
) -> RunData:
    data = RunData()
    for _, fields in await read_range(client, names.stream(N.METRICS)):
        try:
            data.steps.append(decode(fields[b"d"], StepMetrics))
        except (MessageError, KeyError):
            continue
    data.steps.sort(key=lambda m: m.step)
    for found in await select(client, names, Query(), archive):
        t = found.trajectory
        target = data.evals if t.rollout.task.split == "eval" else data.reward
        target.setdefault(t.rollout.task.domain, defaultdict(list))[t.policy_version] += list(
            t.rewards
        )
    for stream, stage in PRODUCED_BY.items():
        data.produced[stage] = []
        for layout in names.layouts():  # every shard of a sharded run
            rows = await read_range(client, layout.stream(stream), count=MAX_ENTRIES)
            data.produced[stage] += [int(e.split("-")[0]) / 1000 for e, _ in rows]
    data.produced["learner (steps)"] = [m.created_at for m in data.steps]
    data.dead_letters = await stream_length(client, names, N.DEAD)
    return data


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def per_version(series: dict[str, dict[int, list[float]]]) -> dict[str, list[tuple[int, float]]]:
    return {d: [(v, _mean(r)) for v, r in sorted(by.items())] for d, by in sorted(series.items())}


def forgotten(data: RunData, margin: float) -> set[str]:
    """The eval-only domains whose held-out reward at the last evaluated version is more
    than ``margin`` below the first."""
    return {
        d for d, points in per_version(data.evals).items()
        if d not in data.reward and points[0][1] - points[-1][1] > margin
    }


def forgetting(data: RunData, margin: float = 0.05) -> list[str]:
    """Markdown: each domain's held-out reward at the first and the last evaluated policy
    version; an eval-only domain that dropped by more than ``margin`` is flagged."""
    series = per_version(data.evals)
    if not series:
        return []
    flagged = forgotten(data, margin)
    lines = ["", "## Held-out reward, first vs last version", "",
             f"Forgetting: an eval-only domain more than {margin:.3f} below its first version.",
             "", "| domain | trained | first (version) | last (version) | change |",
             "|---|---|---|---|---|"]
    for domain, points in series.items():
        (v0, r0), (v1, r1) = points[0], points[-1]
        trained = "yes" if domain in data.reward else "no (eval only)"
        flag = " **forgetting**" if domain in flagged else ""
        lines.append(f"| {domain} | {trained} | {r0:.3f} (v{v0}) | {r1:.3f} (v{v1}) |"
                     f" {r1 - r0:+.3f}{flag} |")
    return lines


def busy_fraction(m: StepMetrics) -> float:
    total = m.step_seconds + m.wait_seconds
    return m.step_seconds / total if total > 0 else 0.0


def throughput(times: list[float], bucket_s: float = 60.0) -> list[tuple[float, float]]:
    """(minutes since the first entry, entries per minute) per bucket."""
    if not times:
        return []
    start = min(times)
    counts: dict[int, int] = defaultdict(int)
    for t in times:
        counts[int((t - start) // bucket_s)] += 1
    return [(b * bucket_s / 60, n * 60 / bucket_s) for b, n in sorted(counts.items())]


def heatmap(fig: Any, ax: Any, series: dict[str, list[tuple[int, float]]],
            labels: dict[str, str]) -> None:
    """One row per domain (sorted by name), one column per policy version any domain was
    measured at, the mean reward as colour (blank: not measured at that version)."""
    import numpy as np

    versions = sorted({v for points in series.values() for v, _ in points})
    column = {v: i for i, v in enumerate(versions)}
    grid = np.full((len(series), len(versions)), np.nan)
    for row, points in enumerate(series.values()):
        for v, r in points:
            grid[row, column[v]] = r
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.set_yticks(range(len(series)), [labels.get(d, d) for d in series], fontsize=6)
    step = max(1, len(versions) // 20)
    ax.set_xticks(range(0, len(versions), step), [f"v{v}" for v in versions[::step]],
                  fontsize=7)
    ax.set_xlabel("policy version")
    fig.colorbar(image, ax=ax, label="mean reward", fraction=0.04, pad=0.02)


def charts(data: RunData, out: Path, margin: float = 0.05) -> list[str]:
    """Write the PNG charts; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)

    flagged = forgotten(data, margin)
    for name, series, title in (
        ("reward.png", data.reward, "training reward per domain"),
        ("eval.png", data.evals, "held-out reward per domain"),
    ):
        if len(series) > LINES_UP_TO:
            labels = {d: ("* " if series is data.evals and d not in data.reward else "") + d
                      + (" !" if d in flagged else "") for d in series}
            fig, ax = plt.subplots(figsize=(8, 1.5 + 0.11 * len(series)))
            heatmap(fig, ax, per_version(series), labels)
            ax.set_title(f"{title} ({len(series)} domains"
                         + ("; * eval only, ! forgetting)" if series is data.evals else ")"))
            save(fig, name)
        elif series:
            fig, ax = plt.subplots(figsize=(7, 4))
            for domain, points in per_version(series).items():
                only = series is data.evals and domain not in data.reward  # e.g. general
                ax.plot([v for v, _ in points], [r for _, r in points], marker="o",
                        linestyle="--" if only else "-",
                        label=f"{domain} (eval only)" if only else domain)
            ax.set(title=title, xlabel="policy version", ylabel="mean reward", ylim=(-0.05, 1.05))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend()
            save(fig, name)
    if any(data.produced.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for stage, times in data.produced.items():
            rates = throughput(times)
            if rates:
                ax.plot([m for m, _ in rates], [r for _, r in rates], marker=".", label=stage)
        ax.set(title="throughput per stage", xlabel="minutes", ylabel="entries / minute")
        ax.legend()
        save(fig, "throughput.png")
    if data.steps:
        steps = [m.step for m in data.steps]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [busy_fraction(m) for m in data.steps], marker="o")
        ax.set(title="learner busy fraction", xlabel="step", ylabel="step / (step + wait)",
               ylim=(-0.05, 1.05))
        save(fig, "learner_busy.png")
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(steps, [m.max_staleness_seen for m in data.steps])
        ax.set(title="max staleness per step", xlabel="step", ylabel="policy versions")
        save(fig, "staleness.png")
    return written


def summary(run: str, data: RunData, written: list[str], margin: float = 0.05,
            rounds: list[str] | None = None) -> str:
    lines = [f"# Run {run}", ""]
    if rounds:  # a post-training sequence (cli/rounds.py): its stages first
        lines += ["## Rounds", "", "```", *rounds, "```", ""]
    if data.steps:
        last = data.steps[-1]
        busy = [busy_fraction(m) for m in data.steps]
        lines += [
            f"- learner steps: {len(data.steps)} (last step {last.step}, loss {last.loss:.4f},"
            f" grad norm {last.grad_norm:.4f})",
            f"- learner busy fraction: mean {_mean(busy):.2f}, last {busy[-1]:.2f}",
            f"- staleness: max {max(m.max_staleness_seen for m in data.steps)} versions;"
            f" stale groups dropped: {last.dropped_stale}",
        ]
    else:
        lines.append("- no learner step recorded")
    lines.append(f"- dead letters: {data.dead_letters}")
    for title, series in (("Training reward", data.reward), ("Held-out reward", data.evals)):
        lines += ["", f"## {title} per domain", ""]
        if not series:
            lines.append("no data")
            continue
        lines += ["| domain | version | mean reward | samples |", "|---|---|---|---|"]
        for domain, by in sorted(series.items()):
            for version, rewards in sorted(by.items()):
                lines.append(f"| {domain} | {version} | {_mean(rewards):.3f} | {len(rewards)} |")
    lines += forgetting(data, margin)
    lines += ["", "## Throughput (entries still in the streams)", "",
              "| stage | entries | per minute |", "|---|---|---|"]
    for stage, times in data.produced.items():
        span = (max(times) - min(times)) / 60 if len(times) > 1 else 0.0
        rate = f"{(len(times) - 1) / span:.1f}" if span >= MIN_RATE_SPAN_S / 60 else "-"
        lines.append(f"| {stage} | {len(times)} | {rate} |")
    lines += ["", "## Charts", ""] + [f"![{w}]({w})" for w in written]
    return "\n".join(lines) + "\n"


async def write_report(
    client: RedisClient, names: N.Names, out: Path, archive: Path | None, *,
    forgetting_margin: float = 0.05, rounds: list[str] | None = None,
) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    data = await collect(client, names, archive)
    written = charts(data, out, forgetting_margin)
    (out / "summary.md").write_text(summary(names.run, data, written, forgetting_margin,
                                            rounds))
    return [*written, "summary.md"]


async def run_report(
    client: RedisClient, names: N.Names, config: Config, args: argparse.Namespace
) -> int:
    archive = Path(args.archive) if args.archive else archive_dir(config)
    from streamrl.cli.rounds import rounds_lines

    written = await write_report(client, names, Path(args.out), archive,
                                 forgetting_margin=config.scheduler.forgetting_margin,
                                 rounds=rounds_lines(config.run.path))
    print(f"wrote {', '.join(written)} to {args.out}")
    return 0
