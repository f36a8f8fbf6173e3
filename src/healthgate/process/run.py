"""The entry point of every worker process:
``python -m healthgate.process.run MODULE INDEX LOG_LEVEL``.

The worker's module is imported by its own name and its ``worker_main``
run - never executed as ``__main__``, whose classes would not be the ones
the owner pickles its messages with (``healthgate.dataplane.workers.Setup``
and ``__main__.Setup`` are two classes). Only the modules named here run.
"""

from __future__ import annotations

import importlib
import sys

WORKER_MODULES = frozenset(
    {"healthgate.controlplane.probe_workers", "healthgate.dataplane.workers"}
)


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in WORKER_MODULES or not sys.argv[2].isdigit():
        sys.exit(
            "usage: python -m healthgate.process.run MODULE INDEX LOG_LEVEL (started by serve)"
        )
    importlib.import_module(sys.argv[1]).worker_main(int(sys.argv[2]), sys.argv[3])


if __name__ == "__main__":
    main()
