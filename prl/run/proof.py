"""The server's proof that it holds the run's key, asked before a client sends the key.

A client that sent `Authorization: Bearer <key>` to whatever answers on a server's port would hand the
key to anyone who bound that port first (local mode, a shared node, the seconds before vLLM binds, a
server that died). So a client first asks, without the key,

    GET /prl/proof?nonce=N          N: 32 random bytes as 64 lowercase hex digits, new for every proof

and the server (prl.inference.routes) answers {"address": A, "proofs": [HMAC-SHA256(key, MESSAGE)]},
MESSAGE = b"prl-server-proof:" + N + b"@" + A, A its own end of that connection ("ip:port"). The
client computes the same over the address it connected to and compares in constant time. A squatter
that relays the nonce to a real server of the run (another replica's port, the same port on another
node) gets a proof for that server's address, not for the one the client reached.

Not a signing oracle: the server signs only messages that start with this prefix, hold a nonce of
exactly 64 hex digits and end with its own address; no other use of the key signs such a message
(the weight broadcast signs with a key derived from the secret under "prl weight broadcast").

`Proofs` keeps, per server, whether it has proved the key: asked before the first request with the
key, forgotten at any failed connection (the next request proves again). Pure hashlib below `Proofs`;
httpx is imported by the client side only (the verifiers v1 worker's Python has it too).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from urllib.parse import urlsplit

ROUTE = "/prl/proof"
PREFIX = b"prl-server-proof:"
NONCE = re.compile(r"[0-9a-f]{64}")
"""What the server signs as a nonce: 32 bytes as lowercase hex, nothing else."""
MAX_ANSWER = 65536
"""Bytes of an answer read at most (a real one is about 150 per key)."""
TIMEOUT_S = 10.0
"""One proof: a small answer from a server that is up."""


class Unproven(RuntimeError):
    """The server answered, but did not prove the key: nothing with the key was sent to it."""


def address(host: str, port: int) -> str:
    """`ip:port` as both ends write it (an IPv4 address seen through an IPv6 socket as itself)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
        ip = getattr(ip, "ipv4_mapped", None) or ip
        host = str(ip)
    except ValueError:  # not an IP (a unix socket's path): compared as it is
        pass
    return f"{host}:{port}"


def sign(key: str, nonce: str, at: str) -> str:
    return hmac.new(key.encode(), PREFIX + nonce.encode() + b"@" + at.encode(), hashlib.sha256).hexdigest()


def answer(keys: list[str], nonce: str, at: str) -> dict | None:
    """The server's answer to a proof request at its address `at`; None for a nonce that is not
    exactly 64 lowercase hex digits (no other message gets signed)."""
    if not NONCE.fullmatch(nonce):
        return None
    return {"address": at, "proofs": [sign(key, nonce, at) for key in keys]}


def origin(url: str) -> str:
    """`http://host:port/v1` -> `http://host:port`: what a proof is held for."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def prove(url: str, key: str) -> None:
    """Ask the server at `url` for its proof of `key` over a connection of its own; Unproven (one
    line naming the URL, never the key) if the answer is wrong, httpx.TransportError if it cannot be
    reached. Nothing of the key leaves this process."""
    import httpx

    nonce, base = secrets.token_hex(32), origin(url)
    # No proxy from the environment: the proof is of the server this process reaches itself.
    async with httpx.AsyncClient(timeout=TIMEOUT_S, trust_env=False, verify=base.startswith("https:")) as client:
        async with client.stream("GET", f"{base}{ROUTE}", params={"nonce": nonce}) as response:
            peer = response.extensions["network_stream"].get_extra_info("server_addr")
            body = b""
            async for chunk in response.aiter_bytes():  # a squatter's endless answer is cut short
                body += chunk
                if len(body) > MAX_ANSWER:
                    break
    check(base, key, nonce, address(*peer[:2]), response.status_code, body)


def check(url: str, key: str, nonce: str, at: str, status: int, body: bytes) -> None:
    """Unproven unless `body` holds the HMAC of `key` over `nonce` and the address `at` reached."""
    import json

    try:
        got = json.loads(body) if status == 200 else {}
        proofs, said = got.get("proofs", []), got.get("address")
    except (ValueError, AttributeError):
        proofs, said = [], None
    expected = sign(key, nonce, at)
    if isinstance(proofs, list) and any(isinstance(p, str) and hmac.compare_digest(p, expected) for p in proofs):
        return
    why = f"it answered {status}" if status != 200 else "its answer is not a proof of the key"
    if isinstance(said, str) and said != at:
        why += f" (it signed for {said[:60]!r}, this connection reached {at}: a relay?)"
    raise Unproven(f"{url}: the server did not prove it holds the run's key ({why}); nothing sent to it")


class Proofs:
    """Which servers proved `key` (by origin, `scheme://host:port`)."""

    def __init__(self, key: str):
        self.key = key
        self.proven: set[str] = set()

    async def ensure(self, url: str) -> None:
        """Return once the server of `url` has proved the key (now, or since its last failed connection);
        Unproven or httpx.TransportError otherwise."""
        base = origin(url)
        if base not in self.proven:
            await prove(base, self.key)
            self.proven.add(base)

    def forget(self, url: str) -> None:
        """A connection to this server failed: whoever holds its port next proves the key again."""
        self.proven.discard(origin(url))


def main(argv: list[str]) -> int:
    """`python -m prl.run.proof URL RUN`: 0 once the server at URL proved RUN's secret, else 1 (one line)."""
    import asyncio
    import sys
    from pathlib import Path

    import httpx

    from prl.run import secret

    if len(argv) != 2:
        print("usage: python -m prl.run.proof http://HOST:PORT RUN_DIR", file=sys.stderr)
        return 2
    try:
        asyncio.run(prove(argv[0], secret.read(Path(argv[1]))))
    except (Unproven, httpx.HTTPError) as e:
        print(f"{e}" if isinstance(e, Unproven) else f"{argv[0]}: not reachable ({type(e).__name__})", file=sys.stderr)
        return 1
    print(f"{origin(argv[0])}: proved the run's key")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
