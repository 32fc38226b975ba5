"""Executor: runs what the model wrote in a sandbox (``rollouts`` -> ``executed``, or
``tasks`` for the next turn of a multi-turn episode).

The completions of one group run concurrently. What the untrusted code did comes back as
data (exit code, output, timed out, OOM); a sandbox that cannot be provided
(``SandboxUnavailable``: engine down, create failed) becomes :class:`Unavailable`, so the
whole message is retried with fresh sandboxes by the runtime's retry policy, then released
for any replica's reclaimer to redeliver (never dead-lettered for it before
``max_deliveries``), and never half-published.

Where each domain's code runs (:class:`Sandboxes`): the backend and image come from
``[executor.domains.<name>]`` in the config, else from the domain's ``sandbox`` spec, else
``executor.backend``; the limits are the request's (the domain's), with ``timeout_s`` /
``memory_mb`` of ``[domain.<name>]`` on top; the spec's files are staged under the
request's own.
One backend instance per (backend, image), opened on first use, closed with the executor.
The Docker backend's fleet controls (``max_containers``, ``max_starting``,
``create_rate_per_s``, ``create_burst``, ``session_max_s``, ``sweep_interval_s``,
``leak_age_s``) come from ``[executor]``; every :data:`FLEET_METRICS_S` the executor records
each Docker backend's counts (containers starting and running; created, leaked, reaped;
sessions expired) in its Prometheus metrics (:func:`record_fleet`).
Backends are structured: the executor enters :meth:`Sandboxes.opened` (or
:func:`open_sandboxes`), whose nursery holds each backend's ``serve`` task (started with
``nursery.start`` on first use: the Docker backend's engine connection and pool) and closes
every backend on exit. A backend that fails (engine unreachable, its connection lost while
commands run) raises :class:`SandboxUnavailable` chained to the failure into the calls in
flight and later ones; the retry of the message gets a fresh backend, served anew.

Isolation is never silent: every backend opened is logged with its isolation level and what
that does not isolate (a warning below ``bwrap``), and one below ``executor.min_isolation``
is refused (:class:`IsolationTooWeak`). At start the executor opens the backend of every
domain of the run that runs code (:meth:`Sandboxes.open_for`), so it refuses to start rather
than to run a message; ``up`` prints the same lines (:func:`isolation_report`) before it
starts anything.

A multi-turn domain's rollout is one turn of an episode (:meth:`Executor.handle_turn`,
:mod:`actors.episodes`): each live member's command runs in its own sandbox session, its
observation is recorded, members that end get their hidden check as their outcome; out goes
the next turn (``tasks``) or, once every member ended, the whole episode (``executed``).
A member whose session the backend refuses for its age (``SessionExpired``: the Docker
backend's ``session_max_s``) ends as ``"expired"``, with no final check (reward 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import replace as dc_replace
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import msgspec
import structlog
import trio

from streamrl.actors.agents import AgentRunner, open_agent_runner
from streamrl.actors.episodes import LOST, EpisodeSessions, LostSession, TurnState, observed
from streamrl.config.schema import Config, DomainConfig, DomainSandboxConfig
from streamrl.domains.base import (
    NO_SANDBOX,
    is_agent_driven,
    is_multi_turn,
    item_image,
    tool_calls,
)
from streamrl.domains.registry import get_domain
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Episode,
    ExecOutcome,
    Executed,
    Rollout,
    ids_to_bytes,
    new_id,
    now,
)
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import BrokerError, set_fields
from streamrl.runtime import metrics
from streamrl.runtime.context import ActorContext, domain_item
from streamrl.runtime.policies import Reject, Unavailable
from streamrl.runtime.serve import Output
from streamrl.sandbox import (
    ExecRequest,
    ExecResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    open_sandbox,
)
from streamrl.sandbox.base import (
    ISOLATION_LEVELS,
    NOT_ISOLATED,
    IsolationTooWeak,
    SandboxSession,
    SessionExpired,
    require_isolation,
)

if TYPE_CHECKING:
    from streamrl.sandbox.docker import DockerSandbox

log = structlog.get_logger()
FLEET_METRICS_S = 5.0
"""How often the executor records its Docker backends' fleet counts (:func:`record_fleet`)."""
replace = msgspec.structs.replace


