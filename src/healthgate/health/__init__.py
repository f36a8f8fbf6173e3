"""The pure health engine: no sockets, no asyncio, no wall clock.

It is fed ``(time, endpoint, probe result)`` and resource changes, and answers
with transition records and route decisions. See :mod:`.engine`.
"""
