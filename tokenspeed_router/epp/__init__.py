"""The Endpoint Picker (``serve --epp HOST:PORT``): Envoy's ext_proc for inference gateways.

Kubernetes inference gateways (GKE Inference Gateway, kgateway, Istio, Envoy
Gateway, NGINX Gateway Fabric, KServe) do not proxy through a router: they
ask an *Endpoint Picker* over Envoy's external processing protocol
(``envoy.service.ext_proc.v3.ExternalProcessor``, gRPC) which engine should
serve each request, as the Gateway API Inference Extension's endpoint picker
protocol says (kubernetes-sigs/gateway-api-inference-extension,
``docs/proposals/004-endpoint-picker-protocol``). This package is that picker,
on the same routing core, index, subscribers and Redis state as the HTTP
gateway, and with the gateway's own per-request books
(``gateway/accounting.py``). docs/epp.md is the operator's page.

Modules, one job each:

* ``names``    — the protocol's header and metadata names, the health services (no gRPC)
* ``messages`` — reading and building ext_proc messages (imports the generated protos)
* ``exchange`` — one HTTP request's ext_proc stream: the request and response phases
* ``server``   — the gRPC server: ExternalProcessor, health checking, readiness

Only ``names`` is imported without the ``epp`` extra (``grpcio``,
``grpcio-health-checking``, ``xds-protos``); ``serve --epp`` imports the rest,
and says what to install when they are missing.
"""
