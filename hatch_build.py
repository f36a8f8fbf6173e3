"""Compile healthgate's C speedups (src/healthgate/_speedups.c, which includes _kept.c) as the package
is installed - `pip install .` or `pip install -e .` - with the machine's C
compiler ($CC, else the one Python was built with) and Python's headers.

Optional by design: without a compiler or the headers (or with
HEALTHGATE_NO_COMPILE=1) the install goes on and the pure-Python path runs
(healthgate/http_scan.py); the reason is printed. The module is
built in place, next to its source, so an editable install finds it too;
a wheel carries it as an artifact (and is then tagged for this platform).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("src/healthgate/_speedups.c")


def compile_speedups(root: Path) -> tuple[Path | None, str]:
    """Build the extension next to its source: (its path, "") or (None, why not)."""
    source = root / SOURCE
    target = source.with_name("_speedups" + str(sysconfig.get_config_var("EXT_SUFFIX")))
    target.unlink(missing_ok=True)  # (never an older build left behind, whatever happens next)
    if os.environ.get("HEALTHGATE_NO_COMPILE", "") not in ("", "0"):
        return None, "HEALTHGATE_NO_COMPILE is set"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        return None, f"Python's headers are not installed ({include}/Python.h; Debian: python3-dev)"
    compiler = shlex.split(os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc"))
    command = [
        *compiler,
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        f"-I{include}",
        str(source),
        "-o",
        str(target),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"no C compiler ({compiler[0]}: {exc}; Debian: gcc)"
    if done.returncode != 0:
        return None, f"{shlex.join(command)} failed:\n{done.stderr.strip()}"
    return target, ""


class SpeedupsBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        built, why = compile_speedups(Path(self.root))
        if built is None:
            print(
                f"healthgate: C speedups not built, the pure-Python path will run: {why}",
                file=sys.stderr,
            )
            return
        print(f"healthgate: C speedups built: {built}", file=sys.stderr)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":  # (an editable install reads it where it was built)
            relative = built.relative_to(Path(self.root) / "src")
            build_data["force_include"][str(built)] = str(relative)
