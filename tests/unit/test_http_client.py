"""prl.orchestrator.http_client.ServerRoutes against a real HTTP server on loopback (aiohttp's, which
proves the key as prl's middleware does: prl.run.proof): the key as a bearer token, retries for the answers that mean "try again" and for refused connections, none
for a bad request, whose message reaches the caller.

    pytest tests/unit/test_http_client.py
"""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from prl.run import proof
from prl.run.ports import free_port
from prl.orchestrator import http_client
from prl.orchestrator.http_client import ServerError, ServerRoutes


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(http_client, "BACKOFF_S", 0.01)


async def serving(answers: list[tuple[int, str]], seen: list, port: int | None = None):
    """A server whose /r answers `answers` in turn (status, body), recording each request."""
    async def handle(request):
        seen.append((request.headers.get("Authorization"), await request.json()))
        status, text = answers.pop(0)
        return web.Response(status=status, text=text, content_type="application/json")

    async def prove(request):  # the key, "k", proved for this connection's server end
        at = proof.address(*request.transport.get_extra_info("sockname")[:2])
        return web.json_response(proof.answer(["k"], request.query["nonce"], at))

    app = web.Application()
    app.router.add_post("/r", handle)
    app.router.add_get(proof.ROUTE, prove)
    runner = web.AppRunner(app)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def exchange(answers, retries=3, key="k"):
    """(what post returned or raised, the requests the server saw)."""
    seen = []

    async def main():
        runner, url = await serving(answers, seen)
        client = ServerRoutes(url, key, timeout_s=10, retries=retries)
        try:
            return await client.post("/r", {"x": 1})
        except Exception as e:
            return e
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(main()), seen


def test_the_answer_comes_back_and_the_key_goes_as_a_bearer_token():
    result, seen = exchange([(200, '{"tokens": [1, 2]}')])
    assert result == {"tokens": [1, 2]} and seen == [("Bearer k", {"x": 1})]
    assert exchange([(200, "{}")], key=None)[1] == [(None, {"x": 1})]


def test_try_again_answers_are_retried_and_the_last_one_is_raised():
    result, seen = exchange([(503, "busy"), (429, "slow down"), (200, '{"ok": true}')])
    assert result == {"ok": True} and len(seen) == 3
    result, seen = exchange([(500, "a"), (502, "b"), (503, "still down")], retries=2)
    assert isinstance(result, ServerError) and result.status == 503 and result.text == "still down"
    assert len(seen) == 3


def test_a_bad_request_is_not_retried_and_keeps_the_servers_message():
    result, seen = exchange([(400, "This model's maximum context length is 512 tokens"), (200, "{}")])
    assert isinstance(result, ServerError) and result.status == 400 and len(seen) == 1
    assert "maximum context length" in result.text and "answered 400" in str(result)


def test_a_refused_connection_is_retried_then_raised(monkeypatch):
    """The server starts listening while the client waits to try again: the retry gets through."""
    monkeypatch.setattr(http_client, "BACKOFF_S", 0.3)
    port, seen = free_port(), []
    client = ServerRoutes(f"http://127.0.0.1:{port}", "k", timeout_s=10, retries=2)

    async def late_server():
        async def start():
            await asyncio.sleep(0.1)
            return await serving([(200, '{"late": true}')], seen, port)

        server = asyncio.create_task(start())
        try:
            return await client.post("/r", {})
        finally:
            await client.close()
            await (await server)[0].cleanup()

    assert asyncio.run(late_server()) == {"late": True} and len(seen) == 1
    gone = ServerRoutes(f"http://127.0.0.1:{free_port()}", "k", timeout_s=10, retries=1)

    async def nobody():
        try:
            await gone.post("/r", {})
        finally:
            await gone.close()

    with pytest.raises(aiohttp.ClientConnectionError):
        asyncio.run(nobody())
