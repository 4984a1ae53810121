"""The CUDA attention path: packed samples through PyTorch's varlen kernel equal separate forwards."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prl.trainer.model import VARLEN, PolicyModel, attn_implementation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def tiny(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=512, max_position_embeddings=1024, use_cache=False, attn_implementation=attn,
    )
    return Qwen2ForCausalLM(config).cuda().bfloat16()


def test_packed_varlen_equals_separate_sdpa_forwards_and_gradients():
    attn = attn_implementation(torch.device("cuda"))
    if attn != VARLEN:
        pytest.skip(f"this machine uses {attn}")
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 512, (n,), generator=gen).cuda() for n in (37, 200, 5, 91)]
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None].cuda()
    packed_model, separate_model = PolicyModel(tiny(attn)), PolicyModel(tiny("sdpa"))

    packed, _ = packed_model(ids, pos)
    (packed * (pos > 0)).sum().backward()
    separate = [separate_model(s[None], torch.arange(len(s), device="cuda")[None])[0] for s in samples]
    sum(x.sum() for x in separate).backward()

    start = 0
    for s, alone in zip(samples, separate):
        torch.testing.assert_close(packed[0, start + 1 : start + len(s)], alone[0, 1:], rtol=0, atol=0.05)
        start += len(s)
    for a, b in zip(packed_model.parameters(), separate_model.parameters()):
        assert torch.nn.functional.cosine_similarity(a.grad.flatten().float(), b.grad.flatten().float(), dim=0) > 0.999


def test_export_through_pinned_staging_equals_plain_gather():
    import os

    import torch.distributed as dist

    from prl.trainer.model import parallelize
    from prl.config import TrainerConfig
    from prl.trainer.weights import HostStaging, gather_state_dict

    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    model = parallelize(PolicyModel(tiny("sdpa").float()), TrainerConfig(), torch.bfloat16, torch.device("cuda"))
    plain = gather_state_dict(model, torch.bfloat16)
    staging = HostStaging()
    for _ in range(2):  # the second export reuses the buffer
        staged = gather_state_dict(model, torch.bfloat16, staging=staging)
        assert staged.keys() == plain.keys()
        for name in plain:
            assert staged[name].device.type == "cpu" and torch.equal(staged[name], plain[name]), name
