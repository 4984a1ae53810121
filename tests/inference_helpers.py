"""Shared by the inference tests on CPU (test_inference.py) and GPU (test_gpu_rl.py): a streamed
request with a weight update posted while it runs, and where it switched weights; the engine's own
Prometheus figures (/metrics), to see what it runs without timing it; the shared CPU server's API key
(conftest.cpu_server); transformers' greedy tokens on the GPU."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

API_KEY = "test-key-5f2a;$HOME 'quoted'"
"""conftest.cpu_server's key, by environment only (inference.api_key_env: PRL_TEST_API_KEY)."""


def stream_with_update(http: httpx.Client, body: dict, update: dict, busy: int = 0) -> tuple[list[int], httpx.Response]:
    """POST /v1/completions `body` streamed; `update` goes to /update_weights once the first tokens
    are back. `busy`: that many copies of the request, not streamed, run beside it, so the engine is
    slower and the request runs long enough for the update to land in it on a fast machine.
    (the streamed token ids, the update's response)"""
    streamed: list[int] = []
    with ThreadPoolExecutor(busy + 1) as pool:
        others = [pool.submit(http.post, "/v1/completions", json={**body, "stream": False}) for _ in range(busy)]
        with http.stream("POST", "/v1/completions", json=body) as stream:
            pending = None
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or []
                    pending = pending or pool.submit(http.post, "/update_weights", json=update)
        assert all(other.result().status_code == 200 for other in others)
        return streamed, pending.result()


def switch_point(streamed: list[int], old: list[int], prompt_ids: list[int],
                 new_greedy: Callable[[list[int], int], list[int]]) -> int | None:
    """The k at which a greedy request went on as the new weights would from its first k tokens
    (`old`: the old weights' greedy tokens; `new_greedy(ids, n)`: the new ones' n next tokens), the
    latest such k (the new weights may agree with the old for a while); None if there is none."""
    cut = next((i for i, (a, b) in enumerate(zip(streamed, old)) if a != b), len(streamed))
    for k in range(min(cut, len(streamed) - 1), 0, -1):
        context = prompt_ids + streamed[:k]
        # A short look first: each candidate costs a forward per token (no KV cache in the reference).
        if streamed[k:k + 16] == new_greedy(context, min(16, len(streamed) - k)):
            if streamed[k:] == new_greedy(context, len(streamed) - k):
                return k
    return None


def metric(http: httpx.Client, name: str) -> float:
    """The sum over labels of the server's Prometheus metric `name` (vllm:num_requests_running...)."""
    lines = http.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{")[0].split(" ")[0] == name)


def wait_for_metric(http: httpx.Client, name: str, done: Callable[[float], bool], timeout_s: float = 60) -> float:
    """Poll `name` until `done(value)`; the value. Fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done(value := metric(http, name)):
        assert time.monotonic() < deadline, f"{name} stayed at {value} for {timeout_s} s"
        time.sleep(0.005)
    return value


GREEDY_TOKENS = 24


def hf_greedy(model, prompt_ids: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    """Argmax decoding without a KV cache, on the GPU in float32."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def perturbed_model(model_dir: Path):
    """The model in float32 plus seeded noise (0.05 x N(0, 1) on every weight): a version whose greedy
    tokens differ from the original's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise))
    return model


def served_greedy(http: httpx.Client, model: str, prompt: str) -> list[int]:
    """The server's greedy token ids for `prompt` (GREEDY_TOKENS of them, EOS ignored)."""
    body = {"model": model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]
