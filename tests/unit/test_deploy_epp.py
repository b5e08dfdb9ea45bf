"""The endpoint picker's manifests in deploy/epp/ agree with each other and with the picker.

No Kubernetes or Envoy runs here: the YAML is parsed, the picker's command line goes
through ``serve``'s own argument parser and config checks, and the names the gateway
and Envoy rely on are checked against the picker's (``epp/names.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from support import REPO_ROOT

from tokenspeed_router.epp.names import (
    DESTINATION_HEADER,
    EXT_PROC_SERVICE,
    HEALTH_SERVICES,
    LB_NAMESPACE,
)
from tokenspeed_router.server.cli_serve import add_arguments, config_from_args

EPP = REPO_ROOT / "deploy" / "epp"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EPP / name).read_text()) if d]


def _kind(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def test_pool_route_and_picker_agree() -> None:
    picker = _docs("picker.yaml")
    pool = _kind(_docs("inferencepool.yaml"), "InferencePool")
    route = _kind(_docs("httproute.yaml"), "HTTPRoute")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    service = _kind(picker, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]
    engines = _kind(picker, "Service", "vllm")
    assert engines["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"][0]["number"] in [p["port"] for p in engines["spec"]["ports"]]


def test_the_picker_command_line_is_valid_and_probed_on_its_services() -> None:
    deployment = _kind(_docs("picker.yaml"), "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert container["args"][0] == "serve"
    config = config_from_args(parser.parse_args(container["args"][1:]))
    assert config.epp is not None and config.epp.port in [p["containerPort"] for p in container["ports"]]
    for worker in config.workers:
        assert worker.url is not None and str(worker.url).endswith(":8000")
    for probe in ("livenessProbe", "readinessProbe"):
        grpc = container[probe]["grpc"]
        assert grpc["port"] == config.epp.port and grpc["service"] in HEALTH_SERVICES


def test_envoy_routes_on_the_pickers_header() -> None:
    [config] = _docs("envoy.yaml")
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    original = clusters["original_destination_cluster"]
    assert original["type"] == "ORIGINAL_DST"
    assert original["original_dst_lb_config"]["http_header_name"] == DESTINATION_HEADER
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    mode = ext_proc["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert LB_NAMESPACE in ext_proc["typed_config"]["metadata_options"]["forwarding_namespaces"]["untyped"]
    picker = clusters[ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]]
    assert picker["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_SERVICE


def test_every_manifest_is_checked() -> None:
    assert sorted(p.name for p in Path(EPP).glob("*.yaml")) == [
        "envoy.yaml", "httproute.yaml", "inferencepool.yaml", "picker.yaml"]
