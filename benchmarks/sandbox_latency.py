"""Claim: the process sandbox adds little to a bare subprocess (target: p50 <= 1.5x bare).

In one run, ``python3 -c "print(1)"`` through each subject at concurrency 1, 2 and 8:

- ``bare``: a plain trio subprocess (the floor);
- ``process``: ``ProcessSandbox.run`` (one-shot: a resident bubblewrap sandbox from the warm
  pool, the command fork/exec'd in it by its runner with the request's rlimits, every process
  killed after it, the sandbox reset in the background and put back);
- ``process-session``: ``SandboxSession.run`` on a session each worker holds (what a
  multi-turn episode pays per turn);
- ``process-per-command``: ``ProcessSandbox(resident=False).run``, a fresh bubblewrap sandbox
  and host work dir per command (what the process backend cost before resident sandboxes).

Subjects are measured interleaved, in blocks, so the load of a shared machine falls on all of
them alike. Reported per subject and concurrency: p50 and p99 latency (ms, wall time per call
as the caller sees it) and executions per second. ``breakdown`` times the parts of one
process-backend call at concurrency 1, to show where the time goes.
Simplification: 3 warm-up calls per subject; no CPU pinning; the pool keeps idle sandboxes for
30 s, so every concurrency level runs warm after its warm-up.

    .venv/bin/python benchmarks/sandbox_latency.py [--runs 120] [--json] [--docker [IMAGE]]

``--docker`` adds the table of benchmarks/sandbox_latency_docker.py (bare, process, Docker
with a warm pool, cold ``docker run --rm``) under ``"docker"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

from streamrl.sandbox import ExecRequest, Limits, ProcessSandbox, opened
from streamrl.sandbox.process import RUNNER_SOURCE, _child_setup

ARGV = ["/usr/bin/python3", "-c", "print(1)"]
CONCURRENCY = (1, 2, 8)
BLOCK = 8  # calls per worker per block before the next subject's turn

Call = Callable[[], Awaitable[object]]


async def bare() -> object:
    return await trio.run_process(ARGV, capture_stdout=True, capture_stderr=True)


@asynccontextmanager
async def open_subjects(concurrency: int) -> AsyncIterator[dict[str, list[Call]]]:
    """Per subject, one call function per worker (a session is held per worker)."""
    box, per_command = ProcessSandbox(), ProcessSandbox(resident=False)
    assert box.resident, "no resident bubblewrap sandbox here: nothing to measure"
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(opened(box))  # its warm pool, closed on exit
        sessions = [await stack.enter_async_context(box.session(Limits())) for _ in
                    range(concurrency)]  # fmt: skip

        def one_shot(sandbox: ProcessSandbox) -> Call:
            return lambda: sandbox.run(ExecRequest(ARGV))

        def in_session(session: Any) -> Call:
            return lambda: session.run(ExecRequest(ARGV))

        yield {
            "bare": [bare] * concurrency,
            "process": [one_shot(box)] * concurrency,
            "process-session": [in_session(s) for s in sessions],
            "process-per-command": [one_shot(per_command)] * concurrency,
        }


async def measure(subjects: dict[str, list[Call]], runs: int) -> dict[str, dict[str, float]]:
    latencies: dict[str, list[float]] = {name: [] for name in subjects}
    busy_s: dict[str, float] = dict.fromkeys(subjects, 0.0)
    for calls in subjects.values():
        for _ in range(3):
            await calls[0]()
    while min(len(v) for v in latencies.values()) < runs:
        for name, calls in subjects.items():

            async def worker(call: Call, name: str = name) -> None:
                for _ in range(BLOCK):
                    start = time.perf_counter()
                    await call()
                    latencies[name].append((time.perf_counter() - start) * 1000)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for call in calls:
                    nursery.start_soon(worker, call)
            busy_s[name] += time.perf_counter() - start
    report = {}
    for name, values in latencies.items():
        cuts = statistics.quantiles(values, n=100)
        report[name] = {
            "p50_ms": round(cuts[49], 2),
            "p99_ms": round(cuts[98], 2),
            "exec_per_s": round(len(values) / busy_s[name], 1),
            "runs": len(values),
        }
    return report


async def breakdown(runs: int) -> dict[str, Any]:
    """Median ms of the parts of one process-backend call (concurrency 1)."""
    box = ProcessSandbox(resident=False)
    resident = ProcessSandbox()
    workdir = box._make_workdir(None)
    bwrap_true = box._wrap(box.isolation, ["/bin/true"], workdir)[0]
    wrapped = box._wrap(box.isolation, ARGV, workdir)[0]
    setup = _child_setup(Limits(), None)

    async def median(call: Call) -> float:
        values = []
        for _ in range(runs):
            start = time.perf_counter()
            await call()
            values.append((time.perf_counter() - start) * 1000)
        return round(statistics.median(values), 2)

    async def workdir_cycle() -> None:
        shutil.rmtree(box._make_workdir(None))

    async def resident_start_kill() -> None:
        runner = await resident._start_runner()
        await runner.kill()

    async def resident_reset() -> None:
        await runner.control({"op": "reset"})

    runner = await resident._start_runner()

    parts = {
        "isolation": box.isolation,
        "bare_ms": await median(bare),
        "bare_with_rlimits_preexec_ms": await median(
            lambda: trio.run_process(ARGV, capture_stdout=True, preexec_fn=setup)
        ),
        "wrapper_alone_true_ms": await median(
            lambda: trio.run_process(bwrap_true, capture_stdout=True, cwd="/", preexec_fn=setup)
        ),
        "wrapped_python_ms": await median(
            lambda: trio.run_process(wrapped, capture_stdout=True, cwd="/", preexec_fn=setup)
        ),
        "workdir_create_remove_ms": await median(workdir_cycle),
        "per_command_full_run_ms": await median(lambda: box.run(ExecRequest(ARGV))),
        "resident_start_and_kill_ms": await median(resident_start_kill),
        "resident_command_ms": await median(lambda: runner.run(ExecRequest(ARGV), Limits(), 2)),
        "resident_reset_ms": await median(resident_reset),
        "full_run_ms": await median(lambda: resident.run(ExecRequest(ARGV))),
        "runner_source_bytes": len(RUNNER_SOURCE),
    }
    await runner.kill()
    await resident.aclose()
    shutil.rmtree(workdir)
    return parts


async def main(runs: int, as_json: bool, docker_image: str | None = None) -> None:
    report: dict[str, Any] = {"argv": ARGV, "cpus": os.cpu_count(), "concurrency": {}}
    report["load_before"] = [round(x, 2) for x in os.getloadavg()]
    for c in CONCURRENCY:
        async with open_subjects(c) as subjects:
            report["concurrency"][str(c)] = await measure(subjects, runs)
    report["breakdown"] = await breakdown(max(20, runs // 4))
    if docker_image:  # bare / process / docker-warm / docker-cold, see sandbox_latency_docker
        from sandbox_latency_docker import docker_report

        report["docker"] = await docker_report(runs, max(8, runs // 5), docker_image)
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    one = report["concurrency"]["1"]
    ratio = one["process"]["p50_ms"] / one["bare"]["p50_ms"]
    report["process_over_bare_p50"] = round(ratio, 2)
    report["target_met"] = ratio <= 1.5
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'subject':<20}{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'exec/s':>9}")
    for c, rows in report["concurrency"].items():
        for name, row in rows.items():
            print(f"{name:<20}{c:>5}{row['p50_ms']:>9}{row['p99_ms']:>9}{row['exec_per_s']:>9}")
    print("breakdown:", json.dumps(report["breakdown"]))
    for c, rows in report.get("docker", {}).get("concurrency", {}).items():
        for name, row in rows.items():
            print(f"{name:<20}{c:>5}{row['p50_ms']:>9}{row['p99_ms']:>9}{row['exec_per_s']:>9}")
    print(f"load average before/after: {report['load_before']} / {report['load_after']}")
    print(f"process / bare p50 at concurrency 1: {ratio:.2f} (target <= 1.5)", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=120, help="calls per subject and concurrency")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--docker", metavar="IMAGE", nargs="?", const="streamrl-sandbox:offline",
        help="add the Docker backend (warm pool) and a cold `docker run --rm`",
    )  # fmt: skip
    args = parser.parse_args()
    if args.docker:
        from streamrl.runtime.logs import configure_logging

        configure_logging(actor="benchmark", level="warning")  # logs to stderr, not the JSON
    trio.run(main, args.runs, args.json, args.docker)
