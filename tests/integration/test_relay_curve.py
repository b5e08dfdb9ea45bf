"""Relay with ZeroMQ CURVE: an allow-listed router gets the stream, others get nothing."""

from __future__ import annotations

import time
from pathlib import Path

from support import wait_until
from support.relay import (
    Ctx,
    Engine,
    RelayThread,
    RouterView,
    assert_same_as_engine,
    handshake,
    workload,
)

from tokenspeed_router.events.curve import CurveClientKeys, generate_key_files


def test_allowed_router_receives_unknown_key_and_plaintext_get_nothing(ctx: Ctx, tmp_path: Path) -> None:
    relay_pub, relay_secret = generate_key_files(tmp_path / "relay", "relay")
    ok_pub, ok_secret = generate_key_files(tmp_path / "ok", "router")
    _, bad_secret = generate_key_files(tmp_path / "bad", "router")
    assert oct(relay_secret.stat().st_mode & 0o777) == "0o600"

    engine = Engine(ctx, buffer_steps=1000)
    relay = RelayThread(ctx, engine, buffer_steps=8, curve_secret_key=str(relay_secret),
                        curve_allow=(str(ok_pub),))
    endpoint, replay = relay.relay.endpoint, relay.relay.replay_endpoint
    allowed = RouterView(ctx, endpoint, replay, curve=CurveClientKeys.from_files(relay_pub, ok_secret))
    unknown = RouterView(ctx, endpoint, replay, curve=CurveClientKeys.from_files(relay_pub, bad_secret),
                         worker="intruder")
    plaintext = RouterView(ctx, endpoint, replay, worker="plain")
    try:
        handshake(engine, relay)
        prompts = workload(seed=11, n=40)
        engine.run(prompts)
        relay.wait_engine_seq(engine.last_seq)
        allowed.wait_seq(relay.last_seq)
        assert_same_as_engine(allowed, engine, prompts)
        assert relay.relay.statistics().curve_allowed >= 2  # SUB and replay DEALER

        wait_until(lambda: relay.relay.statistics().curve_rejected >= 1, 15,
                   what="the relay to refuse the unknown key")
        # Give the refused clients every chance: keep publishing and polling for a while.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            engine.probe()
            unknown.pump(0.02)
            plaintext.pump(0.02)
        def dealer_refused_too() -> bool:
            unknown.pump(0.01)
            return relay.relay.statistics().curve_rejected >= 2

        wait_until(dealer_refused_too, 15, what="the unknown key's replay DEALER to be refused")
        assert relay.relay.statistics().curve_rejected_keys == 1
        for view in (unknown, plaintext):
            stats = view.sub.statistics()
            assert stats.received == 0 and stats.delivered == 0, stats
            assert view.items == [] and view.blocks() == 0
    finally:
        for view in (allowed, unknown, plaintext):
            view.close()
        relay.close()
        engine.close()
