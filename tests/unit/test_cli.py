import json
import os
import subprocess
import sys

import pytest

from rlhf_async import __version__
from rlhf_async.cli import _demo_settings, main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "argv",
    [[], ["bogus"], ["demo", "--messages", "x"], ["demo", "--transport", "udp"],
     ["status", "--nope"], ["version", "extra"]],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlhf-async") and "error:" in err[0]


def test_bad_subcommand_in_a_real_process_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "rlhf_async", "frobnicate"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "invalid choice: 'frobnicate'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlhf-async {__version__}"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["run", "missing.json"], "cannot read config missing.json"),
        (["run", "colour=red"], "unknown setting 'colour'; accepted: floats, hwm"),
        (["run", "messages=abc"], "must be int"),
        (["run", "messages=0"], "must be >= 1"),
        (["run", "transport=udp"], "accepted: ipc, tcp"),
        (["demo", "--messages", "0"], "--messages must be >= 1"),
    ],
)
def test_user_errors_are_one_line_exit_1(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_run_reads_json_config_and_overrides(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"messages": 5, "transport": "tcp"}))
    assert _demo_settings(str(cfg), ["messages=7", "hwm=3"]) == \
        {"messages": 7, "transport": "tcp", "hwm": 3}
    assert _demo_settings("floats=9", []) == {"floats": 9}
    cfg.write_text("[1, 2]")
    with pytest.raises(Exception, match="must be a JSON object"):
        _demo_settings(str(cfg), [])


@pytest.mark.parametrize("command", ["status", "stop"])
def test_no_coordinator_running(command, tmp_path, capsys):
    assert main([command, "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no coordinator running" in err[0]


def test_stale_coordinator_file(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "coordinator.json").write_text(
        json.dumps({"control": "ipc:///tmp/nothing-here", "pid": gone.pid}))
    assert not os.path.exists(f"/proc/{gone.pid}")
    assert main(["status", "--run-dir", str(tmp_path)]) == 1
    assert "stale file" in capsys.readouterr().err


def test_unanswered_coordinator_times_out(tmp_path, capsys):
    (tmp_path / "coordinator.json").write_text(
        json.dumps({"control": "ipc:///tmp/rlhf-nobody-listens", "pid": os.getpid()}))
    assert main(["status", "--run-dir", str(tmp_path), "--timeout", "0.3"]) == 1
    assert "did not answer in 0.3s" in capsys.readouterr().err
