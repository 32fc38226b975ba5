"""``streamrl replay``: select trajectories from the live streams and the archive, then show,
rescore, retrain or export them.

- selection (:class:`Query`): stream entry id range (live), creation time range, domain,
  group mean reward range, policy version, episode ids; live entries and archived rows are
  merged and deduplicated by trajectory id (the archive is at-least-once);
- ``show``: an episode turn by turn: the prompt as the model saw it (the recorded prompt ids
  decoded by the run's tokenizer: chat template, system prompt, worked examples, response
  prefix; the item's own prompt, said so, where the tokenizer cannot be loaded), then per
  sample the turn the domain ran and scored (a declared domain's ``response_prefix`` and
  the model output), the sandbox's exit code and stdout/stderr, the reward, the versions;
  ``show`` and ``list`` (live) also give the groups the verifier could not judge (its
  ``unjudged`` dead letters: never trained), marked with why and with no reward
  (:func:`select_unjudged`);
- ``rescore``: the domain's verifier (as the code is now) run again on the recorded outputs
  and sandbox outcomes; prints every reward that changed (old -> new);
- ``retrain``: one learner step reproduced: the weights of version N-1 (the base model for
  N = 1), the groups the ledger says step N trained, in the ledger's order, the learner's
  training config; loss and gradient norm are compared with the step's recorded metrics.
  Both are computed before the optimiser step, so the optimiser state does not matter;
- ``export``: JSONL (one decoded trajectory per line, token arrays as lists) and Parquet
  (the archive's columns); ``--sft FILE --sft-min-reward X``: rejection sampling / expert
  iteration, every sample of a selected training group whose own reward is at least X, as a
  token row of an SFT data set (:func:`sft_rows`; ``learner.mode = "sft"`` trains on it).
Reads only; never acknowledges or changes a stream. On a sharded run (``queues.shards``)
the live streams of every shard are read; their entry ids are shown shard-qualified
(``<shard>:<entry id>``, as the archive stores them) and ``--from-id``/``--to-id`` bound the
entry id within each shard.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from streamrl.actors.archiver import COLUMNS, archive_dir, row, write_parquet
from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Executed,
    StepMetrics,
    Trajectory,
    bytes_to_floats,
    bytes_to_ids,
    training_task,
)
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import MessageError, decode
from streamrl.queues.operations import read_range, resolve_payloads
from streamrl.queues.payloads import PayloadLimits
from streamrl.queues.shards import qualify, split_qualified


def _id_key(entry_id: str, default_seq: int) -> tuple[int, int]:
    ms, _, seq = split_qualified(entry_id)[1].partition("-")
    return int(ms), int(seq) if seq else default_seq


@dataclass(frozen=True)
class Query:
    streams: tuple[str, ...] = (N.TRAJECTORIES, N.EVALS)
    from_id: str = "-"
    to_id: str = "+"
    since: float | None = None
    until: float | None = None
    domain: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    policy_version: int | None = None
    episodes: frozenset[str] = field(default_factory=frozenset)
    trajectory_ids: frozenset[str] = field(default_factory=frozenset)
    limit: int = 0

    def in_id_range(self, entry_id: str) -> bool:
        """Whether a stream entry id is within ``from_id``..``to_id`` (as XRANGE reads them:
        ``-``/``+`` open, a bare millisecond time covers every sequence number)."""
        key = _id_key(entry_id, 0)
        low = self.from_id == "-" or key >= _id_key(self.from_id, 0)
        return low and (self.to_id == "+" or key <= _id_key(self.to_id, 2**63))

    def matches(self, t: Trajectory) -> bool:
        task = t.rollout.task
        mean = sum(t.rewards) / len(t.rewards) if t.rewards else 0.0
        checks = (
            self.since is None or t.created_at >= self.since,
            self.until is None or t.created_at < self.until,
            self.domain is None or task.domain == self.domain,
            self.min_reward is None or mean >= self.min_reward,
            self.max_reward is None or mean <= self.max_reward,
            self.policy_version is None or t.policy_version == self.policy_version,
            not self.episodes or t.episode_id in self.episodes,
            not self.trajectory_ids or t.id in self.trajectory_ids,
        )
        return all(checks)


@dataclass(frozen=True)
class Found:
    stream: str
    entry_id: str
    source: str  # "live", "archive", or "dead" (a group the verifier could not judge)
    trajectory: Trajectory
    payload: bytes
    unjudged: str = ""
    """Why the verifier could not judge the group (its dead letter's reason: each sample
    and why); "": judged. An unjudged group's ``rewards`` are placeholders (0.0)."""


