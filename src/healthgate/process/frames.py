"""Typed messages over a pipe between two healthgate processes.

A message is a small frozen dataclass of the protocol it belongs to (each
worker module defines its own, one class per message), sent as one frame:
a 4-byte big-endian length, then the pickled message. Both ends are this
program, started by the serving process itself - but a pipe is still a
boundary: a frame longer than the reader's ``limit`` is refused before it is
read (the stream is then broken and the worker replaced), and a message of
a type the reader does not expect is logged and dropped (:func:`expect`).

Frames are read with asyncio on both sides, so neither end ever blocks its
event loop on a pipe; what one side writes waits in its transport's buffer,
which the supervisor bounds (process/supervisor.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
import sys
from typing import Any, TypeVar

log = logging.getLogger("healthgate.process")

_LEN = struct.Struct("!I")
MAX_FRAME = 1 << 30  # the protocol's own ceiling (4 bytes of length would allow 4 GiB)

T = TypeVar("T")


class FrameTooLarge(Exception):
    """A frame announced more bytes than the reader takes."""


def encode(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"a {type(message).__name__} of {len(body)} bytes (> {MAX_FRAME})")
    return _LEN.pack(len(body)) + body


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
    message: object = pickle.loads(body)
    return message


def expect(message: object, *types: type[T]) -> T | None:
    """``message`` if it is one of ``types``; else None, and it is logged."""
    if isinstance(message, types):
        return message
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
