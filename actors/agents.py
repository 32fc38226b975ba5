"""Agent-driven episodes: an external agent (anything written against an OpenAI client) per
member, trained unchanged.

A domain with ``[domain.<name>.agent] command = [...]`` (domains/agentic.py
:class:`~streamrl.domains.agentic.AgentDomain`) is run by the executor in one step per
group, not turn by turn: the generator passes its task through untouched, and for every
member the executor (:class:`AgentRunner`)

1. opens the member's sandbox session with the item's repository (``session_files``);
2. opens a session on its OpenAI-compatible endpoint (inference/openai_api.py) with the
   domain's budgets (``max_turns``: model calls, ``max_total_tokens``, ``max_tool_calls``,
   ``max_new_tokens`` per call, ``episode_timeout_s`` or ``agent.timeout_s``: the wall
   clock) and the standard tools on that sandbox session served next to the model
   (``/sessions/<id>/tools``);
3. runs the agent's command next to the sandbox, with ``OPENAI_BASE_URL``,
   ``OPENAI_API_KEY``, ``OPENAI_MODEL``, ``STREAMRL_TOOLS_URL`` and ``STREAMRL_SESSION`` in
   a clean environment (``PATH``, ``HOME``, ``LANG`` and ``agent.env``: never the
   executor's own variables, which hold its Redis credentials), killed when the wall clock
   runs out;
4. when the agent exits (or is killed), closes the endpoint session, runs the domain's
   final check in the sandbox (the hidden tests over the work dir as the agent left it)
   and takes the member's sample from the session's record.

Every call samples at the task's ``temperature`` and ``top_p`` (the session pins them; what
the agent asks for is not used), since the learner recomputes the policy's logprobs at
those. The sample is exactly what the engine produced: the longest chain of the session's calls
(:meth:`~streamrl.inference.agent_sessions.Session.chains`: the first prompt, each
completion with its logprobs and versions, mask 1, and the tokens each later call added,
mask 0); a member's prompt beyond the group's common prefix (``Rollout.prompt_ids``) leads
its tokens, masked. One turn per call (its text; the tokens the next call added, decoded,
as the observation). ``ended``: ``done`` (the agent called ``finish``), ``agent_exit`` (it
exited without), ``agent_failed`` (non-zero exit), ``wall_clock`` (killed). An agent that
restarted its conversation leaves several chains; only the longest is trained (the count
is logged). The verifier scores the final check as for any tool domain.

Not covered: the agent runs as the executor's user, next to the sandbox, not inside it
(sandboxes cannot reach the endpoint: bwrap unshares the network, Docker sandboxes use
network ``none``); its actions on the work dir go through the tools, which keep to the work
dir. An agent is operator-chosen code, trusted as the executor is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import trio

from streamrl.domains.base import item_image
from streamrl.inference.agent_sessions import Budget, Call, Chain, Sessions
from streamrl.net import free_ports
from streamrl.protocol.messages import Sample, Task, Turn, floats_to_bytes, ids_to_bytes
from streamrl.sandbox.base import ExecResult

log = structlog.get_logger()

MODEL = "streamrl-policy"
API_KEY = "streamrl"  # the client needs one; the endpoint does not check it
LOG_CHARS = 2000


@dataclass
class Member:
    """What one member's agent left: its calls and chains, why it ended, the final check."""

    calls: list[Call] = field(default_factory=list)
    chains: list[Chain] = field(default_factory=list)
    ended: str = ""
    result: ExecResult | None = None


