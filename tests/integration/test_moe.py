"""A mixture-of-experts policy through the whole loop on CPU (`prl submit --local`): the tiny Qwen3-MoE
(tools/make_tiny_model.py --family qwen3_moe, tests/conftest.py's tiny_moe_model), weights by
broadcast, checkpoints, an exact resume, the servers' greedy output on an exported version against
transformers'; an SFT job's version and a LoRA run's adapter version served
by the same server; versions of the tiny Mixtral and Qwen2-MoE (a shared expert beside the routed ones)
exported by the trainer's code, served the same way.
Each run is shared by the assertions on it (docs/moe.md).

    pytest tests/integration/test_moe.py
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import NO_WANDB, metrics, prl

from prl.run.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOY = CONFIGS / "toy.yaml"
STEPS = 6
PROMPTS = ("What is 12 + 35?", "The quick brown fox")


MOE_RUN_LOSS = ("trainer.router_aux_loss_coef=0.01", "trainer.loss.ratio_mask_low=0.5", "trainer.loss.ratio_mask_high=2")


def prl_local(base: Path, model: Path, *overrides: str, config: Path = TOY) -> tuple[int, str]:
    args = [sys.executable, "-m", "prl.control.cli", "submit", str(config), "--local", f"run.output_dir={base}",
            f"model.name={model}", f"run.max_steps={STEPS}", "trainer.checkpoint.interval=3", NO_WANDB, *overrides]
    if config == TOY:
        args += [f"inference.port={free_port()}", "orchestrator.eval.interval=0"]
    proc = subprocess.run(args, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, tiny_moe_model) -> Path:
    """Six steps by broadcast (gloo), checkpoints at 3 and 6, the load-balancing loss on, tokens whose
    importance ratio leaves [0.5, 2] masked out of the policy gradient."""
    base = tmp_path_factory.mktemp("moe")
    rc, out = prl_local(base, tiny_moe_model, "inference.weight_transfer=broadcast", *MOE_RUN_LOSS)
    assert rc == 0, out
    return base / "toy"


@pytest.fixture(scope="module")
def moe_sft_version(tmp_path_factory, tiny_moe_model) -> Path:
    """configs/sft_toy.yaml on the tiny Qwen3-MoE: 2 steps, its last version."""
    base = tmp_path_factory.mktemp("moe_sft")
    rc, out = prl_local(base, tiny_moe_model, "run.max_steps=2", "trainer.checkpoint.interval=2",
                        f"sft.data={CONFIGS.parent / 'prl/envs/data/sft_toy.jsonl'}", config=CONFIGS / "sft_toy.yaml")
    assert rc == 0, out
    return base / "sft-toy/weights/step_2"


@pytest.fixture(scope="module")
def moe_lora_run(tmp_path_factory, tiny_moe_model) -> Path:
    """2 RL steps with adapters of rank 8 (trainer.lora's default targets), weights by file."""
    base = tmp_path_factory.mktemp("moe_lora")
    rc, out = prl_local(base, tiny_moe_model, "run.max_steps=2", "trainer.lora.rank=8", "trainer.lr=1e-2")
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
    # The ratio band: at step 0 the trainer holds the version that sampled (fp32 on CPU: the engines
    # agree to rounding, nothing to mask); from step 1 the policy has moved one step past the batch's.
    masked = [m["train/ratio_masked_fraction"] for m in steps]
    assert masked[0] == 0 and max(masked) > 0 and all(0 <= f < 0.2 for f in masked), masked
    status = prl("status", str(moe_run))
    assert "routing" in status.stdout, status.stdout


def test_moe_versions_are_in_the_checkpoint_layout_and_served_as_transformers_runs_them(
        moe_run, moe_sft_version, moe_lora_run, tiny_moe_model, start_inference_server, tmp_path):
    """An RL version (weights/step_6), an SFT job's version and a LoRA run's adapter version: the full
    ones hold the experts one matrix each, under the served checkpoint's names; the adapters sit on
    the attention only (an MoE layer's experts and router are not linear layers: frozen). One server
    started from the base and updated to each generates greedily what transformers does from it
    (the adapter version folded into the base by prl.run.lora, as the servers fold it)."""
    from safetensors.torch import load_file, save_file

    from prl.run import lora

    names = lambda d: set(load_file(d / "model.safetensors"))
    for version in (moe_run / f"weights/step_{STEPS}", moe_sft_version):
        assert names(version) == names(tiny_moe_model), version
    adapter_dir = moe_lora_run / "weights/step_2"
    adapters = load_file(adapter_dir / lora.ADAPTER_FILE)
    adapted = {name.split(".")[-2] for name in lora.pairs(adapters)}  # module name ...q_proj.weight -> q_proj
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}, adapted
    targets = json.loads((adapter_dir / lora.ADAPTER_CONFIG).read_text())["target_modules"]
    assert sorted(targets) == sorted(name.removesuffix(".weight") for name in lora.pairs(adapters)), targets
    assert len(lora.pairs(adapters)) == 2 * 4 and all(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_B." in n)
    folded = tmp_path / "folded"
    shutil.copytree(tiny_moe_model, folded)
    save_file(dict(lora.merged_weights(load_file(tiny_moe_model / "model.safetensors").items(), adapters,
                                       lora.scale_of(adapter_dir))), folded / "model.safetensors")
    trained = metrics(moe_lora_run, 0)
    assert [m["step"] for m in trained] == [0, 1]
    roots = os.path.commonpath([moe_run, moe_sft_version, adapter_dir])
    server = start_inference_server(served_config(tiny_moe_model, tmp_path, Path(roots)))
    for version in (moe_run / f"weights/step_{STEPS}", moe_sft_version, adapter_dir):
        assert_served_as_transformers(server, tiny_moe_model, version, folded if version == adapter_dir else None)
    server.stop()


@pytest.mark.parametrize("family,expert_name", [("mixtral", ".block_sparse_moe.experts.7.w2."),
                                               ("qwen2_moe", ".mlp.shared_expert_gate.")])
def test_another_familys_version_exported_by_the_trainer_is_served_as_transformers_runs_it(
        start_inference_server, tmp_path, family, expert_name):
    """The other families, cheaply: no run (one of 3 steps by broadcast takes 90 s here; docs/moe.md),
    but the trainer's export of changed weights (checkpoint_layout: the fused experts split again, and for
    Mixtral `mlp` named `block_sparse_moe` again; Qwen2-MoE's shared expert and its gate beside them;
    write_weights) loaded by a server started from the base and generating greedily what transformers
    does from the version."""
    import torch
    from transformers import AutoModelForCausalLM

    from prl.run.rundir import RunDir
    from prl.trainer.export import checkpoint_layout, write_weights

    model = tmp_path / f"tiny-{family}"
    subprocess.run([sys.executable, str(CONFIGS.parent / "tools/make_tiny_model.py"), "--family", family,
                    "--out", str(model)], check=True)
    trained = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in trained.parameters():  # as after some steps: every expert and the router changed
            param.add_(0.02 * torch.randn_like(param))
    state = checkpoint_layout(trained, {k: v.detach().clone() for k, v in trained.state_dict().items()})
    assert any(expert_name in name for name in state) and any(".experts.7." in name for name in state), sorted(state)[:8]
    version = write_weights(state, model, RunDir(tmp_path / "run"), 1)
    server = start_inference_server(served_config(model, tmp_path, tmp_path / "run"))
    assert_served_as_transformers(server, model, version)
    server.stop()


def served_config(model: Path, tmp_path: Path, weights_root: Path) -> Path:
    config = tmp_path / "inference.yaml"
    config.write_text(
        f"run: {{name: moe-server, output_dir: {tmp_path}/out}}\n"
        f"model: {{name: {model}, dtype: float32, max_model_len: 512}}\n"
        f"inference: {{gpus_per_node: 0, enforce_eager: true, weights_root: {weights_root},\n"
        "            env: {VLLM_CPU_KVCACHE_SPACE: '1'}}\n"
        "orchestrator: {environment: {id: prl.envs.toy}}\n")
    return config


def assert_served_as_transformers(server, model: Path, version: Path, full: Path | None = None) -> None:
    """The server updated to `version` generates greedily what transformers does from its weights
    (from `full` where the version is not a full model: the base with the adapters folded in)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(full or version, dtype=torch.float32).eval()
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        response = http.post("/update_weights", json={"path": str(version)})
        assert response.status_code == 200, response.text
        for prompt in PROMPTS:
            body = {"model": str(model), "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            got = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
            ids = tokenizer(prompt)["input_ids"]
            with torch.no_grad():
                want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)[0, len(ids):].tolist()
            assert got == want, (version, prompt)


def test_moe_resume_from_step_3_repeats_the_losses(moe_run):
    """Rewound to checkpoint 3 (as `prl resume --step 3` does) and continued: steps 3..5 again, with
    the losses of the first attempt (CPU, fp32, deterministic)."""
    from prl.run import rewind
    from prl.run.rundir import RunDir

    first = {m["step"]: m["train/loss"] for m in metrics(moe_run, 0)}
    rewind.rewind(RunDir(moe_run), 3)
    rc, out = prl_local(moe_run.parent, Path(_model_of(moe_run)), "inference.weight_transfer=broadcast",
                        *MOE_RUN_LOSS, "--resume")
    assert rc == 0, out
    again = {m["step"]: m["train/loss"] for m in metrics(moe_run, 1)}
    assert sorted(again) == [3, 4, 5]
    assert again == pytest.approx({s: first[s] for s in again}, rel=1e-5, abs=1e-7)


def _model_of(run: Path) -> str:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["model"]["name"]