async def select_live(client: RedisClient, names: N.Names, query: Query) -> list[Found]:
    out = []
    for stream, layout in [(s, n) for s in query.streams for n in names.layouts()]:
        key = layout.stream(stream)
        low, high = split_qualified(query.from_id)[1], split_qualified(query.to_id)[1]
        rows = await read_range(client, key, low, high)
        entries = [(e, f.get(b"d")) for e, f in rows]
        resolved = await resolve_payloads(client, entries, PayloadLimits())
        for (entry_id, _), r in zip(entries, resolved, strict=True):
            if layout.shard is not None:
                entry_id = qualify(layout.shard, entry_id)
            if r.payload is None:
                continue
            try:
                t = decode(r.payload, Trajectory)
            except MessageError:
                continue
            if query.matches(t):
                out.append(Found(stream, entry_id, "live", t, r.payload))
    return out


async def select_unjudged(client: RedisClient, names: N.Names, query: Query) -> list[Found]:
    """The groups the verifier could not judge (its dead letters of cause ``unjudged``,
    :mod:`streamrl.actors.verifier`; never trained), oldest first, as trajectories with
    placeholder rewards and the letter's reason in :attr:`Found.unjudged`. None where the
    query is for other streams than training groups' or bounds the reward (they have none);
    at most ``query.limit`` (0: all)."""
    from streamrl.cli.dlq import Selection, full_payload, list_dead

    out: list[Found] = []
    if (N.TRAJECTORIES not in query.streams or query.min_reward is not None
            or query.max_reward is not None):
        return out
    for entry in await list_dead(client, names, Selection(stream=N.EXECUTED, error="^unjudged: ")):
        try:
            payload = await full_payload(client, names, entry)
            executed = decode(payload, Executed)
        except (LookupError, MessageError):
            continue
        t = Trajectory(id=executed.id, created_at=executed.created_at,
                       policy_version=executed.policy_version, attempt=executed.attempt,
                       rollout=executed.rollout, outcomes=executed.outcomes,
                       rewards=[0.0] * len(executed.outcomes))
        reason = entry.error.removeprefix("unjudged: ")
        if query.matches(t) and query.in_id_range(entry.dead_id):
            out.append(Found(N.EXECUTED, entry.dead_id, "dead", t, payload, reason))
    out.sort(key=lambda f: f.trajectory.created_at)
    return out[: query.limit] if query.limit else out


def select_archive(root: Path, query: Query) -> list[Found]:
    """Rows of every archive file under ``root`` that match (filters pushed down to Parquet
    where a column exists, the rest on the decoded message)."""
    import pyarrow.parquet as pq

    out = []
    for stream in query.streams:
        for path in sorted((root / stream).glob("*.parquet")):
            table = pq.read_table(path, columns=["entry_id", "payload"])
            for entry_id, payload in zip(
                table.column("entry_id").to_pylist(), table.column("payload").to_pylist(),
                strict=True,
            ):
                if not query.in_id_range(entry_id):
                    continue
                t = decode(payload, Trajectory)
                if query.matches(t):
                    out.append(Found(stream, entry_id, "archive", t, payload))
    return out