class AgentRunner:
    """Runs agent-driven groups against ``sessions`` (served at ``base_url`` by the caller,
    under the model name ``model``)."""

    def __init__(self, sessions: Sessions, base_url: str, model: str = MODEL) -> None:
        self.sessions = sessions
        self.base_url = base_url.rstrip("/")
        self.model = model

    def budget(self, domain: Any, task: Task) -> Budget:
        p = domain.episode
        return Budget(max_total_tokens=p.max_total_tokens, max_calls=p.max_turns,
                      wall_clock_s=self.timeout_s(domain), max_tool_calls=p.max_tool_calls,
                      max_new_tokens=task.sampling.max_new_tokens)

    @staticmethod
    def timeout_s(domain: Any) -> float:
        return float(domain.episode.timeout_s or domain.agent.timeout_s)

    async def run_group(self, domain: Any, item: Any, task: Task, source: Any
                        ) -> tuple[list[int], list[Sample], list[str], list[ExecResult | None]]:
        """Every member's episode at once: ``(prompt ids, samples, ended, final results)``.
        Raises what the sandbox raises (``SandboxUnavailable``): the message is retried and
        the group redone from scratch (nothing of it was published)."""
        members = [Member() for _ in range(task.group_size)]
        async with trio.open_nursery() as nursery:
            for i in range(task.group_size):
                nursery.start_soon(self.run_member, domain, item, task, i, source, members[i])
        prompt, samples = assemble(members, domain, item, self.sessions.tokenizer)
        return prompt, samples, [m.ended for m in members], [m.result for m in members]

    async def run_member(self, domain: Any, item: Any, task: Task, i: int, source: Any,
                         member: Member) -> None:
        label = f"{task.episode_id[:16]}-{i}-{secrets.token_hex(3)}"
        async with source.session(domain, label=label,
                                  item_image=item_image(domain, item)) as box:
            await box.put_files({**source.staged_files(domain), **domain.session_files(item)})
            sid = f"{task.episode_id}-{i}-{secrets.token_hex(8)}"  # unguessable by the others
            session = self.sessions.create(sid, self.budget(domain, task))
            session.pin = task.sampling  # what the learner assumes the samples were drawn at
            toolbox = domain.toolbox(box)
            session.tools = toolbox
            try:
                ended = await self.run_agent(domain, sid)
                self.sessions.close(sid)
                member.ended = "done" if toolbox.finished else ended
                check = domain.final_request(item)
                member.result = await box.run(check) if check is not None else None
            finally:
                self.sessions.drop(sid)
            member.calls, member.chains = list(session.calls), session.chains()
        log.info("agent member ended", episode=task.episode_id, member=i, ended=member.ended,
                 calls=len(member.calls), chains=len(member.chains),
                 tool_calls=session.tool_calls)

    async def run_agent(self, domain: Any, sid: str) -> str:
        agent = domain.agent
        env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
               "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8", **agent.env,
               "OPENAI_BASE_URL": f"{self.base_url}/sessions/{sid}/v1",
               "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": self.model,
               "STREAMRL_TOOLS_URL": f"{self.base_url}/sessions/{sid}/tools",
               "STREAMRL_SESSION": sid}
        with tempfile.TemporaryDirectory(prefix="streamrl-agent-") as tmp:
            stderr = Path(tmp) / ".agent-stderr"
            with stderr.open("wb") as err:
                code = await _run_killable(list(agent.command), env, agent.workdir or tmp,
                                           err, self.timeout_s(domain))
            tail = stderr.read_bytes()[-LOG_CHARS:].decode("utf-8", "replace")
        if code is None:
            log.warning("agent killed at its wall clock", session=sid,
                        timeout_s=self.timeout_s(domain), stderr=tail)
            return "wall_clock"
        if code != 0:
            log.warning("agent failed", session=sid, exit_code=code, stderr=tail)
            return "agent_failed"
        return "agent_exit"


