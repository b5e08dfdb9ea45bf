"""The typed seam to the index cores: named counts, which core runs, no silent fall-back."""

from __future__ import annotations

import logging

import pytest
from support.server import batch, stored, tokens

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.router import index as index_module
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex, WorkerInfo
from tokenspeed_router.server import RouterService, ServerConfig

CORES = ["reference", "native"] if NATIVE_AVAILABLE else ["reference"]


def test_worker_info_names_the_same_counts_on_both_cores() -> None:
    infos = []
    for core in CORES:
        index = KvIndex(core=core)
        index.apply("w", KVEventBatch(0.0, [
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4),
            BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[1, 2], block_size=4, medium="cpu"),
        ]))
        info = index.worker_info("w")
        assert isinstance(info, WorkerInfo) and index.implementation == core
        assert (info.block_size, info.blocks, info.gpu, info.cpu, info.unmatchable, info.matchable) == (4, 3, 2, 1, 1, 2)
        infos.append(info)
    assert all(i == infos[0] for i in infos)


def test_falling_back_to_the_reference_core_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(index_module, "NATIVE_AVAILABLE", False)
    monkeypatch.setattr(index_module, "_DEFAULT_CORE", None)
    monkeypatch.setattr(index_module, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger=index_module.__name__):
        assert KvIndex().implementation == "reference"
        assert KvIndex().implementation == "reference"
    warned = [r for r in caplog.records if "reference core" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=index_module.__name__):
        KvIndex(core="reference")  # asked for: no warning
    assert not caplog.records


@pytest.mark.parametrize("core", CORES)
def test_health_workers_and_metrics_name_the_core(core: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_module, "_DEFAULT_CORE", core)
    service = RouterService(ServerConfig(http=None))
    try:
        service.apply_record("w0", 0, batch(stored(tokens(1, 2))), 1.0)
        assert service.health()["index_core"] == core
        assert service.workers()["w0"]["index_core"] == core
        assert f'tokenspeed_index_core_info{{core="{core}"}} 1.0' in service.metrics_text().decode()
        assert service.match(tokens(1, 2)).scores["w0"] == 2
    finally:
        service.stop()


def test_the_compiled_core_uses_the_tier_bits_of_tiers_py() -> None:
    if not NATIVE_AVAILABLE:
        pytest.skip("the native core is not built")
    from tokenspeed_router import _native
    from tokenspeed_router.router import tiers

    assert (_native.GPU, _native.CPU, _native.STORAGE) == (tiers.GPU, tiers.CPU, tiers.STORAGE)
