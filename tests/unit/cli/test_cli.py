import argparse
import json
import os
import subprocess
import sys

import pytest

from rlhf_async import __version__
from rlhf_async.cli import main
from rlhf_async.cli.main import _build_parser

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


_STOP_IN_SHUTDOWN = """
import os, signal, sys, time
from rlhf_async.cli.main import entry

class StopInShutdown:  # a module global: its __del__ runs in Python's own shutdown
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)

stop = StopInShutdown()
sys.argv = ["rlhf-async", "version"]
entry()
"""


def test_a_stop_after_the_command_returned_does_not_kill_the_process():
    """A SIGTERM that lands in Python's shutdown (after a finished run's summary) killed
    the process with rc -15: the entry exits as soon as the command's output is out."""
    p = subprocess.run([sys.executable, "-c", _STOP_IN_SHUTDOWN], capture_output=True,
                       text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, f"rlhf-async {__version__}\n"), p.stderr


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlhf-async {__version__}"


def test_user_errors_are_one_line_exit_1(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--messages", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--messages must be >= 1" in err[0], err


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["run", "missing.toml"], ["config file 'missing.toml': not found"]),
        (["run", "colour=red"], ["colour: unknown key; accepted: run, model"]),
        (["run", "train.steps=abc", "algo.name=dpo", "train.lr=-1"],
         ["train.steps: expected integer", "algo.name: 'dpo' is not one of", "train.lr"]),
        (["run", "placement.strategy=separation", "placement.devices=2",
          "placement.generator=[0, 7]"], ["placement.generator: device ids [7] outside 0..1"]),
        (["resume", "nowhere"], ["nowhere"]),
    ],
)
def test_run_config_errors_list_every_problem_without_traceback(argv, fragments, capsys, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


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


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_dry_run_places_cuda_defaults_and_writes_nothing(strategy, tmp_path, capsys):
    """No GPU here: the cuda defaults (bf16 everywhere) validate and place; nothing starts."""
    rc = main(["run", "--dry-run", "placement.device=cuda", "placement.devices=8",
               f"placement.strategy={strategy}", f"run.output_dir={tmp_path / 'runs'}",
               "run.name=dry"])
    out = capsys.readouterr().out
    assert rc == 0 and "nothing was started or written" in out
    assert f"run directory: {tmp_path / 'runs' / 'dry'}" in out
    assert out.count("bf16") >= 4 and "cuda:7" in out
    assert not (tmp_path / "runs").exists()


def test_dry_run_prints_the_engines_that_run(tmp_path, capsys):
    rc = main(["run", "--dry-run", "placement.strategy=separation", "placement.devices=2",
               "train.backend=deepspeed", f"run.output_dir={tmp_path}"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert rc == 0
    assert "deepspeed" in rows["actor"] and "deepspeed" not in rows["reward"]


def test_dry_run_reports_what_the_runner_refuses(tmp_path, capsys):
    rc = main(["run", "--dry-run", "placement.dtype=[\"actor=fp16\"]",
               f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "actor=fp16 trains only with loss scaling" in err
    assert not any(tmp_path.iterdir())


def test_run_says_something_before_torch_loads(tmp_path):
    """The first line comes before the imports that take seconds (torch, transformers)."""
    p = subprocess.Popen([sys.executable, "-m", "rlhf_async", "run", "train.steps=1",
                          f"run.output_dir={tmp_path}"], stderr=subprocess.PIPE, text=True,
                         stdout=subprocess.DEVNULL)
    try:
        first = p.stderr.readline()
        assert first == "[start] loading torch and transformers\n"
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize(("counts", "config", "fragment"), [
    (["workers=2"], None, "unknown key 'workers'; accepted: generators, scorers"),
    (["generators=0"], None, "generators=0: a count must be at least 1"),
    (["generators=2"], None, "holds no job"),
    (["generators=2"], "flattening", "scale changes a running separation job only"),
    (["scorers=2"], "separation", "no running job in"),
])
def test_scale_refusals_are_one_line(counts, config, fragment, tmp_path, capsys):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps({"placement": {"strategy": config}}))
    assert main(["scale", str(tmp_path), *counts]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def _commands(parser) -> list[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_help_names_every_command_once_in_its_description(capsys):
    """`--help` opened with 10 of its 19 commands and a trailing comma: the summary is
    the parser's own list of commands."""
    parser = _build_parser()
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    summary = " ".join(out.split("positional arguments:")[0].splitlines()[1:]).strip()
    assert [w.strip(",.") for w in summary.split("commands:")[1].split()] == \
        _commands(parser)
    assert len(_commands(parser)) >= 19 and not summary.endswith(",")
