"""The ZeroMQ query API: the HTTP operations over one ROUTER socket, msgpack-encoded.

For callers on the request path that cannot afford HTTP parsing: a request is
one msgpack map ``{"op": "match"|"route"|"release"|"workers"|"health", "id": ..,
"auth": .., ...}`` with the same fields as the HTTP body; the reply is
``{"id": <echoed>, "status": 200, "result": {...}}`` or
``{"id": .., "status": 4xx, "error": "..."}``. ``id`` lets a DEALER client
pipeline requests and drop late answers. REQ clients work too (the empty
delimiter frame is mirrored back).

A dedicated thread serves the socket: it drains every ready request before
polling again, so a burst costs one poll, sends the burst's replies
together (one wake-up of libzmq's I/O thread, not one per reply), and it shares nothing with the
HTTP loop but the service (whose lock makes the queries safe). Frames larger
than ``max_body_bytes`` make libzmq drop that peer's connection
(``ZMQ_MAXMSGSIZE``): a hostile client cannot make the router buffer them.
"""

from __future__ import annotations

import array
import logging
import threading
from typing import Any, cast

import msgspec
import zmq

from tokenspeed_router.auth import check_bearer
from tokenspeed_router.endpoints import is_loopback_host
from tokenspeed_router.errors import ConfigError, RouterApiError, TokenspeedError
from tokenspeed_router.events.zmq_native import MAX_FRAMES, drainer, sender
from tokenspeed_router.server.api import (
    ZmqHealth,
    ZmqMatch,
    ZmqMatchRaw,
    ZmqRelease,
    ZmqRequest,
    ZmqRequestRaw,
    ZmqRoute,
    ZmqRouteRaw,
    ZmqWorkers,
    api_error,
    request_id_text,
    validate_request,
)
from tokenspeed_router.server.app import RouterService
from tokenspeed_router.server.explain import decision_answer

try:
    from tokenspeed_router._native import msgpack_tokens as _msgpack_tokens
except ImportError:  # no compiler at install time: decode token ids as Python ints
    _msgpack_tokens = None  # type: ignore[assignment]

__all__ = ["ZmqApiServer"]

logger = logging.getLogger(__name__)

_POLL_MS = 50
_MAX_BURST = 256
_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)


