"""Low-rank adapters (trainer.lora) for real: the trainer under torchrun (two gloo ranks) trains them
alone and resumes exactly; the CPU vLLM server serves an adapter version as the base with it folded
in. The adapter files against peft are tests/unit/test_lora.py.

    pytest tests/integration/test_lora_run.py
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from inference_helpers import API_KEY
from safetensors.torch import load_file, save_file
from lora_helpers import LORA, base_state, trained_adapters
from test_trainer_run import STEPS, finish, make_run, metrics, start, wait_for, write_batches

from prl.config import load_config, to_yaml
from prl.run import lora
from prl.run.protocol import STOP_REQUEST
from prl.run.rundir import RunDir, mark_complete
from prl.trainer.ckpt import check_adapters
from prl.trainer.export import Adapter, write_weights


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

    # The same run resumed with other adapters: refused naming the key, before anything loads; and
    # with none (the same check, in this process: a launch of its own costs CI a minute of CPU).
    config = load_config(whole / "config.yaml", ["trainer.lora.rank=8"])
    (whole / "config.yaml").write_text(to_yaml(config))
    rc, out = finish(start(whole, 2, attempt=2))
    said = "trained with rank 4 (0: no adapters), this run has rank 8: resume with trainer.lora.rank=4"
    assert rc != 0 and f"ValueError: trainer.lora.rank: step_4 was {said}" in out, out
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match=r"trainer.lora.rank: step_4 was trained with rank 4 \(0: no adapters\), this run has rank 0"):
        check_adapters(whole / f"checkpoints/step_{STEPS}/trainer", AutoModelForCausalLM.from_pretrained(tiny_model))


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
