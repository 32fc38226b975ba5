"""Payload size limits and the claim check.

Every payload written to a stream passes :func:`prepare`: over ``max_bytes`` it is refused
with :class:`PayloadTooLarge` (nothing is written); over ``claim_check_bytes`` (a long
context, many samples) it is stored out of band in a blob key next to the stream and the
stream entry holds a reference instead (``REF_PREFIX`` + the blob key). Readers pass what
they read through :func:`resolve`, which swaps references for the blobs and turns anything
unusable (no payload field, over the limit, a blob that is gone) into an error text the
caller dead-letters.

Blob keys are ``<stream key>:blob:<uuid>``: they share the stream's hash tag, so on Redis
Cluster a blob lives in its stream's slot. A blob is deleted together with its entry when
the stream is trimmed (:mod:`queues.trim`) and carries a TTL (``blob_ttl_s``) as a safety
net, for blobs whose hand-off turned out to be a duplicate and was never published.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REF_PREFIX = b"\x00streamrl-blob:"
"""A payload starting with this is a claim-check reference. Message payloads are MessagePack
maps or arrays, which never start with a NUL byte."""


class PayloadTooLarge(ValueError):
    """A payload over the configured maximum: refused before anything is written."""


@dataclass(frozen=True)
class PayloadLimits:
    max_bytes: int = 64 * 1024 * 1024
    claim_check_bytes: int = 1024 * 1024
    blob_ttl_s: int = 7 * 24 * 3600

    def __post_init__(self) -> None:
        if not 0 < self.claim_check_bytes <= self.max_bytes:
            raise ValueError(
                f"need 0 < claim_check_bytes ({self.claim_check_bytes}) <= max_bytes "
                f"({self.max_bytes})"
            )


@dataclass(frozen=True)
class Blob:
    key: str
    data: bytes


def prepare(stream_key: str, payload: bytes, limits: PayloadLimits) -> tuple[bytes, Blob | None]:
    """What to write into ``stream_key`` for ``payload``: itself, or a reference and the blob
    to store first. Raises :class:`PayloadTooLarge`."""
    size = len(payload)
    if size > limits.max_bytes:
        raise PayloadTooLarge(
            f"message of {size} bytes for {stream_key} is over the limit of {limits.max_bytes} "
            "bytes (queues.max_message_bytes)"
        )
    if size <= limits.claim_check_bytes:
        return payload, None
    key = f"{stream_key}:blob:{uuid.uuid4().hex}"
    return REF_PREFIX + key.encode(), Blob(key, payload)


def prepare_many(
    outputs: Sequence[tuple[str, bytes]], limits: PayloadLimits
) -> tuple[list[tuple[str, bytes]], list[Blob]]:
    """:func:`prepare` for [(stream key, payload)]; all are checked before any is written."""
    prepared: list[tuple[str, bytes]] = []
    blobs: list[Blob] = []
    for stream_key, payload in outputs:
        data, blob = prepare(stream_key, payload, limits)
        prepared.append((stream_key, data))
        if blob is not None:
            blobs.append(blob)
    return prepared, blobs


def store_blobs(pipe: Any, blobs: list[Blob], limits: PayloadLimits) -> None:
    """Queue the SETs of ``blobs`` on a redis-py pipeline (or client)."""
    for blob in blobs:
        pipe.set(blob.key, blob.data, ex=limits.blob_ttl_s)


@dataclass(frozen=True)
class Resolved:
    payload: bytes | None  # None: unusable, see error
    error: str | None
    raw: bytes | None  # what the entry held (truncated when oversize), for the dead letter


_KEEP_OF_OVERSIZE = 64 * 1024


def blob_prefix(stream_key: str) -> str:
    """The prefix every claim-check blob of ``stream_key`` has (:func:`prepare`)."""
    return f"{stream_key}:blob:"


def resolve(
    sync: Any,
    entries: list[tuple[str, bytes | None]],
    limits: PayloadLimits,
    *,
    stream_key: str | None = None,
) -> list[Resolved]:
    """Payloads of ``entries`` (id, field value) with references fetched (one round trip for
    all blobs of the batch) and limits checked. ``sync`` is a redis-py client.

    Never raises for what an entry holds: a reference that names no blob of ``stream_key``
    (another key of the run, a counter, another stream's blob) is refused without being
    read, and a blob that cannot be read (missing, of another type, not permitted to this
    user) is an error of that entry alone; the other entries of the batch are unaffected."""
    prefix = blob_prefix(stream_key) if stream_key is not None else None
    named = {_ref_key(p) for _, p in entries if p is not None and _is_ref(p)}
    refs = sorted(k for k in named if prefix is None or k.startswith(prefix))
    blobs = dict(zip(refs, _get_all(sync, refs), strict=True)) if refs else {}
    out = []
    for _, payload in entries:
        if payload is None:
            out.append(Resolved(None, "entry has no payload field", None))
            continue
        raw = payload
        if _is_ref(payload):
            key = _ref_key(payload)
            if key not in blobs:
                error = (
                    f"claim-check reference refused: {key!r} is not a blob of {stream_key} "
                    f"(a reference must name a key under {prefix!r})"
                )
                out.append(Resolved(None, error, raw))
                continue
            blob = blobs[key]
            if isinstance(blob, Exception):
                error = f"claim-check blob {key} could not be read: {type(blob).__name__}: {blob}"
                out.append(Resolved(None, error, raw))
                continue
            if blob is None:
                out.append(Resolved(None, f"claim-check blob {key} is missing (expired?)", raw))
                continue
            payload = blob
        if len(payload) > limits.max_bytes:
            error = (
                f"payload of {len(payload)} bytes is over the limit of {limits.max_bytes} "
                "bytes (queues.max_message_bytes); kept its first 64 KiB"
            )
            out.append(Resolved(None, error, payload[:_KEEP_OF_OVERSIZE]))
            continue
        out.append(Resolved(payload, None, raw))
    return out


def _ref_key(payload: bytes) -> str:
    return payload[len(REF_PREFIX) :].decode("utf-8", "replace")


def _is_ref(payload: bytes | None) -> bool:
    return payload is not None and payload.startswith(REF_PREFIX)


def _get_all(sync: Any, keys: list[str]) -> list[bytes | Exception | None]:
    """GET of every key; a key that cannot be read comes back as its error (WRONGTYPE,
    NOPERM), not raised: connection errors still raise (the client reconnects and retries)."""
    pipe = sync.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return list(pipe.execute(raise_on_error=False))
