import json
import multiprocessing

import structlog

from rlhf_async.log import configure_logging


def test_json_logs_carry_bound_fields(capsys):
    configure_logging("info", json=True)
    structlog.get_logger().bind(role="trainer", node_id="t0").info("hello", step=3)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    record = json.loads(line)
    assert record["event"] == "hello"
    assert record["role"] == "trainer" and record["node_id"] == "t0" and record["step"] == 3
    assert record["level"] == "info"


# the console a person reads, and the run's log file that keeps every record as JSON

from rlhf_async.log import log_to_file  # noqa: E402

LONG_ERROR = ("run() raised ValueError: this agent is broken on purpose "
              + "x" * 400 + " (at /tmp/agent.py:2)")


def test_a_human_console_gets_one_short_line_per_event_and_the_file_the_json(
        capsys, tmp_path):
    """An `agent episode failed` warning was a ~500-character JSON line in the middle of
    the progress lines: the console gets one short human line, the file the record."""
    configure_logging("warning", json=False)
    log = structlog.get_logger(component="episodes")
    with log_to_file(tmp_path / "logs" / "job.log"):
        log.warning("agent episode failed", env="agent.py:run", count=100, error=LONG_ERROR)
        log.info("agent endpoint listening", url="http://127.0.0.1:1")  # below the level
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and not err[0].startswith("{")
    assert err[0].startswith("[episodes] warning: agent episode failed: ")
    assert "error=run() raised ValueError: this agent is broken" in err[0]
    assert len(err[0]) <= 240
    records = [json.loads(x) for x in (tmp_path / "logs" / "job.log").read_text().splitlines()]
    assert [r["event"] for r in records] == ["agent episode failed", "agent endpoint listening"]
    assert records[0]["error"] == LONG_ERROR and records[0]["count"] == 100


def test_what_the_run_decided_shows_on_the_console_at_its_default_level(capsys, tmp_path):
    """An info event carrying `console=` (a decision: the engine auto chose, a rebalance)
    is a human line at the default level; its fields stay in the file."""
    configure_logging("warning", json=False)
    log = structlog.get_logger(component="rebalance")
    with log_to_file(tmp_path / "job.log"):
        log.info("rebalance_decision", gain=0.02, console="kept 1 generator + 2 scorers")
    assert capsys.readouterr().err == "[rebalance] kept 1 generator + 2 scorers\n"
    (record,) = [json.loads(x) for x in (tmp_path / "job.log").read_text().splitlines()]
    assert record["event"] == "rebalance_decision" and record["gain"] == 0.02
    assert "console" not in record
    configure_logging("error", json=False)  # asked for errors only: not even decisions
    log.info("rebalance_decision", console="kept")
    assert capsys.readouterr().err == ""
    configure_logging("warning", json=False)
    with log_to_file(tmp_path / "quiet.log", decisions=False):  # run.progress = false
        log.info("rebalance_decision", console="kept")
        log.warning("careful")
    assert capsys.readouterr().err == "[rebalance] warning: careful\n"


def test_records_before_the_run_directory_is_known_reach_its_file(capsys, tmp_path):
    configure_logging("warning", json=False)
    structlog.get_logger().info("auto placement", strategy="separation")
    with log_to_file(tmp_path / "a.log"):
        structlog.get_logger().info("in the run")
    structlog.get_logger().info("before the next run")  # the file is closed: not in it
    with log_to_file(tmp_path / "b.log"):
        pass

    def events(name: str) -> list[str]:
        return [json.loads(x)["event"] for x in (tmp_path / name).read_text().splitlines()]
    assert events("a.log") == ["auto placement", "in the run"]
    assert events("b.log") == ["before the next run"]  # the first run's records are not
    assert capsys.readouterr().err == ""


def test_an_exception_is_its_last_line_on_the_console(capsys, tmp_path):
    configure_logging("warning", json=False)
    try:
        raise OSError("disk full")
    except OSError:
        structlog.get_logger(component="job").exception("checkpoint failed", step=3)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "[job] error: checkpoint failed: step=3 (OSError: disk full)"


def test_json_consoles_stay_json_and_decisions_keep_their_level(capsys):
    """A node process's stderr is its log file: JSON, at its level."""
    configure_logging("warning", json=True)
    structlog.get_logger().info("decided", console="a line for people")
    structlog.get_logger().warning("careful", console="careful, people")
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["event"] == "careful"


def test_a_forked_child_does_not_write_into_its_parents_log_file(tmp_path):
    """A process forked while a job's file is open (a fork server, a rank) inherits it:
    its records are its own log's business, not lines interleaved in the job's."""
    configure_logging("warning", json=False)
    ctx = multiprocessing.get_context("fork")
    with log_to_file(tmp_path / "job.log"):
        structlog.get_logger().info("parent")
        child = ctx.Process(target=_log_in_child)
        child.start()
        child.join(30)
        structlog.get_logger().info("parent again")
    assert child.exitcode == 0
    events = [json.loads(x)["event"] for x in (tmp_path / "job.log").read_text().splitlines()]
    assert events == ["parent", "parent again"]


def _log_in_child() -> None:
    structlog.get_logger().info("child")
    configure_logging("warning", json=False)  # a node configuring its own logging
    structlog.get_logger().info("child, configured")
