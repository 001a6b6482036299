import json

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