def to_outcome(result: ExecResult | None) -> ExecOutcome:
    """Wire form of a sandbox result; ``None`` (nothing to run) becomes exit code None."""
    if result is None:
        return ExecOutcome(
            exit_code=None, stdout="", stderr="", timed_out=False, oom_killed=False, duration_s=0.0
        )
    return ExecOutcome(
        exit_code=result.exit_code,
        stdout=result.stdout.decode("utf-8", "replace"),
        stderr=result.stderr.decode("utf-8", "replace"),
        timed_out=result.timed_out,
        oom_killed=result.oom_killed,
        duration_s=result.duration_s,
        stdout_dropped=result.stdout_dropped,
        stderr_dropped=result.stderr_dropped,
    )


def from_outcome(outcome: ExecOutcome) -> ExecResult | None:
    if outcome.exit_code is None and not outcome.timed_out and outcome.duration_s == 0.0:
        return None
    return ExecResult(
        exit_code=outcome.exit_code,
        stdout=outcome.stdout.encode(),
        stderr=outcome.stderr.encode(),
        timed_out=outcome.timed_out,
        oom_killed=outcome.oom_killed,
        duration_s=outcome.duration_s,
        stdout_dropped=outcome.stdout_dropped,
        stderr_dropped=outcome.stderr_dropped,
    )


POOLED = frozenset({"docker", "process"})
CONTAINER_BACKENDS = frozenset({"docker"})
"""Backends whose sandboxes come from an image (an item's own image applies to them)."""
"""Backends that keep a warm pool (``pool_size``): ready containers, resident bwrap sandboxes."""


