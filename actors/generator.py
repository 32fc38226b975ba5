"""Generator: a task becomes a group of sampled completions (``tasks`` -> ``rollouts``).

Each completion records the behaviour logprob of every token and the policy (weights)
version that produced it. The process loads the current policy version before it takes any
work, and follows every ``weights`` event afterwards; the engine applies an update between
two decoding steps, so a completion may span versions: ``Sample.versions`` has the version
of every token (interruptible rollouts, see ``inference/``). A task waits for the version it
was admitted at (:class:`VersionGate`, :meth:`protocol.staleness.StalenessPolicy.wait_version`):
the scheduler admits right after a publish, before the generator has loaded it, and a group
started on the older weights would be one version staler than the admission bound allows.
With ``learner.max_staleness = 0`` (synchronous mode) the wait is strict; otherwise after
``VersionGate.soft_timeout_s`` the task is generated on the weights served.

For a multi-turn domain a task is the next turn of an episode (:meth:`Generator.handle_turn`,
:mod:`actors.episodes`): each live member's last observation goes into its context with the
chat template (not trained), then its next reply is sampled, under the episode id as the
inference session (one server per episode).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
import trio

from streamrl.actors.episodes import generate_turn
from streamrl.config.schema import GeneratorConfig
from streamrl.domains.base import is_agent_driven, is_multi_turn
from streamrl.inference.engine import Completion, Engine
from streamrl.inference.http_engine import HTTPEngine, ServerUnavailable
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Rollout,
    Sample,
    Sampling,
    Task,
    WeightsPublished,
    floats_to_bytes,
    ids_to_bytes,
    new_id,
    now,
)
from streamrl.protocol.staleness import StalenessPolicy
from streamrl.protocol.versions import VersionFollower
from streamrl.queues.streams import EventReader
from streamrl.runtime.context import ActorContext, domain_item
from streamrl.runtime.policies import Reject, Unavailable
from streamrl.runtime.serve import Output

log = structlog.get_logger()


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class VersionGate:
    """The weight version this generator serves, for tasks that should not be generated on
    older weights than they were admitted at. :func:`serve_weight_updates` advances it."""

    def __init__(self, timeout_s: float = 60.0, retry_delay_s: float = 2.0,
                 soft_timeout_s: float = 10.0, shutdown: trio.Event | None = None) -> None:
        self.version = 0
        self.timeout_s = timeout_s
        self.retry_delay_s = retry_delay_s
        self.soft_timeout_s = soft_timeout_s
        self.shutdown = shutdown
        """Once set (the process drains), a task still waiting is released at once
        (:class:`Unavailable`): it has not started, and the weights it waits for may never
        come to this process (the learner stops first)."""
        self._advanced = trio.Event()

    def advance(self, version: int) -> None:
        if version > self.version:
            self.version = version
            self._advanced.set()
            self._advanced = trio.Event()

    async def wait_for(self, version: int, strict: bool = True) -> None:
        """Return once ``version`` or a newer one is served. ``strict``: after ``timeout_s``
        :class:`Unavailable` (the task is retried, then released for redelivery); else after
        ``soft_timeout_s`` return anyway (the task is generated on the weights served)."""
        if self.version >= version:
            return
        with trio.move_on_after(self.timeout_s if strict else self.soft_timeout_s):
            async with trio.open_nursery() as nursery:
                if self.shutdown is not None:
                    nursery.start_soon(_cancel_when_set, self.shutdown, nursery.cancel_scope)
                while self.version < version:
                    await self._advanced.wait()
                nursery.cancel_scope.cancel()
        if self.version >= version:
            return
        if self.shutdown is not None and self.shutdown.is_set():
            raise Unavailable(f"draining: weights v{version} not served (serving "
                              f"v{self.version}), released for another generator")
        if not strict:
            log.warning("weights not served in time, generating on older ones",
                        waited_for=version, serving=self.version)
            return
        raise Unavailable(f"weights v{version} not served yet (serving v{self.version})",
                          delay=self.retry_delay_s)


class Generator:
    stage = "generator"
    input_stream = N.TASKS
    input_type = Task
    gate: VersionGate | None = None
    """Set by :func:`serve`: a task waits for the weights it was admitted at."""
    staleness = StalenessPolicy(max_staleness=0)
    """The run's staleness policy: which version a task waits for (the gate's)."""

    def __init__(self, engine: Engine, tokenizer: Any, retry_delay_s: float = 2.0) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.retry_delay_s = retry_delay_s

    async def generate(
        self, prompts: list[list[int]], sampling: Sampling, session: str
    ) -> list[Completion]:
        if isinstance(self.engine, HTTPEngine):
            try:  # one server per episode (its prefix cache); none: retried, then released
                return await self.engine.generate(prompts, sampling, session=session)
            except ServerUnavailable as exc:
                raise Unavailable(str(exc), delay=self.retry_delay_s) from exc
        return await self.engine.generate(prompts, sampling)

    async def handle(self, task: Task) -> list[Output]:
        if self.gate is not None:
            await self.gate.wait_for(self.staleness.wait_version(task),
                                     strict=self.staleness.strict_wait)
        domain, item = domain_item(task)
        if is_agent_driven(domain):  # its executor runs the agents (actors/agents.py)
            return [Output(N.ROLLOUTS, Rollout(
                id=new_id(), created_at=now(), policy_version=task.policy_version,
                attempt=task.attempt, task=task, prompt_ids=b"", samples=[]))]
        if is_multi_turn(domain):
            return await self.handle_turn(task, domain, item)
        prompt = domain.render_prompt(item, self.tokenizer)
        prompts = [prompt] * task.group_size
        completions = await self.generate(prompts, task.sampling, task.episode_id)
        samples = [
            Sample(
                tokens=ids_to_bytes(c.tokens),
                logprobs=floats_to_bytes(c.logprobs),
                text=c.text,
                finish_reason=c.finish_reason,
                weight_version=c.weight_version,
                versions=ids_to_bytes(c.token_versions()),
            )
            for c in completions
        ]
        version = min(s.weight_version for s in samples)
        rollout = Rollout(
            id=new_id(),
            created_at=now(),
            policy_version=version,
            attempt=task.attempt,
            task=task,
            prompt_ids=ids_to_bytes(prompt),
            samples=samples,
        )
        log.info(
            "generated",
            samples=len(samples),
            policy_version=version,
            tokens=sum(len(c.tokens) for c in completions),
        )
        return [Output(N.ROLLOUTS, rollout)]

    async def handle_turn(self, task: Task, domain: Any, item: Any) -> list[Output]:
        """The next turn of a multi-turn episode (actors/episodes.py)."""
        ep, g = task.episode, task.group_size
        if ep is not None and not len(ep.samples) == len(ep.ended) == g:
            raise Reject(f"episode state of {len(ep.samples)} contexts and {len(ep.ended)} "
                         f"members for a group of {g}")
        budget = domain.episode.max_total_tokens
        state, prompt_ids, samples = await generate_turn(
            task, domain, item, self.tokenizer, self.generate, budget
        )
        version = min(s.weight_version for s in samples)
        ep = state.episode
        log.info("turn generated", turn=ep.turn if ep else 0,
                 live=ep.ended.count("") if ep else 0)
        return [Output(N.ROLLOUTS, Rollout(
            id=new_id(), created_at=now(), policy_version=version, attempt=task.attempt,
            task=state, prompt_ids=prompt_ids, samples=samples))]


async def serve_weight_updates(
    ctx: ActorContext, engine: Engine, gate: VersionGate | None = None, *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the current policy version, report ready, then follow every new version (and
    advance ``gate`` to each version served). An event is a claim: one far ahead of the
    run's chain of versions is refused (:mod:`protocol.versions`), and weights an event
    names that cannot be loaded (no such path, not this model's weights) are logged while
    the generator keeps serving the weights it has; it tries again on the next event (at
    start, the newest of the last few events whose weights load)."""
    reader = EventReader(ctx.client, ctx.names, N.WEIGHTS, block_ms=ctx.config.queues.block_ms)
    follower = VersionFollower()
    try:
        await follower.catch_up(reader)
        for event in reversed(follower.taken[-3:]):
            if await _load(engine, event, "weights loaded"):
                break
        if gate is not None:
            gate.advance(engine.weight_version)
        task_status.started()
        while True:
            taken = follower.take_all(await reader.read_events(WeightsPublished))
            newest = max(taken, key=lambda e: e.version, default=None)
            if newest is not None and newest.version > engine.weight_version:
                await _load(engine, newest, "weights updated")
                if gate is not None:  # a server that missed it loads it before work
                    gate.advance(engine.weight_version)
    finally:
        reader.close()


