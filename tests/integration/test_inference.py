"""The inference server against real vLLM (CPU build) on the tiny model, checked against transformers.

    pytest -m vllm tests/integration/test_inference.py        # the session's one server (conftest.cpu_server), ~1 minute on 2 cores

Everything runs in float32, so vLLM's greedy tokens and logprobs must equal transformers' exactly
(tokens) or to float32 noise (logprobs): that is what makes the trainer's importance ratios valid.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inference_helpers import API_KEY, metric, perturbed_model, stream_with_update, switch_point, wait_for_metric
from prl.run import proof

PROMPTS = ["What is 12 + 35?", "Reverse: the cat sees a red ball", "The quick brown fox"]
GREEDY_TOKENS = 24


@dataclass
class Api:
    """The server as the orchestrator sees it: completions with token ids, weight updates."""

    http: httpx.Client
    model: str

    def complete(self, prompt: str, **params) -> dict:
        body = {"model": self.model, "prompt": prompt, "return_token_ids": True, **params}
        response = self.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    def greedy(self, prompt: str, n: int = GREEDY_TOKENS) -> list[int]:
        return self.complete(prompt, max_tokens=n, temperature=0, ignore_eos=True)["token_ids"]

    def update(self, path: Path | str) -> httpx.Response:
        return self.http.post("/update_weights", json={"path": str(path)})


@pytest.fixture(scope="module")
def api(cpu_server, tiny_model: Path) -> Api:
    with httpx.Client(base_url=cpu_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        yield Api(http, str(tiny_model))


@pytest.fixture(scope="module")
def hf_models(tiny_model: Path):
    """(original, perturbed) transformers models in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return original, perturbed_model(tiny_model)


