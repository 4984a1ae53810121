"""Low-rank adapters (trainer.lora): the trainer trains them alone, over a frozen base, and writes each
policy version as peft's adapter files; what serves a version is the base model with it folded in
(prl.run.lora), on the training servers and in `prl eval` alike.

    pytest tests/test_lora.py                # the files against peft, the trainer under torchrun (gloo)
    pytest -m vllm tests/test_lora.py        # the CPU vLLM server loads adapter versions
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from inference_helpers import API_KEY
from safetensors.torch import load_file, save_file
from test_trainer_run import STEPS, finish, make_run, metrics, start, wait_for, write_batches

from prl.config import LoraConfig, load_config, to_yaml
from prl.run import lora
from prl.run.protocol import STOP_REQUEST
from prl.run.rundir import RunDir, mark_complete
from prl.trainer.export import Adapter, write_weights
from prl.trainer.model import add_adapters

LORA = LoraConfig(rank=4, alpha=8.0)


def trained_adapters(tiny_model: Path, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model with adapters whose B is not zero (as after some training), and those
    adapters under peft's file names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(seed)
    add_adapters(model, LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    return model, {Adapter.file_name(n): t.detach().clone() for n, t in model.state_dict().items() if lora.is_adapter(n)}


def base_state(tiny_model: Path) -> dict[str, torch.Tensor]:
    return load_file(tiny_model / "model.safetensors")


def test_an_adapter_version_is_what_peft_loads_and_folded_it_is_the_same_model(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, adapters = trained_adapters(tiny_model, seed=1)
    Adapter(LORA, str(tiny_model)).write(adapters, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lora.ADAPTER_CONFIG, lora.ADAPTER_FILE]
    config = json.loads((tmp_path / lora.ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(tiny_model))
    assert lora.is_adapter_version(tmp_path) and lora.scale_of(tmp_path) == 2.0

    ids = torch.randint(0, 700, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        assert not torch.allclose(base(ids).logits, want, atol=1e-4)  # the adapters change the model
        by_peft = PeftModel.from_pretrained(base, tmp_path)(ids).logits
        torch.testing.assert_close(by_peft, want, rtol=1e-5, atol=1e-5)
        folded = dict(lora.merged_weights(base_state(tiny_model).items(), load_file(tmp_path / lora.ADAPTER_FILE), 2.0))
        plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(folded, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
        torch.testing.assert_close(plain(ids).logits, want, rtol=1e-5, atol=1e-5)
        # An SFT job's export folds the adapted model's own state (peft's in-memory names) the same way.
        # (gather_state_dict leaves the tied head out: it is the embedding)
        state = {n: t.detach() for n, t in model.state_dict().items() if n != "lm_head.weight"}
        sft = Adapter(LORA, str(tiny_model), folded=True).fold(state)
        assert sft.keys() == folded.keys() and all(torch.equal(sft[k], folded[k]) for k in folded)


def test_adapters_that_do_not_fit_the_base_are_refused_naming_them(tiny_model):
    _, adapters = trained_adapters(tiny_model, seed=2)
    a_name = next(n for n in adapters if ".lora_A." in n)
    with pytest.raises(ValueError, match="without their A or B"):
        lora.pairs({n: t for n, t in adapters.items() if n != a_name})
    stray = {n.replace("layers.0.", "layers.99."): t for n, t in adapters.items()}
    with pytest.raises(ValueError, match="layers.99"):
        list(lora.merged_weights(base_state(tiny_model).items(), stray, 2.0))
    with pytest.raises(ValueError, match="do not fit"):
        lora.merge(torch.zeros(8, 8), torch.zeros(4, 9), torch.zeros(8, 4), 1.0)
    with pytest.raises(ValueError, match="not a LoRA matrix"):
        lora.adapted_module("model.layers.0.self_attn.q_proj.weight")


def test_a_lora_run_trains_the_adapters_alone_and_resumes_exactly(tiny_model, tmp_path_factory):
    """Two ranks (FSDP2 over gloo) with adapters on every linear layer: versions are adapter files
    that fit the base; checkpoints hold the adapters and their optimizer state, not the frozen base;
    a run stopped at its step-2 checkpoint and resumed ends with the uninterrupted run's losses and
    adapters, bit for bit."""
    whole = make_run(tmp_path_factory.mktemp("lora_whole"), tiny_model, 2, range(STEPS), lora=LORA)
    rc, out = finish(start(whole, 2, attempt=1))
    assert rc == 0, out
    for step in range(1, STEPS + 1):
        version = whole / f"weights/step_{step}"
        assert sorted(p.name for p in version.iterdir()) == ["COMPLETE", lora.ADAPTER_CONFIG, lora.ADAPTER_FILE]
    final = load_file(whole / f"weights/step_{STEPS}" / lora.ADAPTER_FILE)
    assert len(final) == 2 * 7 * 2  # A and B of 7 linear layers in each of the tiny model's 2 blocks
    assert all(t.abs().sum() > 0 for n, t in final.items() if ".lora_B." in n)  # trained away from zero
    lora.pairs(final)  # every module has both matrices
    folded = dict(lora.merged_weights(base_state(tiny_model).items(), final, LORA.scale))
    assert folded.keys() == base_state(tiny_model).keys()

    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(whole / "checkpoints/step_2/trainer").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2 and all(lora.is_adapter(k) for k in model_keys), model_keys  # no tied head

    stopped = make_run(tmp_path_factory.mktemp("lora_stopped"), tiny_model, 2, range(2), lora=LORA)
    proc = start(stopped, 2, attempt=1)
    wait_for(proc, stopped / "checkpoints/step_2/COMPLETE")  # then it waits for batch 2, which never comes
    (stopped / "logs/attempt_1" / STOP_REQUEST).write_text("USR1 at 2026-01-01T00:00:00\n")
    rc, out = finish(proc)
    assert rc != 0 and (stopped / "logs/attempt_1/preempted").exists(), out
    write_batches(stopped, 2, range(2, STEPS))
    rc, out = finish(start(stopped, 2, attempt=2))
    assert rc == 0, out
    assert [m["step"] for m in metrics(stopped, 2)] == [2, 3]
    for got, want in zip(metrics(stopped, 1) + metrics(stopped, 2), metrics(whole, 1), strict=True):
        for key in ("train/loss", "train/grad_norm", "train/mismatch_kl"):
            assert got[key] == want[key], (got["step"], key)
    resumed = load_file(stopped / f"weights/step_{STEPS}" / lora.ADAPTER_FILE)
    assert resumed.keys() == final.keys() and all(torch.equal(resumed[k], final[k]) for k in final)

    # The same run resumed with other adapters, or none: refused naming the key, before anything loads.
    for rank, said in ((8, "trained with rank 4 (0: no adapters), this run has rank 8: resume with trainer.lora.rank=4"),
                       (0, "trained with rank 4 (0: no adapters), this run has rank 0")):
        config = load_config(whole / "config.yaml", [f"trainer.lora.rank={rank}"])
        (whole / "config.yaml").write_text(to_yaml(config))
        rc, out = finish(start(whole, 2, attempt=2))
        assert rc != 0 and f"ValueError: trainer.lora.rank: step_4 was {said}" in out, out


@pytest.mark.vllm
def test_the_server_serves_an_adapter_version_as_the_base_with_it_folded_in(vllm_server, tiny_model, tmp_path):
    """POST /update_weights with an adapter version: the server generates what it generates from
    the same model written out in full; adapters that do not fit are refused before the engine."""
    _, adapters = trained_adapters(tiny_model, seed=3)
    version = tmp_path / "weights/step_1"
    version.mkdir(parents=True)
    Adapter(LORA, str(tiny_model)).write(adapters, version)
    mark_complete(version)
    full = write_weights(dict(lora.merged_weights(base_state(tiny_model).items(), adapters, LORA.scale)), tiny_model,
                         RunDir(tmp_path / "full"), 1)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"token_ids": list(range(5, 40)), "sampling_params": {"temperature": 0.0, "max_tokens": 16}}
    outputs = []
    with httpx.Client(base_url=vllm_server.url, headers=headers, timeout=120) as http:
        for path in (version, full):
            r = http.post("/update_weights", json={"path": str(path)})
            assert r.status_code == 200, r.text
            r = http.post("/prl/generate", json=body)
            assert r.status_code == 200, r.text
            outputs.append(r.json())
        assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
        assert outputs[0]["logprobs"] == pytest.approx(outputs[1]["logprobs"], abs=1e-4)
        bad = tmp_path / "weights/step_2"
        shutil.copytree(version, bad)
        save_file({n: t for n, t in adapters.items() if ".lora_B." not in n}, bad / lora.ADAPTER_FILE)
        r = http.post("/update_weights", json={"path": str(bad)})
        assert r.status_code == 400 and "not an adapter version" in r.json()["error"], r.text

