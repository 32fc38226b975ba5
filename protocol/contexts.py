"""Context by reference: a multi-turn episode's context travels as stored parts plus the
tokens the latest turn added, never whole again.

Each member's context (``Sample``: tokens, behaviour logprobs, mask, per-token versions,
turns) grows by appending, turn after turn. A message of an episode carries
``Episode.context``, the names of the parts stored so far (fields of the episode's hash
``Names.context(episode id)``, in the slot of the episode's streams), and as its own samples
only what comes after them. :func:`join` rebuilds the whole context from the parts,
:func:`split` cuts a whole context into what a base already holds and the tail after it.

Guarantees (pure functions, no I/O):
- ``join(base parts + [split(full, join(base parts))])`` is ``full``, byte for byte, for
  every context that extends its base (token ids, logprobs, mask, versions, turns);
- :func:`split` returns None for a context that does not extend its base (a handler that
  rewrote history): the caller then sends it whole, correct if large.
The runtime applies them around the handlers (:mod:`streamrl.runtime.contexts`), so a
handler sees whole contexts, as if nothing were stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from streamrl.protocol.messages import Sample, ids_to_bytes

_PART = msgspec.msgpack.Encoder()
_PART_DECODER = msgspec.msgpack.Decoder(list[Sample])


class ContextError(ValueError):
    """A stored part that is missing or does not decode: the message cannot be rebuilt."""


def encode_part(tails: Sequence[Sample]) -> bytes:
    """One stored part: each member's tail, MessagePack (arrays as raw bytes)."""
    return _PART.encode(list(tails))


def decode_part(raw: bytes, name: str) -> list[Sample]:
    try:
        return _PART_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise ContextError(f"stored context part {name!r} does not decode: {exc}") from exc


def _mask(s: Sample) -> bytes:
    return s.mask if s.mask else b"\x01" * (len(s.tokens) // 4)


def _versions(s: Sample) -> bytes:
    return s.versions if s.versions else ids_to_bytes(s.token_versions())


def join(parts: Sequence[Sequence[Sample]]) -> list[Sample]:
    """Every member's whole context from its parts (oldest first); the latest part's text,
    finish reason and weight version (a part holds the whole context's, see :func:`split`)."""
    if not parts:
        return []
    width = len(parts[0])
    if any(len(p) != width for p in parts):
        raise ContextError(f"stored context parts of {sorted({len(p) for p in parts})} members")
    if len(parts) == 1:
        return list(parts[0])
    out = []
    for member in zip(*parts, strict=True):
        last = member[-1]
        out.append(Sample(
            tokens=b"".join(s.tokens for s in member),
            logprobs=b"".join(s.logprobs for s in member),
            text=last.text, finish_reason=last.finish_reason, weight_version=last.weight_version,
            mask=b"".join(_mask(s) for s in member),
            turns=[t for s in member for t in s.turns],
            versions=b"".join(_versions(s) for s in member),
        ))
    return out


def split(full: Sequence[Sample], base: Sequence[Sample]) -> list[Sample] | None:
    """Each member's tail of ``full`` after ``base`` (what this turn added), with the whole
    context's text, finish reason and weight version; None if some member's context does not
    extend its base."""
    if len(full) != len(base):
        return None
    tails = []
    for f, b in zip(full, base, strict=True):
        n, t = len(b.tokens), len(b.turns)
        mask, versions = _mask(f), _versions(f)
        if not (f.tokens[:n] == b.tokens and f.logprobs[:n] == b.logprobs
                and mask[: n // 4] == _mask(b) and versions[:n] == _versions(b)
                and list(f.turns[:t]) == list(b.turns)):
            return None
        tails.append(Sample(
            tokens=f.tokens[n:], logprobs=f.logprobs[n:], text=f.text,
            finish_reason=f.finish_reason, weight_version=f.weight_version,
            mask=mask[n // 4:], turns=list(f.turns[t:]), versions=versions[n:],
        ))
    return tails


def tokens(samples: Sequence[Sample]) -> int:
    """How many tokens ``samples`` hold (all members)."""
    return sum(len(s.tokens) // 4 for s in samples)


__all__ = ["ContextError", "decode_part", "encode_part", "join", "split", "tokens"]
