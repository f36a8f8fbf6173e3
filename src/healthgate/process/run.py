"""The entry point of every worker process:
``python -m healthgate.process.run MODULE INDEX LOG_LEVEL``.

The worker's module is imported by its own name and its ``worker_main``
run - never executed as ``__main__``, whose classes would not be the ones
the owner's frames name (``healthgate.dataplane.workers.Setup`` and
``__main__.Setup`` are two classes: process/frames.py). Only the modules
named here run.

Every worker, whatever it does: logs to stderr (its stdout carries frames)
at the owner's level, labelled with its kind and index; ignores SIGINT (a
Ctrl-C reaches the whole process group, and the owner decides when its
workers stop: their stdin ends); raises its open-file limit.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys

from healthgate.logs import configure_worker
from healthgate.process.limits import raise_open_file_limit

# module -> the label of its workers in their log lines
WORKER_MODULES = {
    "healthgate.controlplane.probe_workers": "probe-worker",
    "healthgate.dataplane.workers": "worker",
}


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in WORKER_MODULES or not sys.argv[2].isdigit():
        sys.exit(
            "usage: python -m healthgate.process.run MODULE INDEX LOG_LEVEL (started by serve)"
        )
    module, index, level = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    configure_worker(level, f"{WORKER_MODULES[module]}[{index}]")
    logging.getLogger("healthgate.process").debug(
        "worker process %d running %s", os.getpid(), module
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process decides when we stop
    raise_open_file_limit()
    importlib.import_module(module).worker_main(index)


if __name__ == "__main__":
    main()
