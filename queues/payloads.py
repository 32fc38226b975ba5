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
    outputs: list[tuple[str, bytes]], limits: PayloadLimits
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


def resolve(
    sync: Any, entries: list[tuple[str, bytes | None]], limits: PayloadLimits
) -> list[Resolved]:
    """Payloads of ``entries`` (id, field value) with references fetched (one round trip for
    all blobs of the batch) and limits checked. ``sync`` is a redis-py client."""
    refs = [
        p[len(REF_PREFIX) :].decode("utf-8", "replace")
        for _, p in entries
        if p is not None and _is_ref(p)
    ]
    blobs = iter(_get_all(sync, refs) if refs else [])
    out = []
    for _, payload in entries:
        if payload is None:
            out.append(Resolved(None, "entry has no payload field", None))
            continue
        raw = payload
        if _is_ref(payload):
            key = payload[len(REF_PREFIX) :].decode("utf-8", "replace")
            payload = next(blobs)
            if payload is None:
                out.append(Resolved(None, f"claim-check blob {key} is missing (expired?)", raw))
                continue
        if len(payload) > limits.max_bytes:
            error = (
                f"payload of {len(payload)} bytes is over the limit of {limits.max_bytes} "
                "bytes (queues.max_message_bytes); kept its first 64 KiB"
            )
            out.append(Resolved(None, error, payload[:_KEEP_OF_OVERSIZE]))
            continue
        out.append(Resolved(payload, None, raw))
    return out


def _is_ref(payload: bytes | None) -> bool:
    return payload is not None and payload.startswith(REF_PREFIX)


def _get_all(sync: Any, keys: list[str]) -> list[bytes | None]:
    pipe = sync.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return list(pipe.execute())