@pytest.fixture(scope="module")
def step_1(hf_models, tmp_path_factory) -> Path:
    """The perturbed model saved as the trainer saves a policy version."""
    path = tmp_path_factory.mktemp("weights") / "step_1"
    hf_models[1].save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def hf_greedy(model, prompt_ids: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    """Argmax decoding without a KV cache: the plainest reference there is."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.mark.vllm
def test_health(api):
    assert api.http.get("/health").status_code == 200


@pytest.mark.vllm
def test_completion_returns_token_ids_and_temperature_scaled_logprobs(api, hf_models, tiny_model, tokenizer):
    import torch

    assert api.update(tiny_model).status_code == 200
    choice = api.complete(PROMPTS[0], max_tokens=12, temperature=0.7, seed=3, logprobs=1, ignore_eos=True)
    prompt_ids, ids = choice["prompt_token_ids"], choice["token_ids"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert prompt_ids == tokenizer(PROMPTS[0])["input_ids"]
    assert len(ids) == len(logprobs) == 12

    # The trainer's side of the importance ratio: log_softmax(logits / T) of the sampled tokens.
    with torch.no_grad():
        logits = hf_models[0](torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())


@pytest.mark.vllm
def test_prl_generate_returns_the_sampled_ids_and_their_logprobs(api, hf_models, tiny_model, tokenizer):
    """POST /prl/generate (the orchestrator's token route): the same tokens as /v1/completions for the
    same seed, their temperature-scaled logprobs as plain floats; bad requests get 400 and one line."""
    import torch

    assert api.update(tiny_model).status_code == 200
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    params = {"max_tokens": 12, "temperature": 0.7, "seed": 3, "ignore_eos": True}
    response = api.http.post("/prl/generate", json={"token_ids": prompt_ids, "sampling_params": params})
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["finish_reason"] == "length" and out["prompt_tokens"] == len(prompt_ids)
    assert out["token_ids"] == api.complete(PROMPTS[0], **params)["token_ids"]
    with torch.no_grad():
        logits = hf_models[0](torch.tensor([prompt_ids + out["token_ids"]])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(out["token_ids"])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out["logprobs"]), expected, atol=1e-4)
    # Without logprobs (trainer.behaviour_logprobs: recompute): the same tokens, no logprobs at all.
    response = api.http.post("/prl/generate", json={"token_ids": prompt_ids, "sampling_params": params, "logprobs": False})
    assert response.status_code == 200, response.text
    assert response.json()["token_ids"] == out["token_ids"] and response.json()["logprobs"] is None
    # Routed experts asked of a server that records none (a dense model, no --enable-return-routed-experts):
    # null, which the orchestrator counts as "not recorded", never as an empty routing.
    response = api.http.post("/prl/generate", json={"token_ids": prompt_ids, "sampling_params": params,
                                                    "routed_experts": True})
    assert response.json()["token_ids"] == out["token_ids"] and response.json()["routed_experts"] is None
    assert "routed_experts" not in out

    bad = {
        "logprobs must be true or false": {"token_ids": prompt_ids, "sampling_params": params, "logprobs": "no"},
        "routed_experts must be true or false": {"token_ids": prompt_ids, "sampling_params": params,
                                                 "routed_experts": 1},
        "token_ids": {"token_ids": [], "sampling_params": params},
        "sampling_params": {"token_ids": prompt_ids, "sampling_params": {"temprature": 1.0}},
        "maximum context length": {"token_ids": [5] * 600, "sampling_params": params},  # max_model_len 512
    }
    for words, body in bad.items():
        response = api.http.post("/prl/generate", json=body)
        assert response.status_code == 400 and words in response.json()["error"], (words, response.text)
    assert api.http.get("/prl/generate").status_code == 405
    assert api.http.get("/health").status_code == 200  # and it serves on


@pytest.mark.vllm
def test_chat_through_the_openai_client(cpu_server, tiny_model, tokenizer):
    """What the orchestrator does: token ids ride in `extra_body`, come back as extra response fields."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{cpu_server.url}/v1", api_key=API_KEY)
    messages = [{"role": "user", "content": "Reverse: hello world"}]
    response = client.chat.completions.create(
        model=str(tiny_model), messages=messages, max_tokens=8, temperature=1.0, logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = response.choices[0]
    assert response.prompt_token_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert len(choice.token_ids) == len(choice.logprobs.content) == 8
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)


@pytest.mark.vllm
def test_update_weights_matches_transformers(api, hf_models, tiny_model, tokenizer, step_1):
    original, perturbed = hf_models
    assert api.update(tiny_model).status_code == 200
    before = [api.greedy(p) for p in PROMPTS]
    response = api.update(step_1)
    assert response.status_code == 200, response.text
    after = [api.greedy(p) for p in PROMPTS]
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert before == [hf_greedy(original, ids) for ids in prompt_ids]
    assert after == [hf_greedy(perturbed, ids) for ids in prompt_ids]
    assert after != before


@pytest.mark.vllm
def test_a_staged_version_loads_from_memory(api, hf_models, tiny_model, tokenizer, step_1, tmp_path):
    """{"stage": true} reads step_1 ahead while the server goes on serving the old weights; the update
    of that path then loads the staged copy ("source": "staged") and generates what transformers does
    with those weights. A copy staged for another path, or whose file changed since, is not used."""
    stage = lambda path, **more: api.http.post("/update_weights", json={"path": str(path), "stage": True, **more})
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert api.update(tiny_model).json()["source"] == "file"
    response = stage(step_1)
    assert response.status_code == 200 and response.json()["status"] == "staging", response.text
    assert api.greedy(PROMPTS[0]) == hf_greedy(hf_models[0], prompt_ids[0])  # staged is not loaded
    response = api.update(step_1)
    assert response.status_code == 200 and response.json()["source"] == "staged", response.text
    assert [api.greedy(p) for p in PROMPTS] == [hf_greedy(hf_models[1], ids) for ids in prompt_ids]

    copy = shutil.copytree(step_1, tmp_path / "step_2")
    assert stage(copy).json()["status"] == "staging"
    assert api.update(tiny_model).json()["source"] == "file"  # staged for another path
    assert api.greedy(PROMPTS[0]) == hf_greedy(hf_models[0], prompt_ids[0])
    assert stage(copy).json()["status"] == "staging"
    file = copy / "model.safetensors"
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 1))  # rewritten since
    assert api.update(copy).json()["source"] == "file"
    assert api.greedy(PROMPTS[0]) == hf_greedy(hf_models[1], prompt_ids[0])

    for body, words in (({"path": str(copy), "stage": "yes"}, "stage must be true or false"),
                        ({"path": str(copy), "stage": True, "in_flight": True}, "not with version or in_flight"),
                        ({"path": str(tmp_path / "missing"), "stage": True}, "no such directory"),
                        ({"path": "/etc", "stage": True}, "not in this server's weights directory")):
        response = api.http.post("/update_weights", json=body)
        assert response.status_code == 400 and words in response.json()["error"], (body, response.text)
    assert api.update(tiny_model).status_code == 200


