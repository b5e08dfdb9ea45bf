"""Options of shared in-flight load in the state URL (validated at start-up)."""

from __future__ import annotations

import pytest

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.state.config import RedisStateConfig


def test_load_options_from_the_url() -> None:
    c = RedisStateConfig.from_url("redis://h:1/0?share_load=off&load_ttl_s=3&load_refresh_s=0.1"
                                  "&load_min_interval_s=0.01")
    assert (c.share_load, c.load_ttl_s, c.load_refresh_s, c.load_min_interval_s) == (False, 3.0, 0.1, 0.01)
    assert RedisStateConfig.from_url("redis://h:1/0").share_load is True
    assert c.keys.load == "tsr:{default}:load"
    default = RedisStateConfig.from_url("redis://h:1/0")
    assert (default.ingest, default.flight_transport) == ("direct", "pubsub")
    assert default.keys.flight == "tsr:{default}:flight"
    streams = RedisStateConfig.from_url("redis://h:1/0?flight_transport=streams&ingest=stream")
    assert (streams.ingest, streams.flight_transport) == ("stream", "streams")


@pytest.mark.parametrize("query, message", [
    ("share_load=maybe", "not a valid boolean"),
    ("load_ttl_s=x", "not a valid number"),
    ("load_refresh_s=5&load_ttl_s=2", "load_refresh_s < load_ttl_s"),
    ("load_min_interval_s=0.2&load_refresh_s=0.1", "load_min_interval_s <= load_refresh_s"),
    ("load_ttl_s=0", "load_ttl_s must be positive"),
    ("flight_transport=kafka", "flight_transport must be 'pubsub' or 'streams'"),
    ("ingest=leader", "ingest must be 'direct' or 'stream'"),
])
def test_bad_load_options_fail_at_start(query: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RedisStateConfig.from_url(f"redis://h:1/0?{query}")
