"""Probes (TCP, HTTP, HTTPS, gRPC) and their scheduler.

This layer turns a :class:`ProbeSpec` into a :class:`ProbeResult` over real
sockets, on a timetable. It knows nothing of policies or composites: results
leave through one callback, ``sink(key, loop_time, result)``.
"""
