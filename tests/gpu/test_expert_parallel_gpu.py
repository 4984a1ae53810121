"""Expert parallelism on two GPUs. The trainer's (NCCL all-to-all): the split experts' logits and gradients
are the whole model's, with each of transformers' experts implementations, compiled and with activation
checkpointing. vLLM's (inference.expert_parallel, one server of two engines): a weight update reaches every
expert of both engines, so greedy tokens after it are transformers' from the new weights."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from inference_helpers import hf_greedy, perturbed_model, served_greedy

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.mark.parametrize("implementation,mode", [("grouped_mm", ""), ("eager", ""), ("grouped_mm", "compile"),
                                                 ("grouped_mm", "ac")])
def test_split_experts_compute_what_the_whole_model_does(tiny_moe_model, implementation, mode):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(ROOT / "tests/gpu/expert_parallel_check.py"), str(tiny_moe_model), implementation, mode],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = re.findall(r"rank (\d): logits ([0-9.e+-]+) expert grads ([0-9.e+-]+)", r.stdout)
    assert r.returncode == 0 and len(said) == 2, r.stdout + r.stderr
    for _, logits, grads in said:
        assert float(logits) < 1e-3 and float(grads) < 1e-3, said  # fp32 on the GPU: TF32 off by default


@pytest.mark.vllm
def test_a_weight_update_reaches_every_expert_of_both_engines(tiny_moe_model, start_inference_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, perturbed = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval(), \
        perturbed_model(tiny_moe_model)
    version = tmp_path / "weights/step_1"
    perturbed.save_pretrained(version)  # the checkpoint's layout: one matrix per expert
    config = tmp_path / "inference.yaml"
    config.write_text(f"run: {{name: gpu-ep, output_dir: {tmp_path}/out}}\n"
                      f"model: {{name: {tiny_moe_model}, dtype: float32, max_model_len: 512}}\n"
                      "inference: {gpus_per_node: 2, expert_parallel: true, gpu_memory_utilization: 0.3, "
                      "extra_args: [--kv-cache-memory-bytes, '2147483648']}\n"
                      "orchestrator: {environment: {id: prl.envs.toy}}\n")
    server = start_inference_server(config, [f"inference.weights_root={version.parent}"])
    prompts = ["What is 12 + 35?", "Reverse: the cat sees a red ball", "The quick brown fox", "Sort: b a c"]
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:

        def greedy(prompt: str) -> list[int]:
            return served_greedy(http, str(tiny_moe_model), prompt)

        with ThreadPoolExecutor(8) as pool:  # at once: vLLM balances them over both engines
            before = list(pool.map(greedy, prompts * 2))
            response = http.post("/update_weights", json={"path": str(version)})
            assert response.status_code == 200, response.text
            after = list(pool.map(greedy, prompts * 2))
    server.stop()
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_model)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts * 2]
    assert before == [hf_greedy(original.cuda(), ids) for ids in prompt_ids]
    assert after == [hf_greedy(perturbed.cuda(), ids) for ids in prompt_ids] and after != before
