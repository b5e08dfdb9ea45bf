"""The endpoint picker protocol's names (v1.0.0), and the picker's health services.

Headers and metadata as kubernetes-sigs/gateway-api-inference-extension's
``docs/proposals/004-endpoint-picker-protocol`` defines them. This module
imports nothing of gRPC: ``doctor``, the tests and the docs read it without
the ``epp`` extra.
"""

from __future__ import annotations

__all__ = [
    "DESTINATION_HEADER",
    "DP_RANK_HEADER",
    "EPP_EXTRA_HINT",
    "EXT_PROC_SERVICE",
    "HEALTH_SERVICES",
    "LB_NAMESPACE",
    "PREFILLER_HEADER",
    "SERVED_KEY",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
]

#: request header and ``envoy.lb`` dynamic-metadata key naming the picked endpoint(s):
#: ``ip:port`` or ``ip:port,ip:port,...`` (primary first, then the fallbacks)
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: the metadata namespace of the picked endpoint (dynamic metadata) and of the served one
LB_NAMESPACE = "envoy.lb"
#: filter-metadata namespace of the subset hint, and its key (a list of ``ip:port``)
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: ``envoy.lb`` filter-metadata key in the response phase: the endpoint that served the request
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: the ext_proc service's name, also a health-checking service
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: gRPC health-checking services the picker answers: "" (the server), ``liveness``,
#: ``readiness``, the ext_proc service, and ``inference-extension`` (what the upstream
#: Helm chart probes with one replica)
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE, "inference-extension")
#: a data-parallel worker's rank, as the HTTP gateway addresses it (vLLM reads it)
DP_RANK_HEADER = "x-data-parallel-rank"
#: with a remote prefill: the prefill worker's ``ip:port`` for the decode side's routing
#: sidecar (llm-d's P/D convention); the picked endpoint is the decode worker
PREFILLER_HEADER = "x-prefiller-host-port"
EPP_EXTRA_HINT = ("--epp needs the epp extra: pip install 'tokenspeed-router[epp]' "
                  "(grpcio, grpcio-health-checking, xds-protos)")
