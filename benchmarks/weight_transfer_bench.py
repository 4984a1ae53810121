"""A policy version into a running vLLM server: from its file (inference.weight_transfer: filesystem)
against trainer rank 0's broadcast (broadcast), same model, same server, one run.

    python benchmarks/weight_transfer_bench.py configs/toy.yaml model.name=$PWD/.cache/tiny-qwen2   # CPU: gloo
    # one GPU, server and "trainer" on it: gloo through host memory
    python benchmarks/weight_transfer_bench.py configs/toy.yaml model.name=/tmp/m15 model.dtype=bfloat16 \\
        model.max_model_len=2048 inference.gpus_per_node=1 inference.enforce_eager=false
    # two GPUs: the server on GPU 0, the sender on GPU 1: NCCL
    ... --sender-device cuda:1

This process plays trainer rank 0: the model's tensors in host memory (pinned with a GPU), a
`prl.trainer.broadcast_sender.Sender`, and the orchestrator's `Coordinator`. Each round times, client side:
- file: POST /update_weights {"path"}, alternating a copy of the model directory and the model itself
  (every call really swaps; both are in the page cache after the first round, as a fresh version is);
- broadcast: stage version k, the orchestrator's offer (have -> want -> go), POST {"version": k},
  until the server's 200.
Then greedy completions after a file update and after a broadcast update of the same weights must
be the same tokens. The broadcast is the run's, signed and checked (prl.run.broadcast): this process
plays a launch of a run in a temporary directory (its secret, logs/attempt_0). What the version's tag
costs is timed here too: hashing the model's tensors on the host in the sender's thread pool
(`hash_s`, the trainer's side; a worker hashes the same bytes after copying each bucket to the host).
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from prl.config import load_config
from prl.inference.standalone import start_server
from prl.orchestrator.broadcast_coordinator import Coordinator
from prl.run import broadcast as bc
from prl.run import secret
from prl.run.attempt import LOG_DIR_ENV, Attempt
from prl.trainer.broadcast_sender import Sender

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_bench import machine  # noqa: E402


def host_state(model_dir: Path, pin: bool) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state |= load_file(file)
    return {name: t.pin_memory() if pin else t for name, t in state.items()}


HEADERS: dict[str, str] = {}
"""The server's key (LocalServer.headers), set once it is started."""


def post(url: str, body: dict) -> None:
    response = httpx.post(f"{url}/update_weights", json=body, headers=HEADERS, timeout=900)
    if response.status_code != 200:
        raise RuntimeError(f"update {body} answered {response.status_code}: {response.text[:500]}")


def greedy(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": "Reverse: the cat sees a red ball", "max_tokens": 16, "temperature": 0.0,
            "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def time_hashing(state: dict[str, torch.Tensor]) -> float:
    """Seconds to hash every tensor as the sender does for a version's tag (median of 3)."""
    times = []
    with bc.hash_pool() as pool:
        for _ in range(3):
            start = time.perf_counter()
            hashes = bc.Hashes(pool)
            for tensor in state.values():
                hashes.add(tensor)
            hashes.digests()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def broadcast_round(url: str, sender: Sender, coordinator: Coordinator, state: dict, version: int, path: Path) -> float:
    start = time.perf_counter()
    sender.stage(version, sender.staging(), state)
    if not asyncio.run(coordinator.offer(version, path)):
        raise RuntimeError(f"version {version} was not offered for broadcast")
    post(url, {"version": version, "path": str(path)})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--updates", type=int, default=5, help="rounds; each times one file and one broadcast update")
    parser.add_argument("--sender-device", default="cpu", help="cuda:N: NCCL from that GPU; cpu: gloo")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    device = torch.device(args.sender_device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    model_dir = Path(cfg.model.name).resolve()
    state = host_state(model_dir, pin=torch.cuda.is_available())
    gib = sum(t.numel() * t.element_size() for t in state.values()) / 2**30
    workers = cfg.inference.tensor_parallel * cfg.inference.data_parallel
    with tempfile.TemporaryDirectory() as work:
        attempt = Attempt(Path(work) / "run/logs/attempt_0")
        attempt.dir.mkdir(parents=True)
        secret.ensure(attempt.run_dir)
        access = bc.Access.of(attempt)
        sender = Sender(access, "127.0.0.1", 1 + workers, backend, device, slots=2, timeout_s=600)
        coordinator = Coordinator(access)
        env = {"MASTER_ADDR": "127.0.0.1", LOG_DIR_ENV: str(attempt.dir)}
        hash_s = time_hashing(state)
        copy = Path(shutil.copytree(model_dir, Path(work) / "weights"))
        server = start_server(args.config, [*args.overrides, f"inference.weights_root={work}"],
                              output=Path(work) / "server.out", env=env)
        HEADERS.update(server.headers)
        try:
            server.wait_healthy(timeout_s=900)
            files, casts = [], []
            for i in range(args.updates):
                start = time.perf_counter()
                post(server.url, {"path": str([copy, model_dir][i % 2])})
                files.append(time.perf_counter() - start)
                casts.append(broadcast_round(server.url, sender, coordinator, state, i + 1, copy))
                print(f"round {i}: file {files[-1]:.3f}s, broadcast {casts[-1]:.3f}s", flush=True)
            by_broadcast = greedy(server.url, cfg.model.name)
            post(server.url, {"path": str(copy)})
            same = greedy(server.url, cfg.model.name) == by_broadcast
        except Exception:
            print(Path(work, "server.out").read_text()[-6000:])
            raise
        finally:
            server.stop()
            sender.close()
    # The first round of each includes one-time costs (page cache, the group's forming): medians skip it.
    file_s, cast_s = statistics.median(files[1:] or files), statistics.median(casts[1:] or casts)
    result = {"machine": machine(), "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "model_gib": round(gib, 3), "backend": backend, "sender_device": str(device),
              "hash_s": round(hash_s, 4), "hash_threads": bc.HASH_THREADS,
              "file_median_s": round(file_s, 4), "broadcast_median_s": round(cast_s, 4),
              "broadcast_vs_file": round(cast_s / file_s, 3), "file_s": [round(s, 4) for s in files],
              "broadcast_s": [round(s, 4) for s in casts], "greedy_tokens_equal": same}
    print(f"\n{gib:.2f} GiB, {backend}: file {file_s:.3f}s, broadcast {cast_s:.3f}s (x{cast_s / file_s:.2f}), "
          f"of which hashing on the sender's side, alone: {hash_s:.3f}s ({bc.HASH_THREADS} threads); "
          f"greedy output after broadcast == after file: {same}")
    print(json.dumps(result))
    if not same:
        raise SystemExit("the broadcast weights generate differently from the same weights loaded from file")


if __name__ == "__main__":
    main()
