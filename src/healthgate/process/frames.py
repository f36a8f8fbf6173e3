"""Typed messages over a pipe between two healthgate processes.

A message is a small frozen dataclass of the protocol it belongs to (each
worker module defines its own, one class per message, each registered with
:func:`message`), sent as one frame: a 4-byte big-endian length, then the
message as MessagePack (msgspec): ``[its registered name, its fields]``.
Both ends are this program, started by the serving process itself - but a
pipe is still a boundary, and a worker is the process that reads what
clients and backends send: were it ever subverted, what it writes back must
not be able to run code in the serving process (which ``pickle``, used here
before, would have let it do). So:

* a frame is **data only**: decoding builds the registered dataclasses,
  tuples, lists, dicts, enums and the like - each field checked against its
  declared type - and nothing else (a model type, such as a resource, is
  written as its wire form and parsed again: :func:`register_model`);
* a frame longer than the reader's ``limit`` is refused before it is read
  (the stream is then broken and the worker replaced);
* a frame of a name nobody registered, or whose fields are not of their
  types, is logged and dropped (:class:`Dropped`, which :func:`expect`
  refuses like any message of a type the reader does not expect).

Frames are read with asyncio on both sides, so neither end ever blocks its
event loop on a pipe; what one side writes waits in its transport's buffer,
which the supervisor bounds (process/supervisor.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

log = logging.getLogger("healthgate.process")

_LEN = struct.Struct("!I")
MAX_FRAME = 1 << 30  # the protocol's own ceiling (4 bytes of length would allow 4 GiB)

T = TypeVar("T")
C = TypeVar("C", bound=type)

_MESSAGES: dict[str, type] = {}  # registered name -> message class
# model types written as their wire form: base class -> (to wire, from wire)
_MODELS: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {}
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


class FrameTooLarge(Exception):
    """A frame announced more bytes than the reader takes."""


@dataclass(frozen=True, slots=True)
class Dropped:
    """A frame that was read but is not a message this program knows (or
    whose fields are not of their types): logged, and refused by :func:`expect`."""

    name: str
    why: str


def message(cls: C) -> C:
    """Register a message class (a decorator): frames name it, readers build it."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _MESSAGES.setdefault(name, cls) is not cls:
        raise ValueError(f"two message classes named {name}")
    return cls


def register_model(
    base: type, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]
) -> None:
    """A model type (and its subclasses) in messages: written as ``to_wire``
    gives it, read back by ``from_wire`` (which raises on a bad value)."""
    _MODELS[base] = (to_wire, from_wire)


def _enc_hook(obj: Any) -> Any:
    for base, (to_wire, _) in _MODELS.items():
        if isinstance(obj, base):
            return to_wire(obj)
    raise NotImplementedError(f"a {type(obj).__name__} is not a message field type")


def _dec_hook(kind: type, obj: Any) -> Any:
    for base, (_, from_wire) in _MODELS.items():
        if isinstance(kind, type) and issubclass(kind, base):
            value = from_wire(obj)
            if not isinstance(value, kind):
                raise ValueError(f"expected a {kind.__name__}, got a {type(value).__name__}")
            return value
    raise NotImplementedError(f"a {kind!r} is not a message field type")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_OUTER = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])


def encode(message: object) -> bytes:
    name = f"{type(message).__module__}.{type(message).__qualname__}"
    if _MESSAGES.get(name) is not type(message):
        raise TypeError(f"{name} is not a registered message (process/frames.py: @message)")
    body = _ENCODER.encode((name, message))
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"a {type(message).__name__} of {len(body)} bytes (> {MAX_FRAME})")
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> object:
    """A frame's message (a :class:`Dropped` when it is not one)."""
    try:
        name, raw = _OUTER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _dropped("?", f"not a frame: {exc}")
    cls = _MESSAGES.get(name)
    if cls is None:
        return _dropped(name[:100], "no such message")
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls, dec_hook=_dec_hook)
    try:
        return decoder.decode(raw)
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        ValueError,
        TypeError,
        NotImplementedError,
    ) as exc:
        return _dropped(name, str(exc)[:300])


def _dropped(name: str, why: str) -> Dropped:
    log.error("dropping a frame that is not a message (%s): %s", name, why)
    return Dropped(name, why)


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> object | None:
    """The next message, or None at the end of the stream. Raises
    :class:`FrameTooLarge` for a frame over ``limit`` (nothing of it read)."""
    try:
        (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if size > limit:
            raise FrameTooLarge(f"a frame of {size} bytes announced (limit {limit})")
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    return decode(body)


def expect(message: object, *types: type[T]) -> T | None:
    """``message`` if it is one of ``types``; else None, and it is logged."""
    if isinstance(message, types):
        return message
    if not isinstance(message, Dropped):  # (logged when it was read)
        log.error("dropping an unexpected message of type %s", type(message).__name__)
    return None


async def stdio_streams() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A worker's end: its stdin as a reader of the owner's frames and its
    stdout as the writer of its own (logging goes to stderr)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(sys.stdout.fileno(), "wb", buffering=0)
    )
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return reader, writer


def write(writer: asyncio.StreamWriter, message: Any) -> None:
    if not writer.is_closing():
        writer.write(encode(message))
