"""The inference server with several API-server processes (`inference.extra_args=[--api-server-count,2]`).

    pytest -m vllm tests/integration/test_inference_api_servers.py    # ~2 min on 2 cores; on a CUDA GPU it uses the GPU

vLLM then serves one listening socket from N API-server processes in front of one engine; each
connection stays with the process that accepted it. Every route must answer in every process (prl's
middleware and the API key reach the spawned ones), and a weight update received by one process
must hold back the requests of all: `pause_generation` is the engine scheduler's pause state (vLLM
0.26 and 0.32 alike), not the receiving process's. Each check below pins its HTTP connections to a
named process, read from the server's process table.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

API_KEY = "test-key-7d1e;$HOME 'quoted'"
PROMPT, OTHER = "Reverse: the cat sees a red ball", "The quick brown fox"
LONG = 400
"""Tokens of the request that is running while an update arrives (max_model_len is 512)."""


@pytest.fixture(scope="module")
def config(tiny_model: Path, tmp_path_factory) -> Path:
    import torch

    # On a GPU (vLLM 0.26 there): a fixed KV cache instead of profiling, as tests/gpu/test_gpu_rl.py.
    device = ("{gpus_per_node: 1, gpu_memory_utilization: 0.3, extra_args: [--api-server-count, '2', "
              "--kv-cache-memory-bytes, '2147483648'],\n" if torch.cuda.is_available() else
              "{gpus_per_node: 0, enforce_eager: true, extra_args: [--api-server-count, '2'],\n")
    config = tmp_path_factory.mktemp("config") / "inference.yaml"
    config.write_text(
        f"run: {{name: api-servers-test, output_dir: {config.parent}/out}}\n"
        f"model: {{name: {tiny_model}, dtype: float32, max_model_len: 512}}\n"
        f"inference: {device}"
        # Dev mode adds GET /is_paused: the test waits for the pause before sending into it.
        f"            weights_root: {tmp_path_factory.getbasetemp()},\n"
        "            api_key_env: PRL_TEST_API_KEY, env: {VLLM_CPU_KVCACHE_SPACE: '1', VLLM_SERVER_DEV_MODE: '1'}}\n"
        "orchestrator: {environment: {id: prl.envs.toy}}\n"
    )
    return config


@pytest.fixture(scope="module")
def server(config: Path, start_inference_server):
    server = start_inference_server(config, env={"PRL_TEST_API_KEY": API_KEY})
    yield server
    server.stop()


def connections(server) -> dict[str, set[int]]:
    """Server process name (VLLM::APIServer_N) -> the client ports of the connections it holds."""
    import psutil

    port = int(server.url.rsplit(":", 1)[1])
    return {
        process.name(): {c.raddr.port for c in process.net_connections() if c.raddr and c.laddr.port == port}
        for process in psutil.Process(server.process.pid).children(recursive=True)
    }


def owner(server, client: httpx.Client) -> str:
    """The server process that holds `client`'s one connection."""
    with client.stream("GET", "/health") as response:
        port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
        response.read()
    names = [name for name, ports in connections(server).items() if port in ports]
    assert len(names) == 1, f"connection from port {port} held by {names}"
    return names[0]


@pytest.fixture(scope="module")
def pinned(server):
    """Process name -> two clients, each with one keep-alive connection to that process."""
    by_process: dict[str, list[httpx.Client]] = {}
    opened = []
    while len(by_process) < 2 or min(map(len, by_process.values())) < 2:
        assert len(opened) < 64, f"64 connections reached only {sorted(by_process)}"
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                              limits=httpx.Limits(max_connections=1))
        opened.append(client)
        by_process.setdefault(owner(server, client), []).append(client)
    assert len(by_process) == 2, sorted(by_process)
    yield {name: clients[:2] for name, clients in sorted(by_process.items())}
    for client in opened:
        client.close()


def greedy(client: httpx.Client, model: Path, prompt: str, n: int = 24) -> list[int]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def update(client: httpx.Client, path: Path) -> dict:
    response = client.post("/update_weights", json={"path": str(path)})
    assert response.status_code == 200, response.text
    return response.json()


def test_every_process_serves_every_route(pinned, tiny_model, server):
    tokens, chat, generated = {}, {}, {}
    for name, (client, _) in pinned.items():
        tokens[name] = greedy(client, tiny_model, PROMPT)
        body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "Reverse: hello"}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        chat[name] = [e["token"] for e in response.json()["choices"][0]["logprobs"]["content"]]
        params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = client.post("/prl/generate", json={"token_ids": [9, 8, 7], "sampling_params": params})
        assert response.status_code == 200, response.text
        generated[name] = response.json()["token_ids"]
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        response = client.post("/prl/generate", json={"token_ids": [9, 8, 7], "sampling_params": params, "tools": tools})
        assert response.status_code == 400 and "inference.tool_call_parser" in response.json()["error"]  # no parser here
        no_key = {"Authorization": ""}
        assert client.post("/prl/generate", json={"token_ids": [1]}, headers=no_key).status_code == 401
        assert client.post("/update_weights", json={"path": "/x"}, headers=no_key).status_code == 401
        assert owner(server, client) == name  # still the same connection
    for outputs in (tokens, chat, generated):
        assert len(set(map(tuple, outputs.values()))) == 1, outputs  # one engine behind both


