"""Claim: a warm Docker sandbox runs a trivial command in close to a bare process (target: warm
Docker p50 <= 25 ms; a raw exec through the API measured 55 ms, a cold container 240 ms).

The Docker columns of ``benchmarks/sandbox_latency.py``, with its baselines in the same run:
``python3 -c "print(1)"`` at concurrency 1, 2 and 8 through

- ``bare``: a plain trio subprocess on the host (the floor);
- ``process``: ``ProcessSandbox.run``;
- ``docker-warm``: ``DockerSandbox.run`` with a warm pool of 8 (one container per worker at
  most; the resident runner forks/execs, the container is reset in the background after);
- ``docker-warm-label``: the same with a label, as the executor runs it (a command still
  running after ``name_runs_after_s``, 0.2 s, has its container renamed after the label
  concurrently with it and back in the background; ``print(1)`` is done sooner, so this
  shows what the label costs a short run);
- ``docker-cold``: ``docker run --rm`` with the same hardening flags (CLI, a new container per
  call), measured after the others with fewer runs (it is 10x slower).

Reported per subject and concurrency: p50 / p99 latency (ms, wall time as the caller sees it)
and executions per second, measured interleaved in blocks by ``sandbox_latency.measure``.
Needs a Docker engine and the image (sandbox/images/build_offline.sh).

    .venv/bin/python benchmarks/sandbox_latency_docker.py [--runs 120] [--cold-runs 24] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sandbox_latency import CONCURRENCY, Call, bare, measure

from streamrl.runtime.logs import configure_logging
from streamrl.sandbox import ExecRequest, ProcessSandbox, opened
from streamrl.sandbox.docker import DEFAULT_IMAGE, open_docker_sandbox

ARGV = ["python3", "-c", "print(1)"]
HOST_ARGV = ["/usr/bin/python3", "-c", "print(1)"]  # what sandbox_latency runs on the host
POOL = max(CONCURRENCY)


def cold_argv(image: str) -> list[str]:
    """``docker run --rm`` with the hardening flags the backend uses."""
    return [
        "docker", "run", "--rm", "--network", "none", "--read-only",
        "--tmpfs", "/work:rw,nosuid,nodev,size=64m,uid=65534,gid=65534,mode=0700",
        "--tmpfs", "/tmp:rw,nosuid,nodev,noexec,size=16m", "--user", "65534:65534",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--memory", "544m",
        "--memory-swap", "544m", "--cpus", "1", "--pids-limit", "66", "--ulimit",
        "nofile=256:256", "--init", "--log-driver", "none", "-w", "/work", image, *ARGV,
    ]  # fmt: skip


async def docker_report(runs: int, cold_runs: int, image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    """The table: subject -> concurrency -> p50/p99/exec per s (also used by sandbox_latency)."""
    process = ProcessSandbox()
    report: dict[str, Any] = {"argv": ARGV, "image": image, "pool_size": POOL, "concurrency": {}}
    labels = itertools.count()
    try:
        async with opened(process), open_docker_sandbox(image, pool_size=POOL) as docker:
            await docker.run(ExecRequest(ARGV))
            with trio.fail_after(120):  # the whole pool started before measuring
                while docker.statistics().ready < POOL:
                    await trio.sleep(0.2)

            async def cold() -> object:
                return await trio.run_process(cold_argv(image), capture_stdout=True, check=True)

            for c in CONCURRENCY:
                subjects: dict[str, list[Call]] = {
                    "bare": [bare] * c,
                    "process": [lambda: process.run(ExecRequest(HOST_ARGV))] * c,
                    "docker-warm": [lambda: docker.run(ExecRequest(ARGV))] * c,
                    "docker-warm-label": [
                        lambda: docker.run(ExecRequest(ARGV), label=f"bench-{next(labels)}")
                    ] * c,
                }
                rows = await measure(subjects, runs)
                rows.update(await measure({"docker-cold": [cold] * c}, cold_runs))
                report["concurrency"][str(c)] = rows
            report["docker_statistics"] = docker.statistics().__dict__
    finally:
        await process.aclose()
    one = report["concurrency"]["1"]
    report["docker_warm_p50_ms"] = one["docker-warm"]["p50_ms"]
    report["docker_warm_label_p50_ms"] = one["docker-warm-label"]["p50_ms"]
    report["docker_warm_over_bare_p50"] = round(
        one["docker-warm"]["p50_ms"] / one["bare"]["p50_ms"], 2
    )
    report["target_met"] = one["docker-warm"]["p50_ms"] <= 25.0
    return report


async def main(runs: int, cold_runs: int, image: str, as_json: bool) -> None:
    report = await docker_report(runs, cold_runs, image)
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'subject':<14}{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'exec/s':>9}")
    for c, table in report["concurrency"].items():
        for name, row in table.items():
            print(f"{name:<14}{c:>5}{row['p50_ms']:>9}{row['p99_ms']:>9}{row['exec_per_s']:>9}")
    print(f"warm Docker p50 at concurrency 1: {report['docker_warm_p50_ms']} ms (target <= 25)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=120, help="calls per subject and concurrency")
    parser.add_argument("--cold-runs", type=int, default=24, help="calls of docker-cold")
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    configure_logging(actor="benchmark", level="warning")  # JSON logs to stderr
    trio.run(main, args.runs, args.cold_runs, args.image, args.json)
