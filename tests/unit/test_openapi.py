"""The OpenAPI document: generated from the structs, shipped in the package, served at /openapi.json."""

from __future__ import annotations

import json
import warnings
from importlib import resources

from tokenspeed_router.server import RouterService, ServerConfig, create_app
from tokenspeed_router.server.openapi import openapi_document, openapi_json

with warnings.catch_warnings():
    from starlette.exceptions import StarletteDeprecationWarning

    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from starlette.testclient import TestClient

REGENERATE = ("python -c \"from tokenspeed_router.server.openapi import write_openapi; "
              "write_openapi('tokenspeed_router/server/openapi.json')\"")


def test_the_shipped_file_is_the_generated_document() -> None:
    shipped = resources.files("tokenspeed_router").joinpath("server/openapi.json").read_bytes()
    assert shipped == openapi_json(), f"server/openapi.json is out of date: {REGENERATE}"


def test_every_route_serve_answers_is_documented_with_its_methods() -> None:
    service = RouterService(ServerConfig(http=None, auth_token="t"))
    app = create_app(service)
    served = {}
    for route in app.routes:
        path = route.path.replace("{name:path}", "{name}")  # type: ignore[attr-defined]
        served.setdefault(path, set()).update(m.lower() for m in route.methods or () if m != "HEAD")  # type: ignore[attr-defined]
    paths = openapi_document()["paths"]
    documented = {p: {m for m in ops if m != "parameters"} for p, ops in paths.items()}
    assert documented == served
    with TestClient(app) as client:
        resp = client.get("/openapi.json")  # open without the token, like /health
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        assert json.loads(resp.content) == openapi_document()
    service.stop()


def test_request_bodies_come_from_the_decoding_structs() -> None:
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    match = schemas["MatchRequest"]
    assert match["required"] == ["token_ids"]
    assert match["properties"]["token_ids"]["items"] == {"type": "integer", "minimum": 0,
                                                         "maximum": 2**63 - 1}
    kinds = {k.get("type") for k in match["properties"]["lora_id"]["anyOf"]}
    assert kinds == {"integer", "string", "null"}
    route_body = doc["paths"]["/route"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert route_body == {"$ref": "#/components/schemas/RouteRequest"}
    assert {"request_id", "explain"} <= set(schemas["RouteRequest"]["properties"])
