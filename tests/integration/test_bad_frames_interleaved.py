"""Issue 28: bad frames interleaved with good batches cost no accepted data, through a real `serve`.

A publisher sends three good batches on each stream and, before each of the
last two, every malformed class (``support.raw_stream``) under the seq of
the good batch just before it -- the frames that once made the sequencing
take a malformed payload for a publisher restart and drop the engine. One
stream has no replay endpoint (a loss there cannot be healed, so a false
gap or restart would show at once), the other has one.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from support import wait_until
from support.raw_stream import BAD_PAYLOADS, RawStream, every_bad_frame
from support.server import BLOCK, ServeProcess, batch, nonzero, stored, tokens

from tokenspeed_router.events import encode_batch

A = tokens(1, 3)
B = tokens(2, 2)
GOOD = [
    encode_batch(batch(stored(A[: 2 * BLOCK]))),
    encode_batch(batch(stored(A[2 * BLOCK :], parent_tokens=A[: 2 * BLOCK])), wire_format="array"),
    encode_batch(batch(stored(B))),
]


@pytest.mark.parametrize("replay", [False, True], ids=["events_only", "with_replay"])
def test_bad_frames_with_reused_seqs_cost_nothing(tmp_path: Path, replay: bool) -> None:
    with RawStream(replay=replay) as stream:
        spec = f"name=w0,events={stream.endpoint}"
        if stream.replay_endpoint:
            spec += f",replay={stream.replay_endpoint}"
        with ServeProcess(["--worker", spec], tmp_path).start() as serve:
            stream.wait_subscribed()
            stream.publish(0, GOOD[0])
            wait_until(lambda: serve.workers()["w0"]["last_seq"] == 0, 10, what="the first batch")
            sent_bad = 0
            for seq in (1, 2):
                for frames in every_bad_frame(b"", seq - 1):
                    stream.send_frames(frames)
                    sent_bad += 1
                for frames in every_bad_frame(b"", seq):  # and under the seq due next
                    stream.send_frames(frames)
                    sent_bad += 1
                stream.publish(seq, GOOD[seq])
            wait_until(lambda: serve.workers()["w0"]["last_seq"] == 2, 10, what="the last batch")
            w0 = serve.workers()["w0"]
            wait_until(lambda: serve.workers()["w0"]["malformed_frames"] == sent_bad, 10,
                       what=f"{sent_bad} malformed frames counted")
            w0 = serve.workers()["w0"]
            assert (w0["state"], w0["restarts"], w0["resyncs"], w0["epoch"]) == ("live", 0, 0, 0), w0
            assert w0["batches_applied"] == 3
            causes = w0["malformed_by_cause"]
            assert causes["payload_decode"] >= len(BAD_PAYLOADS) and causes["no_known_events"] >= 8, causes
            assert nonzero(serve.post("/match", {"token_ids": A})["scores"]) == {"w0": 3}
            assert nonzero(serve.post("/match", {"token_ids": B})["scores"]) == {"w0": 2}
            metrics = serve.http.get("/metrics").text
            assert 'tokenspeed_ingest_malformed_frames_by_cause_total{cause="no_known_events",worker="w0"}' in metrics


def test_a_real_restart_still_counts(tmp_path: Path) -> None:
    """The fix must not blind the sequencing: a valid batch under seq 0 with new content is a restart."""
    with RawStream(replay=False) as stream, ServeProcess(
        ["--worker", f"name=w0,events={stream.endpoint}"], tmp_path
    ).start() as serve:
        stream.wait_subscribed()
        for seq in range(3):
            stream.publish(seq, GOOD[seq])
        wait_until(lambda: serve.workers()["w0"]["last_seq"] == 2, 10, what="three batches")
        for frames in every_bad_frame(b"", 0):
            stream.send_frames(frames)
        stream.publish(0, encode_batch(batch(stored(tokens(3, 1)), ts=9.0)))  # the new process
        wait_until(lambda: serve.workers()["w0"]["restarts"] == 1, 10, what="the restart")
        wait_until(lambda: serve.workers()["w0"]["last_seq"] == 0, 10, what="the new first batch")
        assert nonzero(serve.post("/match", {"token_ids": A})["scores"]) == {}
        assert nonzero(serve.post("/match", {"token_ids": tokens(3, 1)})["scores"]) == {"w0": 1}


def test_bad_payload_classes_really_are_bad() -> None:
    """Each class is refused by the typed decoder or carries only unknown kinds (else the test above proves nothing)."""
    from tokenspeed_router.errors import WireError
    from tokenspeed_router.events import BatchDecoder
    from tokenspeed_router.events.codec import only_unknown_events

    decoder = BatchDecoder()
    for name, payload in BAD_PAYLOADS.items():
        try:
            got = decoder.decode(payload)
        except WireError:
            continue
        assert only_unknown_events(got, payload), name
    assert msgspec.msgpack.decode(GOOD[0])  # the good ones are good