async def _load(engine: Engine, event: WeightsPublished, done: str) -> bool:
    """Have ``engine`` serve ``event``'s weights; False if they could not be loaded (the
    engine keeps the weights it serves). No server up (SGLang) counts as loaded: the
    version stays the target, each server loads it when it is back."""
    try:
        await engine.update_weights(event.path, event.version)
    except ServerUnavailable as exc:
        log.warning("weights not loaded", policy_version=event.version, error=str(exc))
    except Exception as exc:  # the event's path is a claim: what it names may be anything
        from streamrl.inference.transformers_engine import EngineClosed  # loaded if raised

        if isinstance(exc, EngineClosed):
            raise
        log.error("weights not loaded: keeping the weights served", policy_version=event.version,
                  path=event.path[:300], serving=engine.weight_version, error=repr(exc)[:500])
        return False
    else:
        log.info(done, policy_version=event.version)
    return True


def open_engine(cfg: GeneratorConfig, model_dir: Any) -> AbstractAsyncContextManager[Engine]:
    """The engine ``generator.engine`` names: in-process transformers, SGLang servers (or
    serve-model), or vLLM servers."""
    if cfg.engine == "vllm":
        from streamrl.inference.engine import model_stop_token_ids
        from streamrl.inference.vllm_client import open_vllm_engine
        from streamrl.models import load_tokenizer, vocab_size

        if not (cfg.server_urls or cfg.router_url):
            raise ValueError("generator.engine 'vllm' needs server_urls or router_url (streamrl "
                             "up starts servers and fills them in)")
        tokenizer = load_tokenizer(model_dir)
        return open_vllm_engine(
            cfg.server_urls, tokenizer=tokenizer,
            stop_token_ids=model_stop_token_ids(model_dir, tokenizer),
            vocab_size=vocab_size(model_dir), router_url=cfg.router_url,
            health_interval_s=cfg.health_interval_s, request_timeout_s=cfg.request_timeout_s,
            interrupt=cfg.interrupt,
        )
    if cfg.engine == "sglang":
        from streamrl.inference.sglang_client import open_sglang_engine
        from streamrl.models import vocab_size

        return open_sglang_engine(
            cfg.server_urls, router_url=cfg.router_url, health_interval_s=cfg.health_interval_s,
            request_timeout_s=cfg.request_timeout_s, pause_mode=cfg.pause_mode,
            interrupt=cfg.interrupt, vocab_size=vocab_size(model_dir),
        )
    from streamrl.inference.transformers_engine import open_transformers_engine

    return open_transformers_engine(model_dir, max_batch=cfg.max_batch,
                                    threads=cfg.threads or None, dtype=cfg.dtype)


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from streamrl.models import load_tokenizer, resolve_model

    cfg = ctx.config.generator
    model_dir = resolve_model(ctx.config.model.spec)
    tokenizer = load_tokenizer(model_dir)
    async with (
        open_engine(cfg, model_dir) as engine,
        trio.open_nursery() as nursery,
    ):
        log.info("engine open", engine=cfg.engine,
                 dtype=str(getattr(engine, "dtype", "the server's")).removeprefix("torch."))
        staleness = ctx.staleness()
        gate = VersionGate(shutdown=ctx.shutdown)
        await nursery.start(serve_weight_updates, ctx, engine, gate)
        generator = Generator(engine, tokenizer)
        generator.gate, generator.staleness = gate, staleness
        await ctx.serve(
            generator,
            concurrency=cfg.concurrency,
            time_limit_s=cfg.time_limit_s,
            task_status=task_status,
        )
        nursery.cancel_scope.cancel()