class Sandboxes:
    """The executor's sandbox backends, chosen per domain (see the module docstring)."""

    def __init__(
        self,
        default_backend: str = "process",
        domains: dict[str, DomainSandboxConfig] | None = None,
        limits: dict[str, DomainConfig] | None = None,
        opener: Callable[..., Sandbox] = open_sandbox,
        pool_size: int = 4,
        isolation: str = "auto",
        min_isolation: str = "none",
        docker: dict[str, Any] | None = None,
    ) -> None:
        self.default_backend = default_backend
        self.pool_size = pool_size
        self.docker = docker or {}  # the Docker backend's options (its fleet controls)
        self.isolation = isolation  # the process backend's mode
        self.min_isolation = min_isolation
        self.domains = domains or {}
        self.limits = limits or {}
        self._open = opener
        self._boxes: dict[tuple[str, str], Sandbox] = {}
        self._nursery: trio.Nursery | None = None
        self._up: dict[int, trio.Event] = {}  # id(backend) -> its serve task has started

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[Sandboxes]:
        """These sandboxes with a nursery for their backends' serve tasks; every backend is
        closed (its containers removed) when the ``async with`` ends, however it ends."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield self
            finally:
                try:
                    await self.aclose()
                finally:
                    self._nursery = None

    def choose(self, domain: Any, request: ExecRequest, item_image: str = ""
               ) -> tuple[str, str, ExecRequest]:
        """(backend, image, request with the domain's files and the configured limits).
        ``item_image``: the item's own image (``domains.base.item_image``), which a
        container backend uses instead of the domain's (the process backend has none)."""
        spec = getattr(domain, "sandbox", None)
        cfg = self.domains.get(domain.name, DomainSandboxConfig())
        backend = cfg.backend or getattr(spec, "backend", "") or self.default_backend
        image = cfg.image or getattr(spec, "image", "")
        if item_image and backend in CONTAINER_BACKENDS:
            image = item_image
        limits, tight = request.limits, self.limits.get(domain.name)
        if tight is not None:
            limits = limits.with_overrides(tight.timeout_s, tight.memory_mb)
        files = {**getattr(spec, "files", {}), **request.files}
        return backend, image, dc_replace(request, limits=limits, files=files)

    async def run(self, domain: Any, request: ExecRequest, label: str = "",
                  item_image: str = "") -> ExecResult:
        """One command; ``label`` (the message id) names what the backend uses for it."""
        backend, image, request = self.choose(domain, request, item_image)
        box = await self._served(self._box(domain, backend, image))
        return await box.run(request, label)

    @asynccontextmanager
    async def session(self, domain: Any, label: str, item_image: str = ""
                      ) -> AsyncIterator[SandboxSession]:
        """A session for one member of a multi-turn episode, under the domain's limits."""
        spec = getattr(domain, "sandbox", None)
        base = ExecRequest(argv=[], limits=getattr(spec, "limits", Limits()))
        backend, image, request = self.choose(domain, base, item_image)
        box = await self._served(self._box(domain, backend, image))
        async with box.session(request.limits, label) as session:
            yield session

    async def _served(self, box: Sandbox) -> Sandbox:
        """``box`` with its serve task (if it has one) started in this nursery."""
        serve = getattr(box, "serve", None)
        if serve is None:
            return box
        up = self._up.get(id(box))
        if up is None:
            if self._nursery is None:
                raise RuntimeError("the executor's sandboxes are not open: enter "
                                   "`async with sandboxes.opened()` (or open_sandboxes)")
            up = self._up[id(box)] = trio.Event()
            try:
                await self._nursery.start(serve)
            finally:
                up.set()
        await up.wait()
        return box

    def open_for(self, domains: Iterable[Any]) -> list[str]:
        """Open the backend of each domain that runs code (``NO_SANDBOX`` domains run none),
        each logged and checked against ``min_isolation`` (:class:`IsolationTooWeak`); one
        line per backend: which domains, its isolation, what that does not isolate."""
        users: dict[tuple[str, str], list[str]] = {}
        for domain in domains:
            if getattr(domain, "sandbox", None) is NO_SANDBOX:
                continue
            backend, image, _ = self.choose(domain, ExecRequest(argv=[]))
            self._box(domain, backend, image)
            users.setdefault((backend, image), []).append(domain.name)
        lines = []
        for (backend, image), names in users.items():
            box = self._boxes[(backend, image)]
            isolation = getattr(box, "isolation", "unknown")
            lines.append(f"sandbox {backend} for {', '.join(names)}: {isolation}, "
                         f"{getattr(box, 'detail', '')}; "
                         f"{NOT_ISOLATED.get(isolation, 'isolation unknown')}")
        return lines

    def staged_files(self, domain: Any) -> dict[str, bytes]:
        return dict(getattr(getattr(domain, "sandbox", None), "files", {}))

    def _box(self, domain: Any, backend: str, image: str) -> Sandbox:
        box = self._boxes.get((backend, image))
        if box is not None and getattr(box, "stopped", False):
            # its engine was unreachable (or went away): the retry of this message gets a
            # fresh backend, which connects again, instead of the failure kept for good
            log.warning("sandbox backend stopped, opening a fresh one", backend=backend,
                        image=image, domain=domain.name)
            self._up.pop(id(box), None)
            box = None
        if box is None:
            options: dict[str, Any] = {"image": image} if image else {}
            if backend in POOLED:
                cfg = self.domains.get(domain.name, DomainSandboxConfig())
                options["pool_size"] = cfg.pool_size or self.pool_size
            if backend == "process" and self.isolation != "auto":
                options["isolation"] = self.isolation
            if backend == "docker":
                options.update(self.docker)
            box = self._open(backend, **options)
            self._check_isolation(box, backend, image, domain.name)
            self._boxes[(backend, image)] = box
        return box

    def _check_isolation(self, box: Sandbox, backend: str, image: str, domain: str) -> None:
        """Log how ``box`` isolates (a warning below bwrap); refuse it below the minimum."""
        isolation = getattr(box, "isolation", "unknown")
        fields = {"backend": backend, "image": image, "domain": domain, "isolation": isolation,
                  "detail": getattr(box, "detail", ""),
                  "not_isolated": NOT_ISOLATED.get(isolation, "isolation unknown")}
        weak = isolation not in ISOLATION_LEVELS[ISOLATION_LEVELS.index("bwrap"):]
        (log.warning if weak else log.info)("sandbox backend opened", **fields)
        try:
            require_isolation(isolation, self.min_isolation)
        except IsolationTooWeak:
            log.error("sandbox isolation too weak", min_isolation=self.min_isolation, **fields)
            raise IsolationTooWeak(
                f"refusing to start: executor.min_isolation = {self.min_isolation!r}, but the "
                f"{backend!r} sandbox backend of domain {domain!r} isolates only as "
                f"{isolation!r} ({fields['detail']}). {fields['not_isolated']}. Let bwrap run here "
                f"(unprivileged user namespaces, executor.isolation = 'auto'), use a stronger "
                f"backend (executor.backend), or accept it: executor.min_isolation = {isolation!r}"
            ) from None

    def docker_backends(self) -> list[DockerSandbox]:
        """The Docker backends open now (not stopped), for their fleet counts."""
        return [cast("DockerSandbox", box) for (backend, _), box in self._boxes.items()
                if backend == "docker" and not getattr(box, "stopped", False)]

    async def aclose(self) -> None:
        boxes, self._boxes = list(self._boxes.values()), {}
        self._up.clear()
        with trio.CancelScope(shield=True):
            for box in boxes:
                await box.aclose()


class Executor:
    stage = "executor"
    input_stream = N.ROLLOUTS
    input_type = Rollout

    def __init__(
        self,
        sandboxes: Sandboxes,
        sessions: EpisodeSessions | None = None,
        domain_config: dict[str, DomainConfig] | None = None,
        agents: AgentRunner | None = None,
    ) -> None:
        self.sandboxes = sandboxes
        self.sessions = sessions if sessions is not None else EpisodeSessions(sandboxes)
        self.domain_config = domain_config or {}
        self.agents = agents  # runs agent-driven domains (actors/agents.py)

    def max_turns(self, domain: Any) -> int:
        configured = self.domain_config.get(domain.name, DomainConfig()).max_turns
        return configured or domain.episode.max_turns

    def budget_end(self, domain: Any, item: Any, ep: Episode, sample: Any) -> str:
        """Why a live member must end after this turn ("" if it goes on): the domain's
        episode policy, with this executor's ``max_turns`` (domains/base.py)."""
        policy = dc_replace(domain.episode, max_turns=self.max_turns(domain))
        if not policy.max_tool_calls:
            calls = 0
        elif hasattr(domain, "act"):  # a domain with tools: one result per call made
            calls = sum(len(t.tools) for t in sample.turns)
        else:
            calls = tool_calls(domain, item, [t.text for t in sample.turns])
        return policy.ended_by(ep.turn, calls, now() - ep.started_at if ep.started_at else 0.0)

    async def handle(self, rollout: Rollout) -> list[Output]:
        task = rollout.task
        domain, item = domain_item(task)
        if is_agent_driven(domain):
            return await self.handle_agents(rollout, domain, item)
        if is_multi_turn(domain):
            return await self.handle_turn(rollout, domain, item)
        results: list[ExecResult | None] = [None] * len(rollout.samples)

        unavailable: list[SandboxUnavailable] = []

        async def run_one(i: int) -> None:
            # off the loop: a domain may work on the model's text here (repo_tests applies
            # its patch), and no member's input may hold the other members' work
            request = await trio.to_thread.run_sync(domain.exec_request, item,
                                                    rollout.samples[i].text)
            if request is None:
                return
            try:
                # the message id names the sample's container (found by it while it runs)
                results[i] = await self.sandboxes.run(domain, request, f"{rollout.id}-{i}",
                                                      item_image(domain, item))
            except SandboxUnavailable as exc:  # chained to the backend's failure
                unavailable.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(len(rollout.samples)):
                nursery.start_soon(run_one, i)
        if unavailable:
            raise Unavailable(
                f"sandbox unavailable ({len(unavailable)} samples): {unavailable[0]}"
            ) from unavailable[0]
        outcomes = [to_outcome(r) for r in results]
        log.info("executed", samples=len(outcomes), ok=sum(1 for o in outcomes if o.exit_code == 0))
        return [
            Output(
                N.EXECUTED,
                Executed(
                    id=new_id(),
                    created_at=now(),
                    policy_version=rollout.policy_version,
                    attempt=rollout.attempt,
                    rollout=rollout,
                    outcomes=outcomes,
                ),
            )
        ]

    # -- agent-driven episodes (actors/agents.py) -------------------------------------------

    async def handle_agents(self, rollout: Rollout, domain: Any, item: Any) -> list[Output]:
        """Every member's agent, each on its sandbox session and endpoint session; out: the
        whole episode (``executed``)."""
        task = rollout.task
        if self.agents is None:
            raise Reject(f"domain {domain.name!r} is agent-driven, and this executor serves no "
                         f"OpenAI endpoint (executor.agent_port, generator.engine = 'sglang')")
        try:
            prompt, samples, ended, results = await self.agents.run_group(
                domain, item, task, self.sandboxes)
        except SandboxUnavailable as exc:
            raise Unavailable(f"sandbox unavailable: {exc}") from exc
        except ValueError as exc:  # the members' prompts cannot form one group
            raise Reject(str(exc)) from exc
        outcomes = [to_outcome(r) for r in results]
        ep = Episode(id=task.episode_id, turn=max(len(s.turns) for s in samples),
                     prompt_ids=ids_to_bytes(prompt), ended=ended, outcomes=list(outcomes),
                     started_at=task.created_at)
        trained = [s.weight_version for s in samples if s.tokens]
        version = min(trained) if trained else rollout.policy_version
        final = replace(rollout, task=replace(task, episode=ep), prompt_ids=ids_to_bytes(prompt),
                        samples=samples, policy_version=version)
        log.info("agent episode executed", members=len(samples), ended=ended)
        return [Output(N.EXECUTED, Executed(
            id=new_id(), created_at=now(), policy_version=version, attempt=rollout.attempt,
            rollout=final, outcomes=outcomes))]

    # -- multi-turn episodes (actors/episodes.py) -------------------------------------------

    async def handle_turn(self, rollout: Rollout, domain: Any, item: Any) -> list[Output]:
        """Run this turn of every live member in its session; members that end get their
        final check. Out: the next turn (``tasks``), or the whole episode (``executed``)."""
        task, ep = rollout.task, rollout.task.episode
        if ep is None:
            raise Reject("a multi-turn domain's rollout without episode state")
        if not ep.started_at:  # turn 1: the task is the scheduler's, created as it started
            ep = replace(ep, started_at=task.created_at)
        g = len(rollout.samples)
        st = TurnState(list(rollout.samples), list(ep.ended) or [""] * g,
                       list(ep.outcomes) or [None] * g, list(ep.snapshots) or [b""] * g)
        if not len(st.ended) == len(st.outcomes) == len(st.snapshots) == g:
            raise Reject(f"episode state of {len(st.ended)} members for {g} samples")
        try:
            async with trio.open_nursery() as nursery:
                for i in range(g):
                    if st.outcomes[i] is None:
                        nursery.start_soon(self._member_turn, domain, item, ep, i, st)
            if st.unavailable:
                raise Unavailable(f"sandbox unavailable ({len(st.unavailable)} members): "
                                  f"{st.unavailable[0]}")
        except BaseException:  # error, retry, cancel: a redone turn restores from snapshots
            await self.sessions.release(ep.id)
            raise
        log.info("turn executed", turn=ep.turn, live=st.ended.count(""),
                 ended=[e for e in st.ended if e])
        if st.finished:
            done = replace(ep, samples=[], snapshots=[], ended=st.ended, outcomes=st.outcomes)
            final = replace(rollout, task=replace(task, episode=done), samples=st.samples)
            outcomes = [o for o in st.outcomes if o is not None]
            return [Output(N.EXECUTED, Executed(
                id=new_id(), created_at=now(), policy_version=rollout.policy_version,
                attempt=rollout.attempt, rollout=final, outcomes=outcomes))]
        state = replace(ep, prompt_ids=rollout.prompt_ids, samples=st.samples, ended=st.ended,
                        outcomes=st.outcomes, snapshots=st.snapshots)
        return [Output(N.TASKS, replace(task, id=new_id(), created_at=now(),
                                        policy_version=rollout.policy_version,
                                        attempt=rollout.attempt, episode=state))]

    async def _member_turn(self, domain: Any, item: Any, ep: Episode, i: int,
                           st: TurnState) -> None:
        try:
            held = await self.sessions.checkout(domain, item, ep.id, i, ep.turn, st.snapshots[i])
        except LostSession as exc:
            log.warning("member lost its session", member=i, error=str(exc))
            st.ended[i], st.outcomes[i] = "lost", LOST
            await self.sessions.release(ep.id, i)
            return
        except SessionExpired as exc:
            _end_expired(st, i, exc)
            await self.sessions.release(ep.id, i)
            return
        except SandboxUnavailable as exc:
            st.unavailable.append(str(exc))
            return
        try:
            async with held.lock:
                changed = False
                if not st.ended[i]:
                    text = st.samples[i].text
                    held.turn = -1  # until this turn's commands have run to the end
                    act = getattr(domain, "act", None)
                    if act is not None:  # a domain with tools (domains/agentic.py)
                        action = await act(item, text, held.session,
                                           ep.tool_format or "hermes")
                        held.turn = ep.turn
                        changed, done = action.changed, action.done
                        st.samples[i] = observed(st.samples[i], action.observation, None,
                                                 action.results)
                    else:
                        request = await trio.to_thread.run_sync(domain.exec_request, item, text)
                        result = await held.session.run(request) if request else None
                        held.turn = ep.turn
                        changed = request is not None
                        observation = domain.render_observation(item, result)
                        st.samples[i] = observed(st.samples[i], observation, result)
                        done = domain.is_done(item, text, result)
                    if done:
                        st.ended[i] = "done"
                    else:  # max_turns, max_tool_calls, the episode's wall clock
                        st.ended[i] = self.budget_end(domain, item, ep, st.samples[i])
                if st.ended[i]:
                    check = domain.final_request(item)
                    st.outcomes[i] = to_outcome(await held.session.run(check) if check else None)
                elif changed or ep.turn <= 1:
                    st.snapshots[i] = await self.sessions.snapshot(held)
                # else: nothing ran this turn, the previous turn's snapshot still holds
        except SessionExpired as exc:
            _end_expired(st, i, exc)
        except SandboxUnavailable as exc:
            st.unavailable.append(str(exc))
            return
        if st.ended[i]:
            await self.sessions.release(ep.id, i)


def _end_expired(st: TurnState, i: int, exc: SessionExpired) -> None:
    """Member ``i`` ends: the backend refuses its session for its age (no final check)."""
    log.warning("member's sandbox session expired", member=i, error=str(exc))
    st.ended[i] = "expired"
    st.outcomes[i] = ExecOutcome(exit_code=None, stdout="", stderr=str(exc), timed_out=False,
                                 oom_killed=False, duration_s=0.0)


def open_sandboxes(*args: Any, **options: Any) -> AbstractAsyncContextManager[Sandboxes]:
    """``Sandboxes(*args, **options)``, opened (:meth:`Sandboxes.opened`)."""
    return Sandboxes(*args, **options).opened()


DOCKER_FLEET = ("max_containers", "max_starting", "create_rate_per_s", "create_burst",
                "session_max_s", "sweep_interval_s", "leak_age_s")
"""The Docker backend's fleet controls, set in ``[executor]`` under the same names."""


def sandboxes_for(config: Config) -> Sandboxes:
    """The executor's sandbox backends as ``config`` sets them (none opened yet)."""
    cfg = config.executor
    docker = {name: getattr(cfg, name) for name in DOCKER_FLEET}
    return Sandboxes(cfg.backend, cfg.domains, config.domain, pool_size=cfg.pool_size,
                     isolation=cfg.isolation, min_isolation=cfg.min_isolation, docker=docker)


def record_fleet(sandboxes: Sandboxes, run: str) -> None:
    """Each open Docker backend's fleet counts into the process's metrics."""
    for box in sandboxes.docker_backends():
        metrics.record_sandbox_fleet(run, box.image, box.instance, box.statistics())


def fleet_fields(sandboxes: Sandboxes) -> dict[str, str]:
    """Each open Docker backend's counts as a field of the run's ``fleet`` hash:
    ``<host>/<pid>/<image>`` -> JSON (its statistics, its instance, when)."""
    where = f"{socket.gethostname()}/{os.getpid()}"
    return {f"{where}/{box.image}": json.dumps({**dataclasses.asdict(box.statistics()),
                                                "instance": box.instance, "at": time.time()})
            for box in sandboxes.docker_backends()}


async def publish_fleet(client: RedisClient, names: N.Names, sandboxes: Sandboxes) -> None:
    """:func:`fleet_fields` into the run's ``fleet`` hash, for ``streamrl status`` (a Redis
    error is logged: the counts are for people, the executor goes on)."""
    fields = fleet_fields(sandboxes)
    if not fields:
        return
    try:
        await set_fields(client, names.fleet, fields)
    except (OSError, BrokerError) as exc:
        log.warning("fleet counts not published", error=repr(exc))


async def serve_fleet_metrics(sandboxes: Sandboxes, run: str, *,
                              client: RedisClient | None = None, names: N.Names | None = None,
                              task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """:func:`record_fleet` every :data:`FLEET_METRICS_S`, and with ``client``
    :func:`publish_fleet`."""
    task_status.started()
    while True:
        record_fleet(sandboxes, run)
        if client is not None and names is not None:
            await publish_fleet(client, names, sandboxes)
        await trio.sleep(FLEET_METRICS_S)


def run_domains(config: Config) -> list[Any]:
    """The domains whose rollouts the executor of this run handles (trained and eval)."""
    domains = []
    for name in dict.fromkeys([*config.scheduler.domains, *config.scheduler.eval_domains]):
        try:
            domains.append(get_domain(name))
        except KeyError:  # not installed here: its messages are refused (domain_item)
            log.warning("domain not installed, its sandbox not checked", domain=name)
    return domains


async def isolation_report(config: Config) -> list[str]:
    """What ``up`` prints at start: one line per sandbox backend the run's domains use, its
    isolation and what that does not isolate; :class:`IsolationTooWeak` below
    ``executor.min_isolation`` (nothing is left running either way)."""
    sandboxes = sandboxes_for(config)
    try:
        return sandboxes.open_for(run_domains(config))
    finally:
        await sandboxes.aclose()


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config.executor
    sandboxes = sandboxes_for(ctx.config)
    sessions = EpisodeSessions(sandboxes, snapshots=cfg.episode_snapshots,
                               idle_s=cfg.session_idle_s)
    async with sandboxes.opened(), AsyncExitStack() as stack:  # all closed on exit
        try:
            domains = run_domains(ctx.config)
            sandboxes.open_for(domains)  # refuses to start below min_isolation
            agents = None
            if any(is_agent_driven(d) for d in domains):
                agents = await stack.enter_async_context(open_agent_runner(ctx.config))
            async with trio.open_nursery() as nursery:
                await nursery.start(sessions.serve_idle_release)
                await nursery.start(partial(serve_fleet_metrics, sandboxes, ctx.names.run,
                                            client=ctx.client, names=ctx.names))
                await ctx.serve(
                    Executor(sandboxes, sessions, ctx.config.domain, agents),
                    concurrency=cfg.concurrency,
                    time_limit_s=cfg.time_limit_s,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()
        finally:
            await sessions.aclose()