async def select(
    client: RedisClient | None, names: N.Names, query: Query, archive: Path | None
) -> list[Found]:
    """Live entries first, then archived ones not seen live; by creation time; deduplicated
    by trajectory id; at most ``query.limit`` (0: all)."""
    found = await select_live(client, names, query) if client is not None else []
    if archive is not None and archive.exists():
        found += select_archive(archive, query)
    seen: set[str] = set()
    unique = []
    for f in found:
        if f.trajectory.id not in seen:
            seen.add(f.trajectory.id)
            unique.append(f)
    unique.sort(key=lambda f: f.trajectory.created_at)
    return unique[: query.limit] if query.limit else unique


# --------------------------------------------------------------------------- show


@dataclass(frozen=True)
class Seen:
    """What ``show`` needs to print what the model saw: the run's tokenizer (None: it could
    not be loaded) and each declared domain's ``response_prefix``."""

    tokenizer: Any = None
    prefixes: dict[str, str] = field(default_factory=dict)


def seen_in(config: Config) -> Seen:
    """The tokenizer of ``model.spec`` (without the weights) and the domains' prefixes."""
    from streamrl.models import load_tokenizer, model_limits

    try:
        tokenizer = load_tokenizer(model_limits(config.model.spec)[0])
    except (OSError, ValueError):  # the model is gone or the spec is wrong: said in show
        tokenizer = None
    prefixes = {name: d.prompt.response_prefix for name, d in config.domain.items()
                if d.prompt.response_prefix}
    return Seen(tokenizer, prefixes)


def _prompt(t: Trajectory, seen: Seen | None) -> list[str]:
    """The prompt's lines: the recorded prompt ids decoded (what the model saw), or the
    item's own prompt without ``seen`` or a tokenizer."""
    ids = bytes_to_ids(t.rollout.prompt_ids)
    if seen is None:
        return ["--- prompt", t.rollout.task.prompt]
    if seen.tokenizer is None or not len(ids):
        return ["--- prompt: the item's own (the model's tokenizer could not be loaded to "
                "show the template it saw)", t.rollout.task.prompt]
    return [f"--- prompt as the model saw it ({len(ids)} tokens)",
            seen.tokenizer.decode(ids.tolist())]


def render_episode(f: Found, seen: Seen | None = None) -> str:
    """One episode as text; with ``seen`` (:func:`seen_in`) the prompt the model saw and each
    turn as its domain ran it (the response prefix before the output)."""
    t = f.trajectory
    task = t.rollout.task
    prefix = seen.prefixes.get(task.domain, "") if seen else ""
    lines = [
        f"episode {t.episode_id}  trajectory {t.id}  ({f.source} {f.stream} {f.entry_id})",
        f"domain {task.domain}  item {task.item_id}  split {task.split}  "
        f"policy v{t.policy_version}  task v{task.policy_version}  attempt {t.attempt}",
        *([f"unjudged (not trained): {f.unjudged}"] if f.unjudged else []),
        *_prompt(t, seen),
    ]
    for i, (sample, outcome, reward) in enumerate(
        zip(t.rollout.samples, t.outcomes, t.rewards, strict=True)
    ):
        flags = [n for n, on in (("timed out", outcome.timed_out),
                                 ("OOM", outcome.oom_killed)) if on]
        lines += [
            f"--- turn {i + 1}/{len(t.rollout.samples)}: sample {i}, weights "
            f"v{sample.weight_version}, {len(bytes_to_ids(sample.tokens))} tokens, "
            f"finish {sample.finish_reason}"
            + (f", after the response prefix {prefix!r}" if prefix else ""),
            *_turns(sample, task.episode.ended[i] if task.episode else "", prefix),
            f"--- sandbox: exit {outcome.exit_code} in {outcome.duration_s:.2f}s"
            + (f" ({', '.join(flags)})" if flags else ""),
            "stdout: " + (outcome.stdout.rstrip() or "(empty)"),
            "stderr: " + (outcome.stderr.rstrip() or "(empty)"),
            "--- unjudged" if f.unjudged else f"--- reward {reward:g}",
        ]
    return "\n".join(lines)


