"""trainer.expert_parallel on two GPUs (NCCL all-to-all): the split experts' logits and gradients are the
whole model's, with each of transformers' experts implementations, compiled and with activation checkpointing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
