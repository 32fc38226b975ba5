"""Repository tasks worked with the standard tool set, turn by turn through the actors.

``[domain.<name>.tools] enabled = true`` makes a declared ``repo_tests`` domain a
:class:`~streamrl.domains.base.MultiTurnDomain` whose turns are tool calls
(:func:`tools_domain`):

- the prompt: the table's conversation (``[domain.<name>.prompt]``, with ``tools.system``
  or :data:`DEFAULT_SYSTEM` as its system message) with the standard tools declared through
  ``inference.chat.prompt_ids``: the chat template's own ``tools=`` where it renders tools,
  else the documented hermes-style system prompt. Calls are parsed in the model's format
  (``inference.chat.tool_format``, found by the generator at turn 1 and carried in
  ``Episode.tool_format``): hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (also wherever the fallback prompt is used) or llama3's JSON reply; mistral's, whose
  marker is a special token the decoded reply drops, is refused at the first prompt;
- a member's session starts with the item's repository (``session_files``) and nothing
  else: no harness, no hidden test is ever in the work dir before the final check;
- every turn (:meth:`ToolDomain.act`, run by the executor in the member's session): the
  reply's calls run in order through :class:`~streamrl.domains.tools.standard.StandardTools`
  and each result goes back as a ``tool`` message (``Turn.tools``; the generator renders
  them with ``inference.chat.tool_results_ids``, masked out of the loss). A reply without a
  call gets :data:`NO_CALL` as a user message; a malformed call, an unknown tool or bad
  arguments get an error result; nothing the model writes raises;
- the member is done when it calls ``finish``; otherwise ``max_turns`` (default
  :data:`~streamrl.config.schema.TOOL_TURNS`), ``max_tool_calls`` (each call counts),
  ``max_total_tokens`` and ``episode_timeout_s`` end it;
- the reward: the kind's final check of the work dir as the model left it
  (``RepoTests.final_request`` / ``score_final``: the hidden ``FAIL_TO_PASS`` and
  ``PASS_TO_PASS`` tests over a fresh copy, the original conftests and test files restored).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from streamrl.config.schema import TOOL_TURNS, DomainConfig
from streamrl.domains.base import EpisodePolicy
from streamrl.domains.template import chat_messages
from streamrl.domains.tools.standard import TOOLS, StandardTools, ToolLimits
from streamrl.inference.chat import (
    ParsedReply,
    ToolCall,
    ToolFormat,
    parse_tool_calls,
    prompt_ids,
    tool_format,
)
from streamrl.protocol.messages import ToolReply
from streamrl.sandbox.base import ExecRequest, ExecResult, SandboxSession

DEFAULT_SYSTEM = (
    "You are fixing an issue in the Python repository that is your current directory. Use "
    "the tools: list_files and read_file to look at the code, apply_patch or write_file to "
    "change it, run_tests to run its tests, and finish when the issue is fixed. Change the "
    "code, not the tests. Call the tools in <tool_call></tool_call> tags.")
NO_CALL = ("No tool call found in your reply. Call a tool: <tool_call>{\"name\": ..., "
           "\"arguments\": {...}}</tool_call>; call finish when you are done.")
READ_ONLY = frozenset({"read_file", "list_files", "finish"})


@dataclass(frozen=True)
class Action:
    """What one turn's calls did: each call's result, their rendering for people, whether
    the model called ``finish``, and whether anything may have changed the work dir."""

    results: list[ToolReply]
    observation: str
    done: bool
    changed: bool


def render_results(results: list[ToolReply]) -> str:
    """The turn's tool results as one text (replay, logs; the model gets tool messages)."""
    return "\n".join(f"[{r.name or 'refused'}{' error' if r.error else ''}] {r.content}"
                     for r in results)


