"""The Tinker API's plumbing: the protobuf messages against the SDK's own encoder and
decoder (when the `tinker` SDK is installed), training requests run in seq_id order, and
the server's start-up checks."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys

import numpy as np
import pytest

from rlhf_async.ops.tinker import proto
from rlhf_async.ops.tinker.futures import ApiError, Futures, Sequencer, Worker
from rlhf_async.ops.tinker.server import ApiConfigError, check_key, parse_address


def test_a_forward_backward_request_from_the_sdk_parses() -> None:
    pytest.importorskip("tinker")
    import torch
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    weights = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8],
                                        "advantages": np.array([0.5, -1.0, 2.0]),
                                        "weights": weights})  # 2-d: sent as sparse CSR
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="s:train:0", seq_id=3)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    got = proto.parse_forward_backward(msg.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 3, "ppo",
                                                                           True)
    assert got.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert got.data[0].tokens == [5, 6, 7] and not got.problem
    assert got.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert got.data[0].inputs["advantages"].tolist() == [0.5, -1.0, 2.0]
    assert got.data[0].inputs["weights"].tolist() == weights.tolist()


def test_outputs_decode_with_the_sdk() -> None:
    pytest.importorskip("tinker")
    from tinker.proto.response_conv import (
        deserialize_forward_backward_output,
        deserialize_sample_response,
    )

    out = deserialize_forward_backward_output(proto.forward_backward_output(
        [{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-0.5])}],
        {"loss:sum": 3.5}))
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    sample = deserialize_sample_response(proto.sample_response(
        [proto.Sequence([3, 4], [-0.25, -0.5], True), proto.Sequence([9], [-1.0], False)],
        [float("nan"), -1.5]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([3, 4], [-0.25, -0.5], "stop"), ([9], [-1.0], "length")]
    assert sample.prompt_logprobs is not None and sample.prompt_logprobs[1] == -1.5


def test_a_broken_datum_fails_its_request_not_the_parse() -> None:
    # datum: one chunk whose tokens are 3 bytes (not int32s); model_id and seq_id are read
    chunk = proto.enc_bytes(1, proto.enc_bytes(1, b"\x01\x02\x03"))
    body = (proto.enc_bytes(1, b"m") + proto.enc_int(2, 7)
            + proto.enc_bytes(3, proto.enc_bytes(1, chunk)) + proto.enc_bytes(4, b"ppo"))
    got = proto.parse_forward_backward(body)
    assert (got.model_id, got.seq_id, got.loss_fn) == ("m", 7, "ppo")
    assert got.problem.startswith("datum 0:")
    with pytest.raises(proto.ProtoError, match="5 bytes announced, 3 left"):
        proto.parse_forward_backward(proto.enc_bytes(1, b"model")[:-2])
    assert list(proto.fields(struct.pack("<B", 0x11) + struct.pack("<d", 2.0))) == [
        (2, struct.pack("<d", 2.0))]


def test_training_requests_run_in_seq_id_order_and_a_retry_is_the_same_request() -> None:
    async def go() -> list[int]:
        futures = Futures()
        worker = Worker(futures)
        seq = Sequencer(worker)
        ran: list[int] = []

        def job(n: int) -> object:
            return lambda: (ran.append(n) or {"n": n}, "json")

        r3 = seq.submit(3, job(3), "c")
        r2 = seq.submit(2, job(2), "b")
        assert seq.blocked and ran == []  # 1 has not come
        r1 = seq.submit(1, job(1), "a")
        assert seq.submit(2, job(99), "b") == r2  # a retry: the request it already has
        with pytest.raises(ApiError, match="seq_id 0 is below"):
            seq.submit(0, job(0), "z")
        for rid in (r1, r2, r3):
            result = await futures.wait(rid, 10.0)
            assert result is not None and result.kind == "json"
        worker.shutdown()
        return ran

    assert asyncio.run(go()) == [1, 2, 3]


def test_a_seq_id_that_never_comes_fails_the_requests_after_it_not_a_hang() -> None:
    async def go() -> None:
        futures = Futures()
        worker = Worker(futures)
        now = [100.0]
        accepted: list[int] = []
        seq = Sequencer(worker, next_seq=5, gap_timeout_s=60.0, clock=lambda: now[0],
                        on_accept=accepted.append)
        ok = seq.submit(5, lambda: ({"n": 5}, "json"), "a")
        late = [seq.submit(s, lambda: ({"n": 0}, "json"), "forward_backward") for s in (7, 9)]
        assert accepted == [6, 8, 10] and seq.blocked  # 6 (and 8) never come
        now[0] = 159.0
        seq.expire(now[0])
        assert seq.blocked  # not yet 60 s
        now[0] = 161.0
        seq.expire(now[0])
        assert not seq.blocked and seq.next_seq == 10
        for rid in late:
            result = await futures.wait(rid, 1.0)
            assert result is not None and result.kind == "error"
            message, category = result.value
            assert "seq_id 6, 8, which never reached the server" in message
            assert category == "server"
        assert (await futures.wait(ok, 10.0)).kind == "json"  # type: ignore[union-attr]
        after = seq.submit(10, lambda: ({"n": 10}, "json"), "b")  # the order goes on
        assert (await futures.wait(after, 10.0)).kind == "json"  # type: ignore[union-attr]
        with pytest.raises(ApiError, match="accepted before a server restart is lost"):
            seq.submit(6, lambda: ({}, "json"), "a")
        worker.shutdown()

    asyncio.run(go())


def test_the_server_needs_a_key_off_loopback_and_a_tml_key() -> None:
    check_key("127.0.0.1", None)
    check_key("0.0.0.0", "tml-abc")
    with pytest.raises(ApiConfigError, match="a non-loopback address needs an API key"):
        check_key("0.0.0.0", None)
    with pytest.raises(ApiConfigError, match="must start with 'tml-'"):
        check_key("127.0.0.1", "secret")
    assert parse_address("[::1]:8000") == ("::1", 8000)
    with pytest.raises(ApiConfigError, match="expected HOST:PORT"):
        parse_address("8000")


def test_serve_api_refuses_a_public_address_without_a_key(tmp_path: object) -> None:
    proc = subprocess.run([sys.executable, "-m", "rlhf_async", "serve", "--api",
                           "0.0.0.0:0", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert proc.returncode == 1, proc.stderr
    assert "rlhf-async serve: error: --api 0.0.0.0: a non-loopback address needs an API " \
           "key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_results_older_than_an_hour_go_and_newer_ones_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhf_async.ops.tinker import futures as fmod

    f = Futures()
    clock = [1000.0]
    monkeypatch.setattr(fmod.time, "time", lambda: clock[0])
    old = [f.new() for _ in range(3)]
    for rid in old:
        f.done(rid, {})
    clock[0] += fmod.KEEP_S / 2
    young = f.new()
    f.done(young, {})
    clock[0] += fmod.KEEP_S / 2 + 1
    last = f.new()
    f.done(last, {})  # sweeps: the first three are past KEEP_S, `young` is not
    assert [f.known(r) for r in (*old, young, last)] == [False, False, False, True, True]
