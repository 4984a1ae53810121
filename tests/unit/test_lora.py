"""Low-rank adapters (trainer.lora): each policy version is written as peft's adapter files; what
serves a version is the base model with it folded in (prl.run.lora), on the training servers and in
`prl eval` alike. The trainer under torchrun and the vLLM server with adapters:
tests/integration/test_lora_run.py.

    pytest tests/unit/test_lora.py
"""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import LORA, base_state, trained_adapters
from safetensors.torch import load_file

from prl.run import lora
from prl.trainer.export import Adapter


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



def test_an_moe_gets_adapters_on_its_attention_only(tiny_moe_model):
    """The default targets on the tiny Qwen3-MoE: q/k/v/o_proj of each layer; the fused experts (which
    peft would wrap, given `down_proj` as a bare name) and the router stay frozen."""
    from transformers import AutoModelForCausalLM

    from prl.config import LoraConfig
    from prl.trainer.model import add_adapters

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32)
    add_adapters(model, LoraConfig(rank=4))
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all(lora.is_adapter(name) for name in trained)
    assert {name.split(".")[-4] for name in trained} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(trained) == 2 * 4 * 2  # A and B, 4 modules, 2 layers
    with pytest.raises(ValueError, match="trainer.lora.target_modules: no linear layer named up_proj"):
        add_adapters(AutoModelForCausalLM.from_pretrained(tiny_moe_model), LoraConfig(rank=4, target_modules=["up_proj"]))
