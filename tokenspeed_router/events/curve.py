"""ZeroMQ CURVE for the event sockets: key files, socket options, an allow-list.

Encryption and authentication are pyzmq's (libzmq's CurveZMQ and the ZAP
protocol); nothing here is cryptography, only plumbing:

* key files are ZeroMQ certificates as ``zmq.auth.create_certificates``
  writes them: ``NAME.key`` holds a public key, ``NAME.key_secret`` the pair;
* :class:`CurveServerKeys` makes a PUB/ROUTER socket a CURVE server,
  :class:`CurveClientKeys` makes a SUB/DEALER socket a CURVE client that
  trusts exactly one server key;
* :class:`CurveAllowList` is the ZAP credentials provider of a server: only
  the listed client public keys get through, every refusal is counted.

Without a ZAP handler on its context a CURVE server accepts any client (it
still encrypts); the relay therefore always installs an allow-list.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from tokenspeed_router.errors import ConfigError

__all__ = [
    "CurveAllowList",
    "CurveClientKeys",
    "CurveServerKeys",
    "generate_key_files",
    "load_key_pair",
    "load_public_key",
]

logger = logging.getLogger(__name__)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The z85 public key of a certificate file (public or secret one)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read CURVE public key from {os.fspath(path)!r}: {err}") from err
    return public


def load_key_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` z85 keys of a secret certificate file (``*.key_secret``)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read CURVE key pair from {os.fspath(path)!r}: {err}") from err
    if not secret:
        raise ConfigError(
            f"{os.fspath(path)!r} holds no secret key: pass the '.key_secret' file, not the public '.key'"
        )
    return public, secret


def generate_key_files(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (pair, mode 0600) into ``directory``."""
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """The key pair of a CURVE server (the relay's PUB and replay ROUTER)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)  # never in logs

    @classmethod
    def from_file(cls, secret_file: str | os.PathLike[str]) -> CurveServerKeys:
        return cls(*load_key_pair(secret_file))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before bind)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """What a CURVE client needs: the server's public key and its own pair."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)  # never in logs

    @classmethod
    def from_files(
        cls, server_key_file: str | os.PathLike[str], secret_file: str | os.PathLike[str]
    ) -> CurveClientKeys:
        public, secret = load_key_pair(secret_file)
        return cls(load_public_key(server_key_file), public, secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of that server (before connect)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)


class CurveAllowList:
    """ZAP credentials provider: accept only the listed client public keys.

    :meth:`start` installs it on a context (a pyzmq ``ThreadAuthenticator``,
    which must run before the server sockets bind); :meth:`stop` removes it.
    ``allowed``/``rejected`` count handshakes (a refused client retries every
    reconnect interval, so one unknown router counts many times);
    ``rejected_keys`` names the distinct refused keys.
    """

    def __init__(self, public_keys: Iterable[bytes]) -> None:
        self._keys = frozenset(public_keys)
        if not self._keys:
            raise ConfigError("a CURVE allow-list needs at least one client public key")
        self._lock = threading.Lock()
        self._allowed = 0
        self._rejected = 0
        self._rejected_keys: set[bytes] = set()
        self._auth: ThreadAuthenticator | None = None

    @classmethod
    def from_files(cls, files: Iterable[str | os.PathLike[str]]) -> CurveAllowList:
        return cls(load_public_key(f) for f in files)

    @property
    def allowed(self) -> int:
        with self._lock:
            return self._allowed

    @property
    def rejected(self) -> int:
        with self._lock:
            return self._rejected

    @property
    def rejected_keys(self) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._rejected_keys)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by pyzmq's authenticator thread with the client's z85 key."""
        ok = key in self._keys
        with self._lock:
            if ok:
                self._allowed += 1
            else:
                self._rejected += 1
                first = key not in self._rejected_keys
                self._rejected_keys.add(key)
        if not ok and first:
            logger.warning("CURVE client refused: public key %s is not on the allow-list", key.decode())
        return ok

    def start(self, context: zmq.Context[Any]) -> None:
        if self._auth is not None:
            return
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=self)
        self._auth = auth

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
