"""The broker's encoding: MessagePack via msgspec (never pickle), decoding into typed frozen
structs with the schema checked, and the dead-letter record the broker writes.

:func:`decode` raises :class:`MessageError` for anything that is not a valid message of the
expected type (not MessagePack, wrong types, missing or unknown fields); the consumer turns
that into a dead letter with the reason.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec


class MessageError(ValueError):
    """A payload could not be decoded into the expected message type."""


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    group: str
    entry_id: str
    error: str
    deliveries: int
    payload: bytes
    at: float


M = TypeVar("M", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes, kind: type[M]) -> M:
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"{kind.__name__}: {exc}") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise MessageError(f"{kind.__name__}: {type(exc).__name__}: {exc}") from None
