"""The open-file limit: raised once, when a serving process starts.

Every probe, proxied connection and API connection holds a descriptor, and
the defaults of many systems (1,024 soft) are far below what a prober of
thousands of endpoints needs. ``serve`` and each worker process raise the
soft limit to the hard one at start-up (:func:`raise_open_file_limit`);
everything else only reads it (:func:`open_file_limit`) to size itself.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("healthgate.process")


def open_file_limit() -> int:
    """The soft RLIMIT_NOFILE in force."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit above %d", soft)
    return soft
