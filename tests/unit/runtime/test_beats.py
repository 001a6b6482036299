"""Heartbeats that cost the coordinator nothing per beat: the shared board's slots, how often
a node beats, and when a beat over the socket asks for an answer."""

import pytest

from rlhf_async.runtime.beats import COORDINATOR, SLOT_BYTES, BeatBoard
from rlhf_async.runtime.process import asks_answer, beat_every


def test_a_stamp_written_through_one_mapping_is_read_through_another(tmp_path):
    path = tmp_path / "beats"
    coordinator = BeatBoard.create(path, slots=4)
    node = BeatBoard.open(path)  # what a node process maps
    assert path.stat().st_size == 4 * SLOT_BYTES and node.slots == 4
    assert [coordinator.read(i) for i in range(4)] == [0.0] * 4  # never stamped
    node.stamp(3, 1234.5)
    coordinator.stamp(COORDINATOR, 99.25)
    assert coordinator.read(3) == 1234.5 and node.read(COORDINATOR) == 99.25
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    node.close()
    coordinator.close()


def test_a_board_file_cut_short_is_refused(tmp_path):
    (tmp_path / "beats").write_bytes(b"")
    with pytest.raises(ValueError):  # mmap of an empty file: the node beats over the socket
        BeatBoard.open(tmp_path / "beats")


@pytest.mark.parametrize(("heartbeat_s", "orphan_s", "every"),
                         [(2.0, 30.0, 2.0), (6.0, 10.0, 2.5), (0.1, 1.0, 0.1)])
def test_a_node_beats_at_the_coordinators_pace_unless_its_orphan_timeout_needs_more(
        heartbeat_s, orphan_s, every):
    assert beat_every(heartbeat_s, orphan_s) == every


def test_a_beat_asks_for_an_answer_only_after_a_third_of_the_orphan_timeout():
    assert not asks_answer(silent_s=9.9, orphan_timeout_s=30.0)
    assert asks_answer(silent_s=10.1, orphan_timeout_s=30.0)
