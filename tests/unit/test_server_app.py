"""RouterService: the ingestion seam, leader-style ingestion control, restore hooks."""

from __future__ import annotations

from pathlib import Path

from server_support import batch, stored, tokens
from support import wait_until

from tokenspeed_router.events.log import EventLogReader
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.subscriber import ResyncNeeded, SubscriberItem
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec
from tokenspeed_router.server.app import RecordingSink


class LeaderSink:
    """A replicated-backend stand-in: subscribes only when told, applies what it gets."""

    manages_ingestion = True

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.items: list[SubscriberItem] = []
        self.closed = False

    def submit(self, item: SubscriberItem) -> None:
        self.items.append(item)
        self.service.apply_item(item)

    def close(self) -> None:
        self.closed = True


def test_sink_controls_ingestion_and_recording(tmp_path: Path) -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    log = tmp_path / "e.tslog"
    config = ServerConfig(
        http=None, record=str(log),
        workers=(WorkerSpec(name="w0", events=pub.endpoint, replay=pub.replay_endpoint, role="decode"),),
    )
    sinks: list[LeaderSink] = []

    def factory(service: RouterService) -> LeaderSink:
        sinks.append(LeaderSink(service))
        return sinks[0]

    service = RouterService(config, sink_factory=factory)
    service.start()
    try:
        assert not service.ingesting and service.workers()["workers"]["w0"]["role"] == "decode"
        a = tokens(1, 3)
        pub.publish(batch(stored(a)))  # seq 0, before anyone subscribed
        pub.wait_sent(5)
        service.start_ingestion({"w0": 0})  # resume from seq 0: replayed from the ring
        wait_until(lambda: service.match(a)["scores"].get("w0") == 3, 10, what="replayed from start_seq")
        assert sinks[0].items and service.ingesting
        service.stop_ingestion()
        pub.publish(batch(stored(tokens(2, 1))))
        pub.wait_sent(5)
        assert service.match(tokens(2, 1))["scores"] == {}  # not subscribed any more
        assert service.match(a)["scores"] == {"w0": 3}  # the index is kept
        assert isinstance(service.recorder, RecordingSink) and service.recorder.records == 1
    finally:
        service.stop()
        pub.close()
    assert sinks[0].closed
    with EventLogReader(log) as reader:
        records = list(reader.records())
        assert reader.meta["workers"][0]["name"] == "w0"
    assert [(r.worker, r.seq) for r in records] == [("w0", 0)]


def test_resync_marks_cold_and_restore_hooks_keep_roles() -> None:
    service = RouterService(ServerConfig(http=None))
    service.preset_roles({"p": "prefill", "d": "decode"})
    service.apply_record("d", 0, batch(stored(tokens(1, 2))), 1.0)
    service.apply_item(ResyncNeeded("d", 1, 5, "test", 0))
    assert service.workers()["workers"]["d"]["state"] == "resyncing"
    assert service.router.workers()["d"].cold
    snapshot = service.index.snapshot()
    with service.locked():
        service.replace_index(KvIndex.restore(snapshot))
        service.ingestor.on_item(ResyncNeeded("d", 1, 5, "restored", 0))
        service.ensure_worker_locked("d")
    info = service.router.workers()
    assert info["d"].cold and info["p"].role.value == "prefill"
    assert service.workers()["workers"]["d"]["state"] == "resyncing"
    service.stop()