class ZmqApiServer:
    """Serves ``service`` on a bound ROUTER socket from its own thread."""

    def __init__(self, service: RouterService, endpoint: str, *, context: zmq.Context[Any] | None = None) -> None:
        self._service = service
        self._limits = service.config.limits
        token = service.config.auth_token
        self._expected = token.encode() if token else None
        self._ctx = context if context is not None else service.context
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_body_bytes)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as err:
            self._sock.close()
            raise ConfigError(f"cannot bind the ZMQ API on {endpoint}: {err}") from err
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        host = endpoint.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        if endpoint.startswith("tcp://") and not is_loopback_host(host):
            logger.log(
                logging.INFO if self._expected else logging.WARNING,
                "ZMQ API listening on non-loopback %s (auth %s)",
                endpoint, "on" if self._expected else "OFF",
            )
        self._decoder: msgspec.msgpack.Decoder[Any] = (
            msgspec.msgpack.Decoder(ZmqRequestRaw) if _msgpack_tokens is not None else msgspec.msgpack.Decoder(ZmqRequest)
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._any: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tokenspeed-zmq-api", daemon=True)
        self._thread.start()
        logger.info("ZMQ API on %s", self.endpoint)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        else:
            self._sock.close(linger=0)

    def _run(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        # A burst of requests is read, and its replies sent, in one native call each
        # (events/zmq_native.py: no Enum flags, no type checks per frame, no raised Again);
        # without the extension through pyzmq, its recv/send unrolled with plain int flags.
        drain = drainer(sock) or self._read_burst
        send_all = sender(sock) or self._send_burst
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                replies: list[list[bytes]] = []
                for frames in drain(_MAX_BURST):
                    reply = self._handle_frames(frames)
                    if reply is not None:
                        replies.append(reply)
                # The burst's replies go out together: the first wakes libzmq's I/O thread (a
                # write to its mailbox), the others join the pipe it is about to drain, instead
                # of one wake-up (and one syscall here) per reply.
                if replies and send_all(replies) < len(replies):
                    logger.debug("ZMQ API replies dropped: peer not reading")
        except zmq.ZMQError as err:
            if err.errno != zmq.ETERM:
                logger.exception("ZMQ API loop failed")
        except Exception:
            logger.exception("ZMQ API loop crashed")
        finally:
            sock.close(linger=0)

    def _read_burst(self, max_messages: int) -> list[list[bytes]]:
        """Up to ``max_messages`` waiting requests through pyzmq (no native drain)."""
        sock = self._sock
        out: list[list[bytes]] = []
        while len(out) < max_messages:
            try:
                frames = [sock.recv(_NOBLOCK)]
            except zmq.Again:
                break
            while sock.getsockopt(_RCVMORE):  # the rest of a multipart message is already here
                frames.append(sock.recv(_NOBLOCK))
            out.append(frames)
        return out

    def _send_burst(self, replies: list[list[bytes]]) -> int:
        """Send each reply without waiting through pyzmq (no native sender); how many went."""
        send, more = self._sock.send, _NOBLOCK | int(zmq.SNDMORE)
        for sent, reply in enumerate(replies):
            try:
                for frame in reply[:-1]:
                    send(frame, more)
                send(reply[-1], _NOBLOCK)
            except zmq.Again:
                return sent
        return len(replies)

    def _handle_frames(self, frames: list[bytes]) -> list[bytes] | None:
        self.requests += 1
        if len(frames) < 2:
            return None  # no identity: nowhere to answer
        envelope = frames[:-1]
        if len(frames) > 3 or (len(frames) == 3 and frames[1] != b""):
            got = f"{len(frames) - 1}{' or more' if len(frames) >= MAX_FRAMES else ''}"
            return [frames[0], self._error_reply(None, 400, f"expected 1 payload frame, got {got}")]
        return [*envelope, self.handle(frames[-1])]

    def handle(self, payload: bytes) -> bytes:
        """Answer one request payload (exposed for tests; never raises)."""
        req_id: Any = None
        try:
            try:
                req = self._decoder.decode(payload)
            except msgspec.ValidationError as err:
                req_id = self._salvage_id(payload)
                raise RouterApiError(400, f"invalid request: {err}") from None
            except msgspec.DecodeError as err:
                raise RouterApiError(400, f"malformed msgpack: {err}") from None
            except RecursionError:
                raise RouterApiError(400, "malformed msgpack: nested too deeply") from None
            req_id = req.id
            if not isinstance(req, ZmqHealth):  # health stays open, as over HTTP
                check_bearer(req.auth, self._expected, header=False)
            result = self._dispatch(req)
        except TokenspeedError as caught:
            refused = api_error(caught)
            self._service.metrics.api_errors.labels("zmq", str(refused.status)).inc()
            return self._error_reply(req_id, refused.status, refused.message)
        except Exception:
            logger.exception("unhandled error in the ZMQ API")
            self._service.metrics.api_errors.labels("zmq", "500").inc()
            return self._error_reply(req_id, 500, "internal error (logged by the router)")
        return self._encoder.encode({"id": req_id, "status": 200, "result": result})

    def _salvage_id(self, payload: bytes) -> Any:
        """The ``id`` of a request that failed validation, so the client can match the error."""
        try:
            raw = self._any.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return None
        ident = raw.get("id") if isinstance(raw, dict) else None
        return ident if isinstance(ident, (int, str)) and not isinstance(ident, bool) else None

    def _dispatch(self, req: Any) -> Any:
        service = self._service
        if isinstance(req, ZmqMatchRaw):
            # an array of u64s: the index and the hash read it in place
            tokens = cast("list[int]", self._tokens(req))
            validate_request(req, self._limits, len(tokens))
            if isinstance(req, ZmqRouteRaw):
                rid = request_id_text(req.request_id, self._limits)
                return decision_answer(
                    service.route(tokens, request_id=rid, lora_id=req.lora_id, salt=req.salt, explain=req.explain))
            return service.match(tokens, lora_id=req.lora_id, salt=req.salt).to_dict()
        if isinstance(req, ZmqRoute):
            validate_request(req, self._limits)
            rid = request_id_text(req.request_id, self._limits)
            return decision_answer(service.route(
                req.token_ids, request_id=rid, lora_id=req.lora_id, salt=req.salt, explain=req.explain))
        if isinstance(req, ZmqMatch):
            validate_request(req, self._limits)
            return service.match(req.token_ids, lora_id=req.lora_id, salt=req.salt).to_dict()
        if isinstance(req, ZmqRelease):
            rid = request_id_text(req.request_id, self._limits)
            assert rid is not None
            service.release(rid)
            return {}
        if isinstance(req, ZmqWorkers):
            return service.workers()
        if isinstance(req, ZmqHealth):
            return service.health()
        raise RouterApiError(400, f"unsupported op {type(req).__name__}")

    @staticmethod
    def _tokens(req: ZmqMatchRaw) -> array.array[int]:
        """The raw ``token_ids`` array as u64s (what the typed decoder would accept, or a 400)."""
        assert _msgpack_tokens is not None
        try:
            data = _msgpack_tokens(req.token_ids)
        except ValueError as err:
            raise RouterApiError(400, f"invalid request: {err}") from None
        tokens = array.array("Q")
        tokens.frombytes(data)
        return tokens

    def _error_reply(self, req_id: Any, status: int, message: str) -> bytes:
        return self._encoder.encode({"id": req_id, "status": status, "error": message})