class ToolDomain:
    """A declared ``repo_tests`` domain as a multi-turn one with the standard tools."""

    tools = TOOLS

    def __init__(self, base: Any, cfg: DomainConfig) -> None:
        self.base, self.opts = base, cfg.tools
        self.verifier = base.verifier
        self.cfg = cfg
        self.name = base.name
        self.item_type = base.item_type
        self.default_max_new_tokens = base.default_max_new_tokens
        # sessions start with the repository only; the final check brings its own files
        self.sandbox = replace(base.sandbox, files={})
        self.episode = EpisodePolicy(multi_turn=True, max_turns=cfg.max_turns or TOOL_TURNS)
        self.limits = ToolLimits(output_chars=self.opts.output_chars,
                                 run_timeout_s=self.opts.run_timeout_s,
                                 test_timeout_s=self.opts.test_timeout_s)

    def load_items(self, split: str) -> list[Any]:
        return self.base.load_items(split)  # type: ignore[no-any-return]

    def render_prompt(self, item: Any, tokenizer: Any) -> list[int]:
        if tool_format(tokenizer) == "mistral":
            raise ValueError(f"domain {self.name!r}: this model writes tool calls after the "
                             f"special token [TOOL_CALLS], which the decoded replies drop; "
                             f"tool domains parse the hermes and llama3 formats")
        messages = chat_messages(self.cfg.prompt, item, self.opts.system or DEFAULT_SYSTEM)
        return prompt_ids(tokenizer, messages, self.tools)

    def session_files(self, item: Any) -> dict[str, bytes]:
        return self.verifier.session_files(item)  # type: ignore[no-any-return]

    def item_image(self, item: Any) -> str:
        return self.verifier.item_image(item)  # type: ignore[no-any-return]

    def parse(self, text: str, fmt: ToolFormat = "hermes") -> ParsedReply:
        return parse_tool_calls(text, self.tools, fmt)

    async def act(self, item: Any, text: str, session: SandboxSession,
                  fmt: ToolFormat = "hermes") -> Action:
        """Run the reply's calls (written in ``fmt``: the model's, ``Episode.tool_format``)
        in ``session``. Raises only what the sandbox raises (``SandboxUnavailable``).
        Every call, refused ones too, gets one result: ``max_tool_calls`` counts them."""
        reply = self.parse(text, fmt)
        if not reply.calls:
            return Action([], NO_CALL, done=False, changed=False)
        tools = StandardTools(session, test_command=self.opts.test_command, limits=self.limits)
        answered = await tools.answer(reply)
        results = [ToolReply(call_id=r.call_id, name=r.name, content=r.content, error=r.error)
                   for r in answered]
        changed = any(c.name not in READ_ONLY and not r.error
                      for c, r in zip(reply.calls, results, strict=True))
        return Action(results, render_results(results), done=tools.finished, changed=changed)

    # the MultiTurnDomain hooks the turn loop does not use for a tool domain (act does)
    def exec_request(self, item: Any, completion_text: str) -> ExecRequest | None:
        return None

    def render_observation(self, item: Any, result: ExecResult | None) -> str:
        return ""

    def is_done(self, item: Any, turn_text: str, result: ExecResult | None = None) -> bool:
        return False

    def final_request(self, item: Any) -> ExecRequest | None:
        return self.verifier.final_request(item)  # type: ignore[no-any-return]

    def score(self, item: Any, completion_text: str, result: ExecResult | None) -> float:
        return float(self.verifier.score_final(item, result))


class ToolBox:
    """The standard tools of one member's session, called by name over HTTP (the OpenAI
    endpoint's ``/sessions/<id>/tools``: inference/openai_api.py) by an external agent."""

    def __init__(self, tools: StandardTools) -> None:
        self.tools = tools
        self.calls = 0

    @property
    def finished(self) -> bool:
        return self.tools.finished

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.tools]

    async def call(self, name: str, arguments: Any) -> dict[str, Any]:
        self.calls += 1
        call = ToolCall(id=f"http_{self.calls}", name=name,
                        arguments=arguments if isinstance(arguments, dict) else {})
        result = await self.tools.call(call)
        return {"content": result.content, "error": result.error,
                "finished": self.tools.finished}


class AgentDomain(ToolDomain):
    """A tool domain whose episodes an external agent drives (``[domain.<name>.agent]``):
    the executor runs each member's agent against the OpenAI endpoint and the tools over
    HTTP (actors/agents.py); the generator passes its tasks through untouched."""

    def __init__(self, base: Any, cfg: DomainConfig) -> None:
        super().__init__(base, cfg)
        self.agent = cfg.agent

    def toolbox(self, session: SandboxSession) -> ToolBox:
        return ToolBox(StandardTools(session, test_command=self.opts.test_command,
                                     limits=self.limits))


def tools_domain(domain: Any, cfg: DomainConfig) -> ToolDomain:
    """``domain`` (a declared ``repo_tests`` one) worked with the standard tools, by the
    built-in turn loop or (``agent.command``) an external agent; ``ValueError`` for any
    other domain."""
    from streamrl.domains.kinds.repo_tests import RepoTests

    if not isinstance(getattr(domain, "verifier", None), RepoTests):
        if cfg.agent.command:
            raise ValueError(f"only a declared domain of kind 'repo_tests' can be agent-driven "
                             f"(agent.command: the agent works the item's repository through "
                             f"the standard tools), not {_kind(cfg)}")
        raise ValueError("tools.enabled needs a declared domain of kind 'repo_tests'")
    return AgentDomain(domain, cfg) if cfg.agent.command else ToolDomain(domain, cfg)


def _kind(cfg: DomainConfig) -> str:
    return f"one of kind {cfg.kind!r}" if cfg.kind else "an installed domain"
