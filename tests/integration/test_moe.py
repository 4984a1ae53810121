"""A mixture-of-experts policy through the whole loop on CPU (`prl submit --local`): the tiny Qwen3-MoE
(tools/make_tiny_model.py --family qwen3_moe, tests/conftest.py's tiny_moe_model), weights by
broadcast, checkpoints, an exact resume, the servers' greedy output on an exported version against
transformers', `prl eval` of a version. One run, shared by the assertions (docs/moe.md).

    pytest tests/integration/test_moe.py
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import metrics, prl

from prl.run.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOY = Path(__file__).resolve().parents[2] / "configs/toy.yaml"
STEPS = 6


def prl_local(base: Path, model: Path, *overrides: str) -> tuple[int, str]:
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(TOY), "--local", f"run.output_dir={base}",
            f"model.name={model}", f"inference.port={free_port()}", f"run.max_steps={STEPS}",
            "trainer.checkpoint.interval=3", "orchestrator.eval.interval=0", *overrides]
    proc = subprocess.run(args, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, tiny_moe_model) -> Path:
    """Six steps by broadcast (gloo), checkpoints at 3 and 6, the load-balancing loss on."""
    base = tmp_path_factory.mktemp("moe")
    rc, out = prl_local(base, tiny_moe_model, "inference.weight_transfer=broadcast", "trainer.router_aux_loss_coef=0.01")
    assert rc == 0, out
    return base / "toy"


def test_moe_run_updates_weights_by_broadcast_and_reports_routing(moe_run):
    steps = metrics(moe_run, 0)
    assert [m["step"] for m in steps] == list(range(STEPS))
    assert all(math.isfinite(m["train/loss"]) and 0 <= m["rollout/reward_mean"] <= 1 for m in steps)
    log = (moe_run / "logs/attempt_0/orchestrator/rank_0.log").read_text()
    loads = re.findall(r"servers now at policy version (\d+) by (\w+)", log)
    # async_level 1: batch b needs version b - 1; every one after version 0 came by broadcast.
    assert [int(v) for v, how in loads if how == "broadcast"] == list(range(1, STEPS - 1)), loads
    served = (moe_run / "logs/attempt_0/inference/rank_0.log").read_text()
    assert "refused" not in served
    for m in steps:  # 2 layers of 8 experts, top-2: the worst expert's load is between 1 and 8 / 2
        for layer in (0, 1):
            assert 1 <= m[f"routing/load_max_over_mean/layer_{layer}"] <= 4
            assert 0 < m[f"routing/entropy/layer_{layer}"] <= math.log(8) + 1e-6
        assert m["train/router_aux_loss"] > 0
    status = prl("status", str(moe_run))
    assert "routing" in status.stdout, status.stdout


def test_moe_versions_are_in_the_checkpoint_layout_and_served_as_transformers_runs_them(
        moe_run, tiny_moe_model, start_inference_server, tmp_path):
    """weights/step_6 holds the experts one matrix each, under the served checkpoint's names; a server
    started from the base and updated to it generates greedily what transformers does from it."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    version = moe_run / f"weights/step_{STEPS}"
    names = lambda d: set(safe_open(str(d / "model.safetensors"), "pt").keys())
    assert names(version) == names(tiny_moe_model)
    config = tmp_path / "inference.yaml"
    config.write_text(
        f"run: {{name: moe-server, output_dir: {tmp_path}/out}}\n"
        f"model: {{name: {tiny_moe_model}, dtype: float32, max_model_len: 512}}\n"
        f"inference: {{gpus_per_node: 0, enforce_eager: true, weights_root: {moe_run},\n"
        "            env: {VLLM_CPU_KVCACHE_SPACE: '1'}}\n"
        "orchestrator: {environment: {id: prl.envs.toy}}\n")
    server = start_inference_server(config)
    tokenizer = AutoTokenizer.from_pretrained(version)
    hf = AutoModelForCausalLM.from_pretrained(version, dtype=torch.float32).eval()
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        response = http.post("/update_weights", json={"path": str(version)})
        assert response.status_code == 200, response.text
        for prompt in ("What is 12 + 35?", "The quick brown fox"):
            body = {"model": str(tiny_moe_model), "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            got = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
            ids = tokenizer(prompt)["input_ids"]
            with torch.no_grad():
                want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)[0, len(ids):].tolist()
            assert got == want, prompt
    server.stop()


def test_moe_resume_from_step_3_repeats_the_losses(moe_run):
    """Rewound to checkpoint 3 (as `prl resume --step 3` does) and continued: steps 3..5 again, with
    the losses of the first attempt (CPU, fp32, deterministic)."""
    from prl.run import rewind
    from prl.run.rundir import RunDir

    first = {m["step"]: m["train/loss"] for m in metrics(moe_run, 0)}
    rewind.rewind(RunDir(moe_run), 3)
    rc, out = prl_local(moe_run.parent, Path(_model_of(moe_run)), "inference.weight_transfer=broadcast",
                        "trainer.router_aux_loss_coef=0.01", "--resume")
    assert rc == 0, out
    again = {m["step"]: m["train/loss"] for m in metrics(moe_run, 1)}
    assert sorted(again) == [3, 4, 5]
    assert again == pytest.approx({s: first[s] for s in again}, rel=1e-5, abs=1e-7)


def _model_of(run: Path) -> str:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["model"]["name"]


def test_prl_eval_of_an_moe_version(moe_run):
    r = prl("eval", str(moe_run), "--steps", "3", "--local", cwd=moe_run, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((moe_run / "evals/step_3.json").read_text())
    assert record["weights"] == str(moe_run / "weights/step_3") and record["rollouts"] > 0