def test_an_update_through_one_process_pauses_the_others(pinned, tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise))
    step_1 = tmp_path / "step_1"
    model.save_pretrained(step_1)
    (a, a2), (b, b2) = pinned.values()

    update(a, tiny_model)
    old = {PROMPT: greedy(a, tiny_model, PROMPT, LONG), OTHER: greedy(b, tiny_model, OTHER)}
    update(b, step_1)
    new = {PROMPT: greedy(a, tiny_model, PROMPT, LONG), OTHER: greedy(b, tiny_model, OTHER)}
    assert new[PROMPT] != old[PROMPT] and new[OTHER] != old[OTHER]
    update(a, tiny_model)
    assert greedy(b, tiny_model, OTHER) == old[OTHER]

    # A request runs through process A; the update arrives through process B.
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    streamed: list[int] = []
    swap = None
    with ThreadPoolExecutor(3) as pool, a.stream("POST", "/v1/completions", json=body) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
                # The first chunk that holds tokens, however many: a busy API server sends several
                # tokens in one chunk when the engine runs ahead of it.
                if streamed and swap is None:
                    swap = pool.submit(update, b, step_1)
                    paused = wait_paused(a2, swap)
                    # Sent while paused, through both processes: they must wait and run on step_1.
                    queued = [pool.submit(greedy, c, tiny_model, OTHER) for c in (a2, b2)]
        assert swap is not None, f"the stream held no tokens: {streamed}"
        swap.result()
    assert paused, "the update finished before the pause could be seen: the running request was too short"
    assert streamed == old[PROMPT]
    assert [q.result() for q in queued] == [new[OTHER]] * 2
    assert greedy(a, tiny_model, PROMPT, LONG) == greedy(b, tiny_model, PROMPT, LONG) == new[PROMPT]


def wait_paused(client: httpx.Client, swap, timeout_s: float = 60) -> bool:
    """Until the engine reports the pause, asked through `client`'s process (not the one updating)."""
    deadline = time.monotonic() + timeout_s
    while not swap.done() and time.monotonic() < deadline:
        if client.get("/is_paused").json()["is_paused"]:
            return True
        time.sleep(0.01)
    return False


def test_the_orchestrator_client_spreads_a_step_over_the_processes(server, tiny_model):
    """A step's rollouts start at once; the orchestrator's client (one AsyncOpenAI per server URL)
    opens a connection per request in flight, and every process must get a share of them: a process
    receiving all of them would leave the others' output processing unused."""
    import asyncio

    from prl.orchestrator.client import Servers

    n = 64
    before = {name: set(ports) for name, ports in connections(server).items()}

    async def step() -> tuple[list, dict[str, set[int]]]:
        servers = Servers([f"{server.url}/v1"], API_KEY, tokenizer=str(tiny_model))
        params = {"max_tokens": 16, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
        try:
            completions = await asyncio.gather(*(servers.clients[0].generate([9, 8, 7], str(tiny_model),
                                                                             {**params, "seed": i}) for i in range(n)))
            return completions, connections(server)  # kept alive: still open
        finally:
            await servers.close()

    completions, after = asyncio.run(step())
    assert all(len(c.result["token_ids"]) == 16 for c in completions)
    opened = {name: len(ports - before.get(name, set())) for name, ports in after.items() if "APIServer" in name}
    print(f"\n{n} concurrent requests, new connections per process: {opened}")
    assert sum(opened.values()) == n and min(opened.values()) >= n // 4, opened


def test_a_second_server_on_the_same_port_is_refused(server, config, tmp_path):
    """vLLM binds with SO_REUSEPORT here, so the kernel would let a second server share the port."""
    from prl.inference.standalone import start_server

    port = int(server.url.rsplit(":", 1)[1])
    second = start_server(config, output=tmp_path / "second.out", env={"PRL_TEST_API_KEY": API_KEY}, port=port)
    try:
        assert second.process.wait(timeout=300) == 1
    finally:
        second.stop()  # if it did start: by its process group, with its engine
    assert f"inference.port: 127.0.0.1:{port} is taken" in second.tail(), second.tail()
    assert httpx.get(f"{server.url}/health").status_code == 200
