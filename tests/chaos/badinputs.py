"""Bad inputs for every input stream, generated deterministically from a seed.

What a buggy or hostile producer could write into a stream, by kind, each with the pattern
the dead letter's reason must match (the reason has to name the problem):

- ``random bytes``: not MessagePack at all, or MessagePack of nothing like a message;
- ``wrong top-level type``: valid MessagePack that is not a map (int, str, list, nil, ...);
- ``wrong field type``: a valid message with one field (at any depth) of another type;
- ``missing field``: a valid message with one required field (at any depth) removed;
- ``wrong message type``: a valid message of another type (including a ``Trajectory`` in
  ``executed``, whose fields are a superset of ``Executed``'s);
- ``wrong version``: schema version ``v`` other than the current one, at any depth;
- ``deep nesting``: 100,000 nested arrays, at the top or inside a free-form field;
- ``oversize``: a well-formed message over ``queues.max_message_bytes``;
- ``no payload field``: an entry without the ``d`` field;
- ``bad content``: a well-formed message the consumer cannot use (an unknown domain, outcomes
  that do not match the samples, a group the learner cannot train on, an evaluation result
  without rewards).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    ExecOutcome,
    Executed,
    Rollout,
    Sample,
    Sampling,
    StepMetrics,
    Task,
    Trajectory,
    WeightsPublished,
    floats_to_bytes,
    ids_to_bytes,
)
from streamrl.queues.codec import MessageError, decode

INPUT_TYPES: dict[str, type[msgspec.Struct]] = {
    N.TASKS: Task,
    N.ROLLOUTS: Rollout,
    N.EXECUTED: Executed,
    N.TRAJECTORIES: Trajectory,
    N.EVALS: Trajectory,
}
DEPTH = 100_000

REASONS = {
    "random bytes": r"malformed message",
    "wrong top-level type": r"malformed message: \w+: Expected `object`",
    "wrong field type": r"malformed message: .*Expected `",
    "missing field": r"malformed message: .*missing required field",
    "wrong message type": r"malformed message: .*(missing required field|unknown field)",
    "wrong version": r"malformed message: .*schema version",
    "deep nesting": r"malformed message: .*(RecursionError|Expected `object`, got `array`)",
    "oversize": r"over the limit",
    "no payload field": r"no payload field",
    "bad content": (
        r"rejected: task .* of domain 'no-such-domain'|rejected: \d+ outcomes for \d+ samples"
        r"|malformed group: |not an evaluation result: "
    ),
}
KINDS = tuple(REASONS)


@dataclass(frozen=True)
class BadInput:
    stream: str
    kind: str
    fields: dict[bytes, bytes]

    def reason_ok(self, error: str) -> bool:
        return re.search(REASONS[self.kind], error) is not None


# --------------------------------------------------------------------------- templates


def _task(domain: str = "arith", split: str = "train", eval_round: int = -1) -> Task:
    item = {"id": "fuzz-1", "prompt": "Write a Python program that prints 2.", "answer": "2"}
    item["kind"] = "literal"
    return Task(
        id="fuzz-task", created_at=1.0, policy_version=0, domain=domain, item_id="fuzz-1",
        split=split, prompt=item["prompt"], spec=item, group_size=2,
        sampling=Sampling(max_new_tokens=4, temperature=1.0), eval_round=eval_round,
    )  # fmt: skip


def _rollout(task: Task | None = None, tokens: bytes | None = None) -> Rollout:
    task = task or _task()
    sample = Sample(
        tokens=ids_to_bytes([5, 6]) if tokens is None else tokens,
        logprobs=floats_to_bytes([-1.0, -2.0]),
        text="print(2)",
        finish_reason="length",
        weight_version=0,
    )
    return Rollout(
        id="fuzz-rollout", created_at=1.0, policy_version=0, task=task,
        prompt_ids=ids_to_bytes([1, 2, 3]), samples=[sample, sample],
    )  # fmt: skip


def _outcome() -> ExecOutcome:
    return ExecOutcome(
        exit_code=0, stdout="2\n", stderr="", timed_out=False, oom_killed=False, duration_s=0.1
    )


def _executed(rollout: Rollout | None = None, outcomes: int = 2) -> Executed:
    return Executed(
        id="fuzz-executed", created_at=1.0, policy_version=0, rollout=rollout or _rollout(),
        outcomes=[_outcome()] * outcomes,
    )  # fmt: skip


def _trajectory(rollout: Rollout | None = None, rewards: list[float] | None = None) -> Trajectory:
    return Trajectory(
        id="fuzz-trajectory", created_at=1.0, policy_version=0, rollout=rollout or _rollout(),
        outcomes=[_outcome()] * 2, rewards=[0.0, 1.0] if rewards is None else rewards,
    )  # fmt: skip


def _eval_trajectory(rewards: list[float] | None = None) -> Trajectory:
    task = _task(split="eval", eval_round=0)
    return _trajectory(_rollout(task), rewards=[1.0, 1.0] if rewards is None else rewards)


VALID: dict[str, Callable[[], msgspec.Struct]] = {
    N.TASKS: _task,
    N.ROLLOUTS: _rollout,
    N.EXECUTED: _executed,
    N.TRAJECTORIES: _trajectory,
    N.EVALS: _eval_trajectory,
}
OTHERS: list[Callable[[], msgspec.Struct]] = [
    _task,
    _rollout,
    _executed,
    _trajectory,
    lambda: WeightsPublished(id="w", created_at=1.0, policy_version=1, version=1, path="/x"),
    lambda: StepMetrics(
        id="m", created_at=1.0, policy_version=1, step=1, loss=0.0, grad_norm=0.0,
        reward_mean=0.0, groups=1, samples=1, tokens=1, dropped_stale=0,
        max_staleness_seen=0, step_seconds=0.0, wait_seconds=0.0,
    ),
]  # fmt: skip


def _bad_content(stream: str, rng: random.Random) -> msgspec.Struct:
    """Well-formed, but nothing the consumer of ``stream`` can use."""
    if stream == N.TASKS:
        return _task(domain="no-such-domain")
    if stream == N.ROLLOUTS:
        return _rollout(_task(domain="no-such-domain"))
    if stream == N.EXECUTED:
        return _executed(outcomes=rng.choice([0, 1, 3]))
    if stream == N.TRAJECTORIES:
        return rng.choice(
            [
                _trajectory(rewards=[0.0, 1.0, 1.0]),  # 3 rewards for 2 samples
                _trajectory(_rollout(tokens=b"\x01\x02\x03")),  # not whole int32s
                _trajectory(_rollout(tokens=ids_to_bytes([5, 6, 7]))),  # 3 tokens, 2 logprobs
            ]
        )
    return rng.choice([_eval_trajectory(rewards=[]), _trajectory()])  # no rewards; not an eval


# --------------------------------------------------------------------------- MessagePack


def _builtins(msg: msgspec.Struct) -> Any:
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def _header(n: int, fix: int, b16: int) -> bytes:
    return bytes([fix | n]) if n < 16 else bytes([b16]) + n.to_bytes(2, "big")


def _pack_with(obj: Any, path: tuple[Any, ...], raw: bytes) -> bytes:
    """MessagePack of ``obj`` with the value at ``path`` replaced by the bytes ``raw``."""
    if not path:
        return raw
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        body = b"".join(
            _pack(k) + (_pack_with(v, rest, raw) if k == head else _pack(v)) for k, v in obj.items()
        )
        return _header(len(obj), 0x80, 0xDE) + body
    body = b"".join(_pack_with(v, rest, raw) if i == head else _pack(v) for i, v in enumerate(obj))
    return _header(len(obj), 0x90, 0xDC) + body


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every map key and list index, at any depth."""
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


