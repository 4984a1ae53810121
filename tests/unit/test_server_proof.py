"""The key goes only to a server that proved it holds it (prl.run.proof): another user who binds a
run's server port first (as uid 65534, a plain socket listener) receives no key from the orchestrator's
clients, a relay to the run's real server does not pass for it, and prl's middleware (the real one,
in uvicorn, in front of a stand-in for vLLM's app) answers the proof. The same proof against a CPU
vLLM server: tests/integration/test_inference.py::test_every_route_but_health_needs_the_key.

    pytest tests/unit/test_server_proof.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from loguru import logger

from prl.inference.routes import PrlRoutes
from prl.orchestrator.client import Servers
from prl.orchestrator.http_client import ServerRoutes
from prl.run import proof
from prl.run.ports import free_port

KEY = "k" * 20 + "-the-run-secret-" + "s" * 20

SQUATTER = r"""
import socket, sys
# Answers every request 200 with a made-up proof, and writes every byte it receives to stdout.
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen(64)
print("listening", flush=True)
body = b'{"status": "ok", "proofs": ["' + b"0" * 64 + b'"], "data": [{"id": "m"}]}'
while True:
    conn, _ = server.accept()
    conn.settimeout(2)
    data = b""
    with conn:
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        sys.stdout.buffer.write(data + b"\n----\n")
        sys.stdout.flush()
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
"""


def as_stranger() -> list[str]:
    """The argv prefix that runs a command as another Unix user of the machine (uid/gid 65534)."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: acting as another user needs setpriv as root")
        pytest.skip("needs root to act as another user")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@contextlib.contextmanager