@pytest.mark.vllm
def test_running_request_finishes_on_the_old_weights(api, hf_models, tiny_model, tokenizer, step_1):
    assert api.update(tiny_model).status_code == 200
    old = hf_greedy(hf_models[0], tokenizer(PROMPTS[1])["input_ids"], n=64)
    body = {"model": api.model, "prompt": PROMPTS[1], "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    streamed: list[int] = []
    with ThreadPoolExecutor(1) as pool, api.http.stream("POST", "/v1/completions", json=body) as stream:
        pending = None
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            streamed += json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or []
            # The update arrives while the request is running: it must wait for it, not cut it over.
            pending = pending or pool.submit(api.update, step_1)
        assert pending.result().status_code == 200
    assert streamed == old
    assert api.greedy(PROMPTS[1])[:GREEDY_TOKENS] == hf_greedy(hf_models[1], tokenizer(PROMPTS[1])["input_ids"])


@pytest.mark.vllm
def test_in_flight_update_keeps_the_running_request_and_goes_on_with_the_new_weights(
        api, hf_models, tiny_model, tokenizer, step_1):
    """"in_flight": true (orchestrator.continuous): the running request is not waited for; it stops,
    and its next tokens are the new weights' greedy continuation of everything it wrote so far, as
    if generated from scratch under them (its KV cache was recomputed, not reused)."""
    prompt_ids, n = tokenizer(PROMPTS[2])["input_ids"], 400
    old = hf_greedy(hf_models[0], prompt_ids, n=n)
    body = {"model": api.model, "prompt": PROMPTS[2], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    for _ in range(3):  # on a loaded machine the update may land only after the request has ended
        assert api.update(tiny_model).status_code == 200
        update_body = {"path": str(step_1), "in_flight": True}
        streamed, update = stream_with_update(api.http, body, update_body, busy=15)
        assert update.status_code == 200 and len(streamed) == n
        if streamed != old:
            break
    assert streamed != old, "in 3 tries the update never landed while the request ran"
    k = switch_point(streamed, old, prompt_ids, lambda ids, count: hf_greedy(hf_models[1], ids, n=count))
    first = next(i for i, (a, b) in enumerate(zip(streamed, old)) if a != b)
    assert k is not None, f"the request never went on as the new weights would (first difference at token {first})"
    print(f"in-flight update: the request switched weights after token {k} of {n}")
    assert api.update(tiny_model).status_code == 200


@pytest.mark.vllm
def test_a_token_request_whose_client_leaves_is_aborted(api, tiny_model, tokenizer):
    """/prl/generate aborts the engine request when its client disconnects (an orchestrator that
    stops, or cancels groups it no longer needs), so a weight update, which waits for running
    requests, does not wait for it. 16 clients each ask for 480 tokens (one completion per request:
    generate.ALLOWED) and close their sockets once the engine runs them; the engine's counters (not a
    clock: a fast machine would finish first) show they stopped short of the 7,680 tokens they would
    have written."""
    import http.client
    import time
    from urllib.parse import urlsplit

    assert api.update(tiny_model).status_code == 200
    samples, max_tokens = 16, 480
    body = {"token_ids": tokenizer(PROMPTS[0])["input_ids"],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": 1, "ignore_eos": True}}
    assert metric(api.http, "vllm:num_requests_running") == 0
    before = metric(api.http, "vllm:generation_tokens_total")
    url = urlsplit(str(api.http.base_url))
    clients = [http.client.HTTPConnection(url.hostname, url.port) for _ in range(samples)]
    for client in clients:
        client.request("POST", "/prl/generate", body=json.dumps(body),
                       headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    wait_for_metric(api.http, "vllm:num_requests_running", lambda running: running >= samples)
    for client in clients:
        client.close()  # the clients leave without reading the answer
    start = time.monotonic()
    wait_for_metric(api.http, "vllm:num_requests_running", lambda running: running == 0)
    stopped = time.monotonic() - start
    written = metric(api.http, "vllm:generation_tokens_total") - before
    assert written < samples * max_tokens, written
    update = api.update(tiny_model)
    assert update.status_code == 200
    print(f"/prl/generate abandoned: the engine stopped {stopped:.2f}s after the client left, having written "
          f"{written:.0f} of {samples * max_tokens} tokens; the next update took {update.json()['seconds']:.2f}s")


def corrupt_copy(source: Path, target: Path, rename=None, dtype=None) -> Path:
    """`source`'s safetensors with tensor names renamed or one dtype lied about (header rewritten)."""
    blob = (source / "model.safetensors").read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    if rename:
        header = {rename(k) if k != "__metadata__" else k: v for k, v in header.items()}
    if dtype:
        header[sorted(k for k in header if k != "__metadata__")[0]]["dtype"] = dtype
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    target.mkdir()
    (target / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + blob[8 + size :])
    return target


@pytest.mark.vllm
def test_bad_updates_are_refused_and_serving_goes_on(api, tmp_path, step_1):
    assert api.update(step_1).status_code == 200
    before = api.greedy(PROMPTS[0])
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "model.safetensors").write_bytes((step_1 / "model.safetensors").read_bytes()[:4096])
    refused = {  # checked before the engine is touched
        "no such directory": tmp_path / "missing",
        "must be absolute": "weights/step_1",
        "no *.safetensors": tmp_path,
        "truncated": truncated,
        "unexpected ['_orig_mod.": corrupt_copy(step_1, tmp_path / "prefixed", rename=lambda k: "_orig_mod." + k),
    }
    for message, path in refused.items():
        response = api.update(path)
        assert response.status_code == 400 and message in response.json()["error"], response.text
    assert api.http.post("/update_weights", content=b"{not json").status_code == 400

    # Passes the header checks, fails inside the workers: the server must restore step_1.
    response = api.update(corrupt_copy(step_1, tmp_path / "lying-dtype", dtype="F16"))
    assert response.status_code == 500 and f"restored {step_1}" in response.json()["error"], response.text
    assert api.greedy(PROMPTS[0]) == before
    assert api.http.get("/health").status_code == 200


def test_weights_from_outside_the_run_and_versions_it_cannot_want_are_refused(api, tmp_path, step_1):
    """The server loads only from its weights directory (the run's weights/; here the session's temp
    directory) or its own model, links resolved, and says nothing about what lies outside; a FIFO
    posing as weights is refused without blocking the server; a broadcast version not newer than the
    one served is refused before the engine pauses."""
    outside = Path(tempfile.mkdtemp(prefix="prl-outside-", dir="/var/tmp"))
    try:
        shutil.copytree(step_1, outside / "step_1")
        (tmp_path / "link").symlink_to(outside / "step_1")
        for path in (outside / "step_1", tmp_path / "link", "/etc", "/no/such/dir"):
            response = api.update(path)
            assert response.status_code == 400, response.text
            assert response.json()["error"].startswith(f"{path}: not in this server's weights directory")
            assert "no such" not in response.json()["error"] and "safetensors" not in response.json()["error"]
    finally:
        shutil.rmtree(outside)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    response = api.update(fifo)
    assert response.status_code == 400 and "not a regular file" in response.json()["error"], response.text

    assert api.update(step_1).status_code == 200  # version 1 (weights/step_1)
    for version in (0, 1):
        response = api.http.post("/update_weights", json={"version": version, "path": str(step_1)})
        assert response.status_code == 400 and "not newer than the version served (1)" in response.json()["error"]
    assert api.http.get("/health").status_code == 200


def test_prl_generate_takes_only_the_sampling_fields_prl_sends(api):
    """One completion per request, no logprobs of other tokens or of the prompt, nothing that changes
    the answer's form; a max_tokens beyond the model's length ends at the model's length."""
    ok = {"temperature": 1.0, "max_tokens": 4, "seed": 3, "stop_token_ids": [0], "ignore_eos": True}
    assert api.http.post("/prl/generate", json={"token_ids": [5, 6], "sampling_params": ok}).status_code == 200
    for extra, word in (({"n": 2}, "n must be 1"), ({"best_of": 4}, "best_of"), ({"logprobs": 20}, "logprobs"),
                        ({"prompt_logprobs": 5}, "prompt_logprobs"), ({"output_kind": 0}, "output_kind"),
                        ({"detokenize": True}, "detokenize")):
        response = api.http.post("/prl/generate", json={"token_ids": [5, 6], "sampling_params": ok | extra})
        assert response.status_code == 400 and word in response.json()["error"], (extra, response.text)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for body, word in (({"tools": {"add": 1}}, "tools must be a list"), ({"tools": [{"type": "nonsense"}]}, "tools"),
                       ({"sampling_params": ok | {"structured_outputs": "a|b"}}, "structured_outputs must be"),
                       ({"sampling_params": ok | {"structured_outputs": {"regexp": "a"}}}, "structured_outputs")):
        response = api.http.post("/prl/generate", json={"token_ids": [5, 6], "sampling_params": ok} | body)
        assert response.status_code == 400 and word in response.json()["error"], (body, response.text)
    # With tools (this server parses hermes calls): the text and the calls found in it, here none.
    response = api.http.post("/prl/generate", json={"token_ids": [5, 6], "sampling_params": ok, "tools": tools})
    answer = response.json()
    assert answer["tool_calls"] == [] and isinstance(answer["content"], str) and answer["finish_reason"] == "length"
    # A max_tokens past the model's length: vLLM stops at model.max_model_len (512), prompt included.
    response = api.http.post("/prl/generate", json={"token_ids": [5, 6], "sampling_params": ok | {"max_tokens": 10**9}})
    assert response.status_code == 200 and len(response.json()["token_ids"]) == 512 - 2, response.text[:200]


ROUTES = [("POST", "/update_weights", {"path": "/tmp"}), ("POST", "/prl/generate", {"token_ids": [1]}),
          ("POST", "/v1/completions", {"prompt": "x"}), ("POST", "/v1/chat/completions", {"messages": []}),
          ("GET", "/v1/models", None), ("POST", "/invocations", {"prompt": "x"}), ("POST", "/tokenize", {"prompt": "x"}),
          ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/metrics", None), ("GET", "/load", None),
          ("GET", "/version", None), ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/ping", None),
          ("POST", "/pause", None), ("GET", "/is_sleeping", None), ("GET", "/no/such/route", None)]


@pytest.mark.vllm
def test_every_route_but_health_needs_the_key(cpu_server):
    """A stranger on the machine (no key, a wrong one, another scheme) gets 401 from every route, also
    those vLLM's own key leaves open (/invocations generates, /tokenize, /metrics); /health answers, and
    /prl/proof proves the key (prl.run.proof) without taking it."""
    server = cpu_server
    for method, path, body in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                        {"Authorization": f"Bearer {API_KEY}x"}):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=30).status_code == 200
    # and it proves it holds the key before a client sends it (prl.run.proof), through vLLM's own app
    asyncio.run(proof.prove(server.url, API_KEY))
    with pytest.raises(proof.Unproven):
        asyncio.run(proof.prove(server.url, API_KEY + "x"))
    assert httpx.get(f"{server.url}{proof.ROUTE}", params={"nonce": "x" * 64}, timeout=30).status_code == 400


def listening_addresses(port: int) -> set[str]:
    """The IPv4/IPv6 addresses with a socket listening on `port` (/proc/net/tcp{,6}, state 0A)."""
    found = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                found.add(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words))
    return found