def _turns(sample: Any, ended: str, prefix: str = "") -> list[str]:
    """A single-turn sample's text after the domain's response ``prefix`` (the turn it ran
    and scored), or every model turn and observation of a multi-turn one."""
    if not sample.turns:
        return [prefix + sample.text]
    lines = []
    for k, turn in enumerate(sample.turns, 1):
        lines += [f"--- model turn {k}/{len(sample.turns)}", turn.text]
        if turn.observation:
            lines += [f"--- observation (exit {turn.exit_code})", turn.observation]
    return [*lines, f"--- episode ended: {ended or '?'}"]


# --------------------------------------------------------------------------- rescore


@dataclass(frozen=True)
class RewardChange:
    trajectory_id: str
    episode_id: str
    sample: int
    old: float
    new: float


def rescore(found: Iterable[Found]) -> tuple[int, list[RewardChange]]:
    """(samples scored, rewards that differ) with the domains' verifiers as they are now."""
    from streamrl.actors.executor import from_outcome
    from streamrl.domains.base import VerifierFailed
    from streamrl.runtime.context import domain_item

    scored, changes = 0, []
    for f in found:
        t = f.trajectory
        domain, item = domain_item(t.rollout.task)
        for i, (sample, outcome) in enumerate(zip(t.rollout.samples, t.outcomes, strict=True)):
            try:
                new = float(domain.score(item, sample.text, from_outcome(outcome)))
            except VerifierFailed:  # the verifier as it is now cannot judge it: no reward
                new = math.nan
            scored += 1
            if not math.isclose(new, t.rewards[i], abs_tol=1e-9):
                changes.append(RewardChange(t.id, t.episode_id, i, t.rewards[i], new))
    return scored, changes


# --------------------------------------------------------------------------- retrain


@dataclass(frozen=True)
class Retrained:
    step: int
    groups: int
    loss: float
    grad_norm: float
    recorded_loss: float | None
    recorded_grad_norm: float | None

    def matches(self, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
        if self.recorded_loss is None or self.recorded_grad_norm is None:
            return False
        return math.isclose(self.loss, self.recorded_loss, rel_tol=rel, abs_tol=abs_) and (
            math.isclose(self.grad_norm, self.recorded_grad_norm, rel_tol=rel, abs_tol=abs_)
        )


def recorded_step(config: Config, step: int) -> StepMetrics | None:
    """The metrics the learner recorded for ``step`` in its version directory."""
    from streamrl.actors.learner import STEP_METRICS_FILE
    from streamrl.learner.weights import version_dir

    path = version_dir(config.run.path / "weights", step) / STEP_METRICS_FILE
    return decode(path.read_bytes(), StepMetrics) if path.exists() else None


async def recorded_step_live(
    client: RedisClient, names: N.Names, step: int
) -> StepMetrics | None:
    found = None
    for _, fields in await read_range(client, names.stream(N.METRICS)):
        try:
            m = decode(fields[b"d"], StepMetrics)
        except (MessageError, KeyError):
            continue
        if m.step == step:
            found = m
    return found


def retrain(
    config: Config, step: int, groups: list[Trajectory], checkpoint: Path | None = None
) -> tuple[float, float]:
    """Loss and gradient norm of one step on ``groups`` from ``checkpoint`` (default: the
    version before ``step``), with the learner's training config."""
    from streamrl.actors.learner import train_config
    from streamrl.learner.train import Trainer
    from streamrl.learner.weights import version_dir
    from streamrl.models import resolve_model

    base = resolve_model(config.model.spec)
    if checkpoint is None:
        checkpoint = version_dir(config.run.path / "weights", step - 1) if step > 1 else base
    if not Path(checkpoint).exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} is gone (learner.keep_last)")
    trainer = Trainer.from_dir(checkpoint, train_config(config), ref_dir=base)
    stats = trainer.step(groups)
    return stats.loss, stats.grad_norm


