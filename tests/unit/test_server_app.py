"""RouterService: the ingestion seam, leader-style ingestion control, restore hooks."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import msgspec
import pytest
from support import wait_until
from support.server import batch, nonzero, stored, tokens

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.log import EventLogReader
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.subscriber import ResyncNeeded, SubscriberItem
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.router.router import RouterConfig
from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec
from tokenspeed_router.server.app import NullIngestSink, RecordingSink
from tokenspeed_router.server.openapi import EngineBeliefAnswer
from tokenspeed_router.tools.cli_replay import answer_queries


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
        assert not service.ingesting and service.workers()["w0"]["role"] == "decode"
        a = tokens(1, 3)
        pub.publish(batch(stored(a)))  # seq 0, before anyone subscribed
        pub.wait_sent(5)
        service.start_ingestion({"w0": 0})  # resume from seq 0: replayed from the ring
        wait_until(lambda: service.match(a).scores.get("w0") == 3, 10, what="replayed from start_seq")
        assert sinks[0].items and service.ingesting
        service.stop_ingestion()
        pub.publish(batch(stored(tokens(2, 1))))
        pub.wait_sent(5)
        assert nonzero(service.match(tokens(2, 1)).scores) == {}  # not subscribed any more
        assert nonzero(service.match(a).scores) == {"w0": 3}  # the index is kept
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
    assert service.workers()["d"]["state"] == "resyncing"
    assert service.router.workers()["d"].cold
    snapshot = service.index.snapshot()
    with service.locked():
        service.replace_index(KvIndex.restore(snapshot))
        service.ingestor.on_item(ResyncNeeded("d", 1, 5, "restored", 0))
        service.ensure_worker_locked("d")
    info = service.router.workers()
    assert info["d"].cold and info["p"].role.value == "prefill"
    assert service.workers()["d"]["state"] == "resyncing"
    service.stop()


#: ZeroMQ refuses this at connect time (an ipc path longer than sockaddr_un allows),
#: although it is a well-formed endpoint: the failure happens inside ``start``
_TOO_LONG_IPC = "ipc:///tmp/" + "x" * 200


def test_failed_start_closes_everything(tmp_path: Path) -> None:
    """A subscription that fails at start leaves no socket open: stop() (and the
    process exit) must not block in Context.term, and the error names the endpoint."""
    log = tmp_path / "e.tslog"
    good = WorkerSpec(name="ok", events="ipc://" + str(tmp_path / "ok.sock"))
    bad = WorkerSpec(name="bad", events=_TOO_LONG_IPC)
    service = RouterService(ServerConfig(http=None, record=str(log), workers=(good, bad)))
    with pytest.raises(ConfigError, match=r"worker 'bad': cannot connect to its events endpoint ipc:///tmp/xxx"):
        service.start()
    assert service.context.closed  # every socket closed with linger 0, context terminated
    assert not service.serving
    service.stop()  # idempotent, returns at once
    with EventLogReader(log) as reader:  # the event log was closed (its header is complete)
        assert list(reader.records()) == []


def test_failed_start_with_a_borrowed_context_leaks_no_socket(tmp_path: Path) -> None:
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        service = RouterService(ServerConfig(http=None, workers=(WorkerSpec(name="bad", events=_TOO_LONG_IPC),)),
                                context=ctx)
        with pytest.raises(ConfigError, match="cannot connect"):
            service.start()
        service.stop()
    finally:
        ctx.term()  # would block forever on a leaked socket (pytest-timeout would fail the test)


def test_put_worker_with_an_unusable_endpoint_is_a_400_and_leaks_nothing() -> None:
    from tokenspeed_router.errors import RouterApiError

    service = RouterService(ServerConfig(http=None))
    service.start()
    try:
        with pytest.raises(RouterApiError, match="cannot connect") as err:
            service.put_worker(WorkerSpec(name="bad", events=_TOO_LONG_IPC))
        assert err.value.status == 400
        assert "bad" not in service.workers()
    finally:
        service.stop()  # ctx.term() returns: the probe socket was closed


def test_record_log_names_its_source(tmp_path: Path) -> None:
    log = tmp_path / "r.tslog"
    config = ServerConfig(http=None, record=str(log))
    service = RouterService(config, sink_factory=lambda _s: NullIngestSink(), record_source="tokenspeed-router record")
    service.start()
    service.stop()
    with EventLogReader(log) as reader:
        assert reader.meta["source"] == "tokenspeed-router record"


def test_workers_is_a_name_to_info_object() -> None:
    """DESIGN §6, GET /workers: per worker role, state, blocks held, last seq, events applied, lag."""
    service = RouterService(ServerConfig(http=None), wall_clock=lambda: 11.5)
    service.preset_roles({"p": "prefill"})
    service.apply_record("p", 3, batch(stored(tokens(1, 2)), ts=10.0), 1.0)
    workers = service.workers()
    assert set(workers) == {"p"}
    info = workers["p"]
    assert info["role"] == "prefill" and info["state"] == "live"
    assert info["blocks"] == info["blocks_held"] == 2
    assert info["last_seq"] == 3 and info["events_applied"] == 1
    assert info["lag_s"] == info["lag"] == pytest.approx(1.5)
    assert info["engine_belief"] is None  # never routed to: the cost model has no belief yet
    service.stop()


def test_workers_show_what_the_cost_model_believes_of_each_engine() -> None:
    service = RouterService(ServerConfig(http=None), wall_clock=lambda: 11.5)
    service.apply_record("w0", 0, batch(stored(tokens(1, 2)), ts=10.0), 1.0)
    service.route(tokens(1, 4), request_id="r1")
    belief = service.workers()["w0"]["engine_belief"]
    assert belief["queued_prefills"] == 1 and belief["queue_s"] > 0.0
    assert belief["prefill_tokens_per_s"] == RouterConfig().prefill_tokens_per_s  # the prior, unfitted
    assert belief["resident_new_tokens"] > 0 and belief["residence_s"] == 0.0  # pinned; no stay seen yet
    msgspec.convert(belief, EngineBeliefAnswer)  # what the OpenAPI document says
    service.release("r1")
    assert service.workers()["w0"]["engine_belief"]["resident_new_tokens"] == 0
    service.stop()


def test_replay_queries_accept_a_lora_name() -> None:
    service = RouterService(ServerConfig(http=None))
    a = tokens(1, 2)
    service.apply_record("named", 0, batch(msgspec.structs.replace(stored(a), lora_name="sql")), 1.0)
    out = io.StringIO()
    lines = [msgspec.json.encode({"token_ids": a, "lora_id": q}).decode() for q in ("sql", 3, "")]
    assert answer_queries(service, lines, out) == 3
    answers = [msgspec.json.decode(line) for line in out.getvalue().splitlines()]
    assert nonzero(answers[0]["scores"]) == {"named": 2}
    assert nonzero(answers[1]["scores"]) == {}
    assert "$.lora_id" in answers[2]["error"]
    service.stop()


def test_wait_ingest_loop_wakes_on_start_and_on_stop() -> None:
    """A state backend that wins the lease during start() waits on an event, not a poll."""
    results: list[bool] = []

    class EarlySink(LeaderSink):
        def __init__(self, service: RouterService) -> None:
            super().__init__(service)
            assert not service.ingest_loop_running  # built before the loop exists
            self.waiter = threading.Thread(target=lambda: results.append(service.wait_ingest_loop(30.0)))
            self.waiter.start()

    sinks: list[EarlySink] = []

    def factory(service: RouterService) -> EarlySink:
        sinks.append(EarlySink(service))
        return sinks[-1]

    with RouterService(ServerConfig(http=None), sink_factory=factory) as service:
        wait_until(lambda: results, 10.0, what="the waiter to wake once the loop runs")
        assert results == [True] and service.ingest_loop_running
    sinks[0].waiter.join(5.0)

    # A service that stops while a waiter waits answers False at once, not after the timeout.
    idle = RouterService(ServerConfig(http=None))
    late: list[bool] = []
    waiter = threading.Thread(target=lambda: late.append(idle.wait_ingest_loop(300.0)))
    waiter.start()
    idle.stop()
    waiter.join(10.0)
    assert late == [False] and not waiter.is_alive()


def test_domain_errors_map_to_api_statuses_in_one_place() -> None:
    """Membership and query errors are domain errors; server/api.py gives each its status."""
    from tokenspeed_router.errors import (
        InvalidRequestError,
        NoWorkerAvailableError,
        RouterApiError,
        ServiceNotIngestingError,
        TokenspeedError,
        UnknownWorkerError,
        WireError,
        WorkerConflictError,
    )
    from tokenspeed_router.server.api import api_error

    cases: list[tuple[TokenspeedError, int, str]] = [
        (WireError("bad"), 400, "invalid token_ids: bad"),
        (InvalidRequestError("cannot subscribe"), 400, "cannot subscribe"),
        (ConfigError("worker spec"), 400, "worker spec"),
        (UnknownWorkerError("unknown worker 'x'"), 404, "unknown worker 'x'"),
        (WorkerConflictError("in use"), 409, "in use"),
        (ServiceNotIngestingError("not ingesting"), 409, "not ingesting"),
        (NoWorkerAvailableError("none"), 503, "no worker available: none"),
        (TokenspeedError("surprise"), 500, "internal error: surprise"),
    ]
    for err, status, message in cases:
        mapped = api_error(err)
        assert (mapped.status, mapped.message) == (status, message), err
    passed = RouterApiError(413, "too big")
    assert api_error(passed) is passed

    # The service raises them through the mapping: a 404 for an unknown worker,
    # a 409 for a rank deleted on its own and for a name in use.
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    spec = WorkerSpec(name="w", events=pub.endpoint, replay=pub.replay_endpoint, dp_ranks=1)
    try:
        with RouterService(ServerConfig(http=None, workers=(spec,))) as service:
            with pytest.raises(RouterApiError) as unknown:
                service.delete_worker("nope")
            assert unknown.value.status == 404
            clash = WorkerSpec(name="w2", events=pub.endpoint)
            with pytest.raises(RouterApiError, match="already used by worker 'w'") as conflict:
                service.put_worker(clash)
            assert conflict.value.status == 409
    finally:
        pub.close()


def test_queries_return_typed_answers_and_raise_domain_errors() -> None:
    """No dicts cross the seam: JSON is made by the transports; errors are domain errors."""
    from tokenspeed_router.errors import NoWorkerAvailableError, WireError
    from tokenspeed_router.router import MatchDetail, RouteDecision

    service = RouterService(ServerConfig(http=None))
    try:
        with pytest.raises(NoWorkerAvailableError):
            service.route(tokens(1, 2))
        a = tokens(1, 3)
        service.apply_record("w0", 0, batch(stored(a)), 1.0)
        service.apply_record("w1", 0, batch(stored(a[:16])), 1.0)
        m = service.match(a)
        assert isinstance(m, MatchDetail) and m.to_dict() == {
            "scores": {"w0": 3, "w1": 1}, "block_size": {"w0": 16, "w1": 16},
            "tiers": {"w0": {"gpu": 3, "cpu": 0, "storage": 0}, "w1": {"gpu": 1, "cpu": 0, "storage": 0}}}
        d = service.route(a, request_id="q", explain=True)
        assert isinstance(d, RouteDecision) and (d.worker, d.matched_tokens, d.block_size) == ("w0", 48, 16)
        assert d.index_match == m and d.indexed_tokens("w1") == 16  # the gateway's prediction, no second walk
        assert d.explanation is not None and d.explanation.worker == "w0"
        with pytest.raises(WireError):
            service.match([-1] * 16)
        with pytest.raises(WireError):
            service.route([2**64] * 16)
    finally:
        service.stop()
