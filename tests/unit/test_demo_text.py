"""What the demo tells a newcomer: commands that work where the API really is."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from healthgate.runtime.demo import DemoSettings, print_intro


def test_commands_name_the_server_when_the_api_is_not_at_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    nodes = {"b": ("http://127.0.0.1:7501", subprocess.Popen(["true"]))}
    print_intro("http://127.0.0.1:7500", DemoSettings(), Path("w.yaml"), nodes)
    text = capsys.readouterr().out
    assert "get fr --project web --server http://127.0.0.1:7500" in text
    assert "events --project shop --follow --server http://127.0.0.1:7500" in text
    assert "curl -s http://127.0.0.1:7500/v1/cluster" in text
    assert "localhost:7400" not in text
    nodes["b"][1].wait()


def test_at_the_default_address_the_commands_stay_short(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_intro("http://127.0.0.1:7400", DemoSettings(), Path("w.yaml"))
    text = capsys.readouterr().out
    assert "get fr --project web " in text and "--server" not in text