def squatter(port: int):
    """A plain socket listener of uid 65534 on `port`; yields a function returning what it received so far."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"prl-squatter-{os.getpid()}-{port}"
    with out.open("wb") as f:
        process = subprocess.Popen([*as_stranger(), "/usr/bin/python3", "-c", SQUATTER, str(port)], stdout=f)
    try:
        deadline = time.monotonic() + 10
        while b"listening" not in out.read_bytes():
            assert process.poll() is None and time.monotonic() < deadline, "the squatter did not start"
            time.sleep(0.02)
        yield out.read_bytes
    finally:
        process.kill()
        process.wait()
        out.unlink()


class StandIn:
    """vLLM's app as prl's middleware sees it: records each request's Authorization header, answers 200."""

    def __init__(self):
        self.seen: list[tuple[str, str | None]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = dict(scope["headers"])
        self.seen.append((scope["path"], headers.get(b"authorization", b"").decode() or None))
        body = json.dumps({"data": [{"id": "m"}], "path": scope["path"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def real_server(port: int, keys: list[str]):
    """prl's middleware (keys as vLLM would give them) in uvicorn on 127.0.0.1:`port`; yields the stand-in."""
    app = StandIn()
    middleware = PrlRoutes(app)
    middleware.keys = keys  # what _api_keys reads from vLLM's app state
    server = uvicorn.Server(uvicorn.Config(middleware, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield app
    finally:
        server.should_exit = True
        await task


async def relay(listen: int, to: int) -> asyncio.Server:
    """Everything that reaches `listen` forwarded to `to` and back: a squatter that asks the real server."""
    async def pipe(reader, writer):
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", to)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", listen)


def warnings_during(coro) -> tuple[object, list[str]]:
    """(what `coro` returned or raised, the warnings loguru got meanwhile)."""
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    try:
        try:
            result = asyncio.run(coro)
        except Exception as e:
            result = e
    finally:
        logger.remove(sink)
    return result, lines


def test_a_squatter_on_the_port_gets_no_key_from_any_client():
    """Every way the orchestrator reaches a server: the /health poll, wait_ready, /v1/models and
    /update_weights (httpx), Chat Completions (the OpenAI client), the token route (aiohttp)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def clients():
        servers = Servers([f"{url}/v1"], KEY)
        routes = ServerRoutes(url, KEY, timeout_s=5, retries=1)
        failures = []
        try:
            with pytest.raises(RuntimeError, match="not ready after"):
                await servers.wait_ready(timeout_s=0.5, poll_s=0.1)
            for attempt in (servers.model_name(), servers.update_weights(Path("/tmp/w")), routes.post("/prl/generate", {}),
                            servers.clients[0].client.with_options(max_retries=0).chat.completions.create(
                                model="m", messages=[])):
                try:
                    await attempt
                    failures.append("answered")
                except Exception as e:
                    failures.append(e)
        finally:
            await servers.close()
            await routes.close()
        return failures

    with squatter(port) as received:
        failures, warned = warnings_during(clients())
        data = received()
    assert data.count(b"GET /health") >= 2 and data.count(b"GET /prl/proof?nonce=") >= 2, data[:500]
    assert b"Bearer" not in data and b"uthorization" not in data and KEY.encode() not in data
    assert len(failures) == 4 and not any(f == "answered" for f in failures), failures
    # one line naming the URL (not the key), said once however often it was asked
    refused = [w for w in warned if "did not prove" in w]
    assert refused == [f"{url}: the server did not prove it holds the run's key (its answer is not a proof "
                       "of the key); nothing sent to it"], warned
    assert not any(KEY in w for w in warned)


def test_the_real_server_proves_the_key_and_then_gets_it():
    """The same clients, then prl's middleware on that port: the proof passes, and the key arrives."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def main():
        async with real_server(port, [KEY]) as app:
            servers = Servers([f"{url}/v1"], KEY)
            try:
                await servers.wait_ready(timeout_s=10, poll_s=0.1)
                assert await servers.model_name() == "m"
                await servers.clients[0].client.models.list()
            finally:
                await servers.close()
            routes = ServerRoutes(url, KEY, timeout_s=5, retries=1)
            try:
                assert (await routes.post("/tokenize", {}))["path"] == "/tokenize"
            finally:
                await routes.close()
            return app.seen

    seen = asyncio.run(main())
    assert ("/health", None) in seen and set(seen) == {("/health", None), ("/v1/models", f"Bearer {KEY}"),
                                                      ("/tokenize", f"Bearer {KEY}")}, seen


def test_a_relay_to_the_real_server_does_not_pass_for_it():
    """A squatter that forwards the proof request to the run's real server (another replica's port)
    gets a proof for that server's address: the client refuses, says so, and sends no key."""
    real, squatted = free_port(), free_port()

    async def main():
        async with real_server(real, [KEY]) as app:
            forwarder = await relay(squatted, real)
            try:
                with pytest.raises(proof.Unproven, match=rf"signed for '127.0.0.1:{real}', this connection "
                                                         rf"reached 127.0.0.1:{squatted}: a relay\?"):
                    await proof.prove(f"http://127.0.0.1:{squatted}/v1", KEY)
                await proof.prove(f"http://127.0.0.1:{real}/v1", KEY)  # the same server, reached itself
            finally:
                forwarder.close()
                await forwarder.wait_closed()
            return app.seen

    assert asyncio.run(main()) == []  # the proof route never reaches vLLM's app


def test_the_proof_route_signs_only_its_own_messages():
    """64 lowercase hex digits and nothing else; a wrong key does not verify; the other routes still
    need the key; with no key there is nothing to prove."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def main():
        async with real_server(port, [KEY, "another-key-of-the-server-0123456789"]):
            async with httpx.AsyncClient(base_url=url) as http:
                nonce = "ab" * 32
                good = (await http.get(proof.ROUTE, params={"nonce": nonce})).json()
                assert good["address"] == f"127.0.0.1:{port}" and len(good["proofs"]) == 2
                assert good["proofs"][0] == proof.sign(KEY, nonce, f"127.0.0.1:{port}")
                for bad in ("AB" * 32, "ab" * 31, "ab" * 33, "ab" * 31 + "zz", "", "ab" * 32 + "\n"):
                    r = await http.get(proof.ROUTE, params={"nonce": bad})
                    assert r.status_code == 400 and "proofs" not in r.text, bad
                assert (await http.get(f"{proof.ROUTE}?nonce={nonce}&nonce={nonce}")).status_code == 400
                assert (await http.post(proof.ROUTE, params={"nonce": nonce})).status_code == 405
                assert (await http.get("/v1/models")).status_code == 401
            await proof.prove(url, KEY)
            with pytest.raises(proof.Unproven, match=f"^{url}: the server did not prove"):
                await proof.prove(url, "not-the-key-" * 4)
        async with real_server(port, []):
            with pytest.raises(proof.Unproven, match="it answered 503"):
                await proof.prove(url, KEY)

    asyncio.run(main())


def test_a_proof_is_forgotten_when_a_connection_fails():
    """After a failed connection the next request proves again: a server that went and a squatter that
    came in its place get nothing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def main():
        routes = ServerRoutes(url, KEY, timeout_s=5, retries=0)
        try:
            async with real_server(port, [KEY]):
                await routes.post("/tokenize", {})
            assert routes.proofs.proven == {url}
            with pytest.raises((httpx.TransportError, OSError)):  # nobody there now
                await routes.post("/tokenize", {})
            assert routes.proofs.proven == set()
        finally:
            await routes.close()

    asyncio.run(main())
    assert sys.modules["prl.run.proof"] is proof


def documented(route: str) -> str:
    """docs/inference.md's curl command for `route`, its continued lines joined."""
    text = (Path(__file__).resolve().parents[2] / "docs/inference.md").read_text()
    start = text.index(f"curl -X POST http://HOST:PORT{route}")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            return " ".join(lines)
    raise AssertionError(route)


def test_the_documented_curl_sends_the_key_and_keeps_it_out_of_argv(tmp_path):
    """docs/inference.md's command, run by bash: the server gets the key, curl's argv (what
    /proc/PID/cmdline shows) does not hold it. `curl` is a shim that records its argv, then runs curl."""
    import http.server
    import shutil
    import threading

    if shutil.which("curl") is None:
        pytest.skip("no curl here")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "secret").write_text(KEY + "\n")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "curl").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {tmp_path}/argv\nexec {shutil.which("curl")} "$@"\n')
    (shim / "curl").chmod(0o755)
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append((self.path, self.headers.get("Authorization"), self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = documented("/prl/generate").replace("HOST:PORT", f"127.0.0.1:{server.server_port}")
        command = command.replace("RUN/", f"{run}/")
        r = subprocess.run(["bash", "-c", command + " -sS"], capture_output=True, text=True, timeout=30,
                           env={"PATH": f"{shim}:/usr/bin:/bin"})
    finally:
        server.shutdown()
    assert r.returncode == 0 and r.stdout == "{}", r.stderr
    assert [(p, h) for p, h, _ in seen] == [("/prl/generate", f"Bearer {KEY}")]
    argv = (tmp_path / "argv").read_bytes().split(b"\0")
    assert any(a.startswith(b"@/dev/fd/") for a in argv) and not any(KEY.encode() in a for a in argv), argv


@contextlib.contextmanager
def real_server_in_a_thread(port: int, keys: list[str]):
    """real_server on its own event loop in a thread: for code that runs its own (asyncio.run)."""
    import threading

    ready, stop = threading.Event(), None

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        async with real_server(port, keys):
            ready.set()
            await stop.wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        assert ready.wait(10)
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()


def test_the_proof_command_says_whether_it_is_the_runs_server(tmp_path, capsys):
    """`python -m prl.run.proof URL RUN` (docs/inference.md): 0 for the run's server, 1 and one line otherwise."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "secret").write_text(KEY + "\n")
    (run / "secret").chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with real_server_in_a_thread(port, [KEY]):
        assert proof.main([url, str(run)]) == 0
    assert capsys.readouterr().out == f"{url}: proved the run's key\n"
    with real_server_in_a_thread(port, ["another-key-of-another-run-0123456789"]):
        assert proof.main([url, str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{url}: the server did not prove") and err.count("\n") == 1 and KEY not in err
    assert proof.main([url, str(run)]) == 1  # nobody there
    assert capsys.readouterr().err == f"{url}: not reachable (ConnectError)\n"