def _edit(obj: Any, path: tuple[Any, ...], value: Any, delete: bool = False) -> Any:
    """A copy of ``obj`` with ``path`` set to ``value`` (or removed)."""
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    if len(path) == 1:
        if delete:
            del out[path[0]]
        else:
            out[path[0]] = value
        return out
    out[path[0]] = _edit(out[path[0]], path[1:], value, delete)
    return out


def _spec_path(obj: Any) -> tuple[str, ...]:
    """Where the task's free-form ``spec`` map sits in this message."""
    if "spec" in obj:
        return ("spec",)
    if "task" in obj:
        return ("task", "spec")
    return ("rollout", "task", "spec")


def _prompt_path(obj: Any) -> tuple[str, ...]:
    return (*_spec_path(obj)[:-1], "prompt")


WRONG_VALUES: list[Any] = [123456, -1, 1.5, "text", b"\x00\x01", [1, 2], {"k": "v"}, None, True]


# --------------------------------------------------------------------------- generation


def _candidate(kind: str, stream: str, rng: random.Random, max_bytes: int) -> dict[bytes, bytes]:
    template = _builtins(VALID[stream]())
    if kind == "random bytes":
        return {b"d": rng.randbytes(rng.randint(0, 300))}
    if kind == "wrong top-level type":
        value = rng.choice([7, -3, 2.5, "tasks", [1, 2, 3], None, True, b"\xff" * 8, []])
        return {b"d": _pack(value)}
    if kind == "wrong field type":
        path = rng.choice(list(_paths(template)))
        return {b"d": _pack(_edit(template, path, rng.choice(WRONG_VALUES)))}
    if kind == "missing field":
        path = rng.choice([p for p in _paths(template) if not isinstance(p[-1], int)])
        return {b"d": _pack(_edit(template, path, None, delete=True))}
    if kind == "wrong message type":
        other = rng.choice(OTHERS)()
        return {b"d": _pack(_builtins(other))}
    if kind == "wrong version":
        paths = [p for p in _paths(template) if p[-1] == "v"]
        version = rng.choice([0, 2, 3, 99, -1, 2**40])
        return {b"d": _pack(_edit(template, rng.choice(paths), version))}
    if kind == "deep nesting":
        nest = b"\x91" * DEPTH + b"\xc0"
        if rng.random() < 0.3:
            return {b"d": nest}
        return {b"d": _pack_with(template, (*_spec_path(template), "id"), nest)}
    if kind == "oversize":
        padding = "x" * (max_bytes + rng.randint(1, 4096))
        return {b"d": _pack(_edit(template, _prompt_path(template), padding))}
    if kind == "no payload field":
        key = rng.choice([b"x", b"D", b"data", b"payload"])
        return {key: _pack(template)}
    if kind == "bad content":
        return {b"d": _pack(_builtins(_bad_content(stream, rng)))}
    raise ValueError(kind)