def _kill_group(pid: int) -> None:
    """Kill the process group of ``pid`` (the agent's own session: all it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _run_killable(argv: list[str], env: dict[str, str], cwd: str, err: Any,
                        timeout_s: float) -> int | None:
    """Run ``argv`` in a session of its own; its exit code, or None when it ran past
    ``timeout_s``. Every process of its session is killed once it exits or is cancelled."""

    async def kill(process: trio.Process) -> None:
        _kill_group(process.pid)

    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(
            trio.run_process, argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err, check=False, start_new_session=True,
            deliver_cancel=kill))
        try:
            with trio.move_on_after(timeout_s) as scope:
                await process.wait()
            if scope.cancelled_caught:
                nursery.cancel_scope.cancel()
                return None
            return int(process.returncode or 0)
        finally:
            _kill_group(process.pid)


def common_prefix(seqs: Sequence[Sequence[int]]) -> list[int]:
    if not seqs:
        return []
    first = list(seqs[0])
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        k = next((j for j in range(n) if s[j] != first[j]), n)
        n = k
    return first[:n]


def assemble(members: Sequence[Member], domain: Any, item: Any, tokenizer: Any
             ) -> tuple[list[int], list[Sample]]:
    """The group's prompt (the common prefix of the members' first prompts; the domain's
    own prompt when no member made a call) and one sample per member."""
    chosen = [max(m.chains, key=lambda c: (sum(c.mask), len(c.tokens))) if m.chains else None
              for m in members]
    prompts = [c.prompt_ids for c in chosen if c is not None]
    if not prompts:
        prefix = [int(t) for t in domain.render_prompt(item, tokenizer)]
    else:
        prefix = common_prefix(prompts)
        if not prefix:  # the same chat template starts every prompt alike
            raise ValueError("the members' prompts share no first token")
    samples = []
    for m, chain in zip(members, chosen, strict=True):
        if chain is None:
            samples.append(Sample(tokens=b"", logprobs=b"", text="", finish_reason="stop",
                                  weight_version=0, mask=b"", versions=b""))
            continue
        head = chain.prompt_ids[len(prefix):]
        first = chain.versions[0] if chain.versions else 0
        tokens = np.asarray([*head, *chain.tokens], np.int32)
        mask = np.asarray([0] * len(head) + chain.mask, np.uint8)
        logprobs = np.asarray([0.0] * len(head) + chain.logprobs, np.float32)
        versions = np.asarray([first] * len(head) + chain.versions, np.int32)
        calls = [m.calls[k] for k in chain.calls]
        turns = []
        for k, call in enumerate(calls):
            after = calls[k + 1] if k + 1 < len(calls) else None
            observation = tokenizer.decode(after.prompt_ids[after.new_from:],
                                           skip_special_tokens=False) if after else ""
            turns.append(Turn(text=call.text, observation=observation))
        model_versions = versions[mask == 1]
        samples.append(Sample(
            tokens=ids_to_bytes(tokens), logprobs=floats_to_bytes(logprobs),
            text=calls[-1].text, finish_reason=calls[-1].finish_reason,
            weight_version=int(model_versions.min()) if len(model_versions) else first,
            mask=mask.tobytes(), turns=turns, versions=ids_to_bytes(versions)))
    return prefix, samples


@asynccontextmanager
async def open_agent_runner(config: Any) -> AsyncIterator[AgentRunner]:
    """An :class:`AgentRunner` over the run's inference servers (the generator's engine
    settings: ``generator.engine = 'sglang'``), its endpoint served on
    ``executor.agent_host:agent_port`` for as long as the context is open."""
    from streamrl.actors.generator import open_engine
    from streamrl.inference.openai_api import serve_openai
    from streamrl.models import load_tokenizer, resolve_model

    model_dir = resolve_model(config.model.spec)
    tokenizer = load_tokenizer(model_dir)
    host = config.executor.agent_host
    port = config.executor.agent_port or free_ports(host, 1)[0]
    async with open_engine(config.generator, model_dir) as engine, trio.open_nursery() as n:
        sessions = Sessions.for_engine(engine, tokenizer)
        await n.start(partial(serve_openai, sessions, model=MODEL, host=host, port=port))
        yield AgentRunner(sessions, f"http://{host}:{port}")
        n.cancel_scope.cancel()