def ledger_groups(config: Config, step: int) -> list[str]:
    """Trajectory ids step ``step`` trained, in the learner's order (the ledger)."""
    from streamrl.learner.checkpoint import Ledger

    root = config.run.path / "weights"
    for record in Ledger.open(root, latest=10**9).records:
        if record.version == step:
            return record.trajectory_ids
    raise LookupError(f"step {step} is not in the ledger {root}/consumed.jsonl")


# --------------------------------------------------------------------------- export


def to_json(t: Trajectory) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(t, builtin_types=(bytes,))
    data["rollout"]["prompt_ids"] = bytes_to_ids(t.rollout.prompt_ids).tolist()
    for s, raw in zip(data["rollout"]["samples"], t.rollout.samples, strict=True):
        s["tokens"] = bytes_to_ids(raw.tokens).tolist()
        s["logprobs"] = bytes_to_floats(raw.logprobs).tolist()
        if isinstance(s.get("mask"), bytes):  # multi-turn: uint8 per token
            s["mask"] = list(s["mask"])
        if isinstance(s.get("versions"), bytes):  # int32 per token
            s["versions"] = bytes_to_ids(s["versions"]).tolist()
    return data


def _jsonable(value: Any) -> Any:
    """Any other raw bytes field (added to the wire format later): its bytes as numbers."""
    if isinstance(value, bytes):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def sft_rows(found: Iterable[Found], min_reward: float) -> Iterator[dict[str, Any]]:
    """The samples of training groups whose own reward is at least ``min_reward``, as token
    rows of an SFT data set (:mod:`learner.sft_data`): the prompt and the completion exactly
    as the policy saw and sampled them, with the completion's mask (a multi-turn episode's
    observations 0). Left out: held-out groups (evaluation), groups the verifier did not
    judge, and samples cut at their token limit (they would teach the model not to stop)."""
    for f in found:
        t = f.trajectory
        if f.unjudged or training_task(t) is None:
            continue
        prompt = bytes_to_ids(t.rollout.prompt_ids).tolist()
        for i, (sample, reward) in enumerate(zip(t.rollout.samples, t.rewards, strict=True)):
            if reward < min_reward or sample.finish_reason == "length":
                continue
            tokens = bytes_to_ids(sample.tokens).tolist()
            yield {
                "id": f"{t.id}-{i}", "prompt_ids": prompt, "completion_ids": tokens,
                "mask": list(sample.mask) if sample.mask else [1] * len(tokens),
                "reward": reward, "domain": t.rollout.task.domain,
                "item_id": t.rollout.task.item_id, "episode_id": t.episode_id,
                "weight_version": sample.weight_version,
            }  # fmt: skip