def _is_bad(kind: str, stream: str, fields: dict[bytes, bytes], max_bytes: int) -> bool:
    """Whether this candidate really fails where, and as, its kind says it does."""
    payload = fields.get(b"d")
    if payload is None or len(payload) > max_bytes:
        return kind in ("no payload field", "oversize")
    try:
        decode(payload, INPUT_TYPES[stream])
    except MessageError as exc:
        return re.search(REASONS[kind], f"malformed message: {exc}") is not None
    return kind == "bad content"


def generate(
    stream: str, count: int, rng: random.Random, *, max_bytes: int, heavy_cap: int = 20
) -> list[BadInput]:
    """``count`` bad inputs for ``stream``, the kinds taking turns; at most ``heavy_cap`` each
    of the large kinds (deep nesting, oversize: 100 KB each)."""
    out: list[BadInput] = []
    heavy = {"deep nesting": 0, "oversize": 0}
    kinds = list(KINDS)
    i = 0
    while len(out) < count:
        kind = kinds[i % len(kinds)]
        i += 1
        if kind in heavy:
            if heavy[kind] >= heavy_cap:
                continue
            heavy[kind] += 1
        for _ in range(100):
            fields = _candidate(kind, stream, rng, max_bytes)
            if _is_bad(kind, stream, fields, max_bytes):
                out.append(BadInput(stream, kind, fields))
                break
        else:
            raise AssertionError(f"could not make a {kind!r} input for {stream}")
    return out