@pytest.mark.vllm
def test_a_server_of_one_machine_listens_on_loopback_only(cpu_server):
    port = int(cpu_server.url.rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}


@pytest.mark.vllm
def test_api_key_guards_the_server_and_is_never_written(cpu_server, step_1):
    server = cpu_server
    assert server.headers == {"Authorization": f"Bearer {API_KEY}"}
    assert API_KEY not in Path(f"/proc/{server.process.pid}/cmdline").read_text()
    log_file = server.log_dir / "inference" / "rank_0.log"
    assert "vllm serve --model" in log_file.read_text()
    for text in (server.output.read_text(), log_file.read_text()):
        assert API_KEY not in text


@pytest.mark.vllm
def test_the_cpu_engine_process_is_forked_from_the_api_server(cpu_server):
    """inference.gpus_per_node=0: vLLM's engine core starts by fork (cpu_engine_environment,
    keep_start_method_on_cpu), not as a fresh interpreter importing vLLM again. Told apart by where
    libc lies in memory: address-space randomization places it anew at every exec, so a spawned engine
    (a new exec) has it elsewhere than the API server, and a forked one, a copy of the API server's
    memory, at the same address."""
    from prl.run.procs import descendants

    assert Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0", "needs ASLR to tell them apart"

    def libc(pid: int) -> str:
        return next(line.split("-")[0] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                    if "/libc.so" in line)

    engines = [pid for pid, _ in descendants(cpu_server.process.pid)
               if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor")]
    assert len(engines) == 1, descendants(cpu_server.process.pid)
    assert libc(engines[0]) == libc(cpu_server.process.pid)