def export_sft(found: list[Found], path: Path, min_reward: float) -> int:
    """:func:`sft_rows` of ``found`` as JSONL at ``path``; how many rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(sft_rows(found, min_reward))
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


def export(found: list[Found], jsonl: Path | None, parquet: Path | None) -> None:
    if jsonl is not None:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        with open(jsonl, "w") as f:
            for item in found:
                f.write(json.dumps(to_json(item.trajectory), default=_jsonable) + "\n")
    if parquet is not None:
        write_parquet(parquet, [row(i.stream, i.entry_id, i.payload) for i in found])


# --------------------------------------------------------------------------- the command


def query_from_args(args: argparse.Namespace) -> Query:
    return Query(
        streams=(args.stream,) if args.stream else (N.TRAJECTORIES, N.EVALS),
        from_id=args.from_id or "-",
        to_id=args.to_id or "+",
        since=args.since,
        until=args.until,
        domain=args.domain,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        policy_version=args.policy_version,
        episodes=frozenset(args.episode),
        limit=args.limit,
    )


async def run_replay(
    client: RedisClient | None, names: N.Names, config: Config, args: argparse.Namespace
) -> int:
    archive = Path(args.archive) if args.archive else archive_dir(config)
    live = client if args.source in ("live", "both") else None
    use_archive = archive if args.source in ("archive", "both") else None
    query = query_from_args(args)
    if args.action == "export" and args.sft:
        query = replace(query, streams=(N.TRAJECTORIES,))  # never a held-out group
    if args.action == "retrain":
        if args.step is None:
            print("streamrl replay retrain: --step N is required", file=sys.stderr)
            return 2
        ids = ledger_groups(config, args.step)
        query = replace(query, streams=(N.TRAJECTORIES,), trajectory_ids=frozenset(ids), limit=0)
    found = await select(live, names, query, use_archive)
    if args.action in ("list", "show") and live is not None:  # by creation, within --limit
        found = sorted(found + await select_unjudged(live, names, query),
                       key=lambda f: f.trajectory.created_at)[: query.limit or None]
    if args.action == "list":
        rows = [
            {"trajectory_id": f.trajectory.id, "episode_id": f.trajectory.episode_id,
             "source": f.source, "stream": f.stream, "entry_id": f.entry_id,
             "domain": f.trajectory.rollout.task.domain,
             "policy_version": f.trajectory.policy_version,
             "rewards": None if f.unjudged else f.trajectory.rewards,
             **({"unjudged": f.unjudged} if f.unjudged else {})}
            for f in found
        ]  # fmt: skip
        print(json.dumps(rows, indent=2))
        return 0
    if args.action == "show":
        seen = seen_in(config) if found else None
        print("\n\n".join(render_episode(f, seen) for f in found) or "no trajectory matches")
        return 0 if found else 1
    if args.action == "rescore":
        scored, changes = rescore(found)
        for c in changes:
            print(f"{c.episode_id} sample {c.sample}: {c.old:g} -> {c.new:g}")
        print(f"{len(changes)} of {scored} rewards changed in {len(found)} groups")
        return 0
    if args.action == "export":
        sft = args.sft
        if not args.jsonl and not args.parquet and not sft:
            print("streamrl replay export: give --jsonl, --parquet and/or --sft",
                  file=sys.stderr)
            return 2
        if sft:
            if args.sft_min_reward is None:
                print("streamrl replay export --sft: give --sft-min-reward (a sample's own "
                      "reward at least)", file=sys.stderr)
                return 2
            written = export_sft(found, Path(sft), args.sft_min_reward)
            print(f"exported {written} SFT rows (samples with reward >= {args.sft_min_reward:g}) "
                  f"from {len(found)} trajectories")
            if not args.jsonl and not args.parquet:
                return 0
        export(found, Path(args.jsonl) if args.jsonl else None,
               Path(args.parquet) if args.parquet else None)
        print(f"exported {len(found)} trajectories")
        return 0
    if args.action == "retrain":
        by_id = {f.trajectory.id: f.trajectory for f in found}
        missing = [i for i in ids if i not in by_id]
        if missing:
            print(f"streamrl replay retrain: {len(missing)} groups of step {args.step} are "
                  f"neither live nor archived: {missing[:3]}", file=sys.stderr)
            return 1
        recorded = recorded_step(config, args.step)
        if recorded is None and client is not None:
            recorded = await recorded_step_live(client, names, args.step)
        loss, grad_norm = retrain(config, args.step, [by_id[i] for i in ids],
                                  Path(args.checkpoint) if args.checkpoint else None)
        result = Retrained(args.step, len(ids), loss, grad_norm,
                           recorded.loss if recorded else None,
                           recorded.grad_norm if recorded else None)
        print(json.dumps({**result.__dict__, "matches": result.matches()}, indent=2))
        return 0 if result.matches() else 1
    raise ValueError(f"unknown replay action {args.action!r}")


__all__ = ["COLUMNS", "Query", "export", "rescore", "retrain", "select"]
