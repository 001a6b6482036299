"""CURVE keys for tcp:// endpoints, and the ZAP handler that admits only authorised peers.

`rlhf-async keys DIR` (`generate_keys`) writes, in ZeroMQ's certificate format:

    DIR/server.key, DIR/server.key_secret   keypair of every socket that binds on tcp
    DIR/client.key, DIR/client.key_secret   keypair of every socket that connects on tcp
    DIR/authorized/client.key               public keys allowed to connect (a directory of
                                            certificates, or a file of z85 keys, one a line)

Secret files are 0600 and DIR is 0700. A `Keyring` is what a `Transport` uses: a binding
tcp socket is a CURVE server whose ZAP handler admits only `authorized` keys, and a
connecting one is a CURVE client of the server key. Refused peers are counted in the
transport's counters: `auth.denied` (ZAP said no: unknown key) and `auth.handshake_failed`
(no CURVE, a wrong server key, or not ZeroMQ at all); `auth.refused` is their sum.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
ZAP_DOMAIN = b"rlhf-async"
SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"
_Z85_KEY_LEN = 40
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class SecurityError(ValueError):
    """Keys are missing, malformed or readable by others, or plaintext tcp is not allowed."""


def _check_key(key: Any, where: str) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes) or len(key) != _Z85_KEY_LEN:
        raise SecurityError(f"{where}: not a {_Z85_KEY_LEN}-character z85 CURVE key")
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, IndexError, TypeError):
        raise SecurityError(f"{where}: not a valid z85 CURVE key") from None
    return key


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    kind = "Secret" if secret else "Public"
    lines = [f"#   ****  Generated on {datetime.datetime.now()} by rlhf-async  ****",
             f"#   ZeroMQ CURVE {kind} Certificate", "", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    # O_EXCL with the final mode: a secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def generate_keys(directory: str | Path, *, force: bool = False,
                  extra_clients: tuple[str, ...] = ()) -> list[Path]:
    """Write a server and a client keypair (plus `extra_clients` keypairs, all authorised).

    Refuses to overwrite existing keys unless `force`; returns the files written.
    """
    directory = Path(directory)
    names = [SERVER, CLIENT, *extra_clients]
    bad = [n for n in extra_clients if not n.replace("-", "").replace("_", "").isalnum()
           or n in (SERVER, CLIENT, AUTHORIZED)]
    if bad:
        raise SecurityError(f"client names {bad} must be letters, digits, - or _, and not "
                            f"{SERVER!r}, {CLIENT!r} or {AUTHORIZED!r}")
    targets = [directory / f"{n}{ext}" for n in names for ext in (".key", ".key_secret")]
    targets += [directory / AUTHORIZED / f"{n}.key" for n in names if n != SERVER]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise SecurityError(f"keys already exist ({', '.join(existing)}); pass --force to "
                            "replace them (every node then needs the new keys)")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    for path in existing:
        os.unlink(path)
    for name in names:
        public, secret = zmq.curve_keypair()
        _write_cert(directory / f"{name}.key", public, None)
        _write_cert(directory / f"{name}.key_secret", public, secret)
        if name != SERVER:
            _write_cert(directory / AUTHORIZED / f"{name}.key", public, None)
    return targets


def _load_cert(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        st = path.stat()
    except OSError as e:
        raise SecurityError(f"cannot read key file {path}: {e.strerror}") from None
    if secret and st.st_mode & 0o077:
        raise SecurityError(f"secret key file {path} is readable by others (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
    if secret and st.st_uid != os.getuid():
        raise SecurityError(f"secret key file {path} belongs to uid {st.st_uid}, not to us")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"key file {path} is not a ZeroMQ certificate: {e}") from None
    public = _check_key(public, f"{path} public-key")
    if secret:
        if secret_key is None:
            raise SecurityError(f"{path} has no secret-key")
        secret_key = _check_key(secret_key, f"{path} secret-key")
    return public, secret_key


def load_authorized(path: str | Path) -> frozenset[bytes]:
    """Public keys from a directory of certificates (*.key) or a file of z85 keys."""
    path = Path(path)
    if path.is_dir():
        return frozenset(_load_cert(p, secret=False)[0] for p in sorted(path.glob("*.key")))
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SecurityError(f"cannot read authorized keys {path}: {e.strerror}") from None
    return frozenset(_check_key(line.strip(), f"{path} line {i}")
                     for i, line in enumerate(lines, 1)
                     if line.strip() and not line.strip().startswith("#"))


@dataclass(frozen=True)
class Keyring:
    """The CURVE keys of one process. Secrets are optional: a process that only connects
    needs no server secret, one that only binds needs no client secret."""

    directory: str
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes | None
    client_secret: bytes | None
    authorized: frozenset[bytes]

    @classmethod
    def load(cls, directory: str | Path, *, client: str = CLIENT) -> Keyring:
        d = Path(directory)
        if not d.is_dir():
            raise SecurityError(f"keys directory {d} does not exist; create it with "
                                f"`rlhf-async keys {d}`")
        server = d / f"{SERVER}.key_secret"
        server_public, server_secret = (_load_cert(server, secret=True) if server.exists()
                                        else (_load_cert(d / f"{SERVER}.key", False)[0], None))
        client_file = d / f"{client}.key_secret"
        client_public, client_secret = (_load_cert(client_file, secret=True)
                                        if client_file.exists() else (None, None))
        auth = d / AUTHORIZED
        authorized = load_authorized(auth) if auth.exists() else frozenset()
        return cls(str(d), server_public, server_secret, client_public, client_secret,
                   authorized)

    def apply(self, sock: zmq.Socket[Any], bind: bool, address: str) -> None:
        """Make `sock` a CURVE server (bind) or client (connect); call before bind/connect."""
        if bind:
            if self.server_secret is None:
                raise SecurityError(f"binding {address} needs {self.directory}/"
                                    f"{SERVER}.key_secret")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        else:
            if self.client_secret is None or self.client_public is None:
                raise SecurityError(f"connecting to {address} needs a client keypair in "
                                    f"{self.directory} ({CLIENT}.key_secret)")
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def is_loopback(address: str) -> bool:
    """True for tcp://127.x.x.x:P, tcp://[::1]:P and tcp://localhost:P."""
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: CURVE clients with an authorised key
    pass, everything else is denied and counted. Must be bound before any CURVE server
    socket binds, or libzmq admits every client that knows the server key."""

    def __init__(self, ctx: zmq.asyncio.Context, authorized: frozenset[bytes],
                 counters: Counter[str], log: Any = None) -> None:
        self.authorized = frozenset(zmq.utils.z85.decode(k) for k in authorized)
        self.counters = counters
        self.log = log or structlog.get_logger()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                reply = self._answer(frames)
            except Exception:  # a request we cannot parse is a denial, never a crash
                self.log.exception("zap_request_failed")
                continue
            await self.sock.send_multipart(reply)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # [routing id, b"", version, request id, domain, address, identity, mechanism, creds...]
        route, _, version, request_id, domain, address, _, mechanism = frames[:8]
        creds = frames[8:]
        ok = (version == b"1.0" and domain == ZAP_DOMAIN and mechanism == b"CURVE"
              and len(creds) == 1 and creds[0] in self.authorized)
        if ok:
            self.counters["auth.accepted"] += 1
            return [route, b"", b"1.0", request_id, b"200", b"OK", b"", b""]
        self.counters["auth.denied"] += 1
        self.counters["auth.refused"] += 1
        self.log.warning("peer_denied", address=address.decode(errors="replace"),
                         mechanism=mechanism.decode(errors="replace"),
                         total=self.counters["auth.denied"])
        return [route, b"", b"1.0", request_id, b"400", b"key not authorized", b"", b""]

    def close(self) -> None:
        self.sock.close(0)


async def count_handshake_failures(monitor: zmq.asyncio.Socket, address: str,
                                   counters: Counter[str], log: Any) -> None:
    """Count failed handshakes on a CURVE server socket (from its monitor socket).

    Failures after a ZAP denial are already counted by the handler, so only the others
    (no CURVE, wrong server key, garbage) count here.
    """
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue
            counters["auth.handshake_failed"] += 1
            counters["auth.refused"] += 1
            log.warning("handshake_failed", endpoint=address, errno=event["value"],
                        total=counters["auth.handshake_failed"])
    finally:
        monitor.close(0)
