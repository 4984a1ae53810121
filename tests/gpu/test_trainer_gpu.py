"""The trainer on CUDA: packed varlen attention, compiled blocks across lengths, exports, kept versions
and the optimizer's state on the host (trainer.offload)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prl.trainer.attention import VARLEN, attn_implementation
from prl.trainer.model import PolicyModel

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


@pytest.mark.parametrize("kernel", ["torch", "fa4"])
def test_packed_varlen_equals_separate_sdpa_forwards_and_gradients(kernel):
    """trainer.attention's varlen kernels (PyTorch's own; FlashAttention 4 where flash-attn-4 is installed
    and the GPU is a Hopper or Blackwell) on packed samples: each sample as if it ran alone."""
    from prl.trainer.attention import _fa4_ready

    if kernel == "fa4" and (why_not := _fa4_ready(torch.device("cuda"))):
        pytest.skip(why_not)
    attn = attn_implementation(torch.device("cuda"), kernel)
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


def test_compiled_blocks_take_every_length_after_the_first_without_compiling_again():
    """The 1.5B block shape (hidden 1,536) compiled as the trainer compiles it: after its first length,
    lengths across Inductor's mix-order thresholds (3,072, 3,414 and 4,096 tokens there) compile nothing.
    In its strict mode, 3,071 and then 3,700 tokens each compiled a graph of their own
    (benchmarks/reports/compile-stall-fixes-warm-start_h200x2_2026-11-28.md)."""
    from torch._dynamo.utils import counters

    from prl.trainer.model import compile_layers

    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=512, max_position_embeddings=16384, use_cache=False)
    model = Qwen2ForCausalLM(config).cuda().bfloat16()
    compile_layers(model.model.layers)
    graphs = []
    for tokens in (12288, 6143, 4000, 3700, 3300, 3071, 1000):
        before = counters["stats"]["unique_graphs"]
        ids = torch.randint(0, 512, (1, tokens), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[0] > 0 and graphs[1:] == [0] * 6


@pytest.mark.parametrize("kernel", ["torch", "fa4"])
def test_compiled_packed_blocks_trace_the_varlen_kernel_in_one_graph_and_match_eager(kernel):
    """trainer.attention's kernels inside compiled, activation-checkpointed blocks, as the trainer runs
    them: no graph break around the kernel, no compile after the first length, and the eager model's
    logprobs and gradients."""
    from torch._dynamo.utils import counters

    from prl.trainer.attention import _fa4_ready
    from prl.trainer.model import compile_layers

    if kernel == "fa4" and (why_not := _fa4_ready(torch.device("cuda"))):
        pytest.skip(why_not)
    attn = attn_implementation(torch.device("cuda"), kernel)
    if attn != VARLEN:
        pytest.skip(f"this machine uses {attn}")
    eager, compiled = PolicyModel(tiny(attn)), PolicyModel(tiny(attn))
    compiled.causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_layers(compiled.causal_lm.model.layers)
    breaks, graphs = sum(counters["graph_break"].values()), []
    gen = torch.Generator().manual_seed(2)
    for lengths in ((300, 41, 700), (5, 512, 90, 33), (64,) * 9):
        ids = torch.randint(0, 512, (1, sum(lengths)), generator=gen).cuda()
        pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
        before = counters["stats"]["unique_graphs"]
        got = []
        for model in (compiled, eager):  # compiled first: its first trace must find FA4's ops registered
            model.zero_grad(set_to_none=True)
            logprobs, _ = model(ids, pos)
            (logprobs * (pos > 0)).sum().backward()
            got.append((logprobs, [p.grad for p in model.parameters()]))
        graphs.append(counters["stats"]["unique_graphs"] - before)
        torch.testing.assert_close(got[0][0], got[1][0], rtol=0, atol=0.05)
        for a, b in zip(got[1][1], got[0][1]):
            assert torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0) > 0.99
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[1:] == [0, 0]


def process_group() -> None:
    """A one-rank NCCL group, as the trainer has, for FSDP2 (once per test process)."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
        # gloo beside NCCL, as the trainer with trainer.offload has (host tensors' collectives)
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=torch.device("cuda", 0))


def test_export_through_pinned_staging_equals_plain_gather():
    from prl.config import TrainerConfig
    from prl.trainer.export import gather_state_dict
    from prl.trainer.model import parallelize
    from prl.trainer.staging import HostStaging

    process_group()
    model = parallelize(PolicyModel(tiny("sdpa").float()), TrainerConfig(flat_params=False), torch.bfloat16, torch.device("cuda"))
    plain = gather_state_dict(model, torch.bfloat16)
    staging, allocated = HostStaging(), []
    allocate = staging._allocate
    staging._allocate = lambda total, device=None: (allocated.append(total), allocate(total, device))[1]
    staging.pin_ahead({name: tensor.shape for name, tensor in plain.items()}, torch.bfloat16)  # as the trainer does
    for _ in range(2):  # the buffer pinned ahead, in its thread, serves both exports
        staged = gather_state_dict(model, torch.bfloat16, staging=staging)
        assert staged.keys() == plain.keys()
        for name in plain:
            assert staged[name].device.type == "cpu" and torch.equal(staged[name], plain[name]), name
    assert len(allocated) == 1 and staging.buffer.is_pinned()


@pytest.mark.parametrize("on_host", [False, True])
def test_a_kept_version_gives_its_own_logprobs_exactly_and_the_weights_come_back(on_host):
    """trainer.behaviour_logprobs=recompute in bf16 on the GPU: the logprobs computed under a kept
    version equal that version's own forward bit for bit, the model's fp32 weights are put back bit for
    bit, and with trainer.behaviour_on_host the versions sit in pinned host memory; a checkpoint's
    state of them (DTensors on the GPU) gives them back."""
    from prl.config import TrainerConfig
    from prl.trainer.behaviour import BehaviourPolicy, _local
    from prl.trainer.model import parallelize
    from prl.trainer.samples import synthetic_batch, to_device

    process_group()
    device = torch.device("cuda")
    model = parallelize(PolicyModel(tiny(attn_implementation(device)).float()), TrainerConfig(flat_params=False), torch.bfloat16,
                        device)  # FSDP's DTensors
    micro_batches = [to_device(mb, device) for mb in synthetic_batch(0, 1, 2, 3, 96, 512, seed=5).micro_batches[0]]
    policy = BehaviourPolicy(model, 1, torch.bfloat16, host=on_host)

    def forward() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])[0] for mb in micro_batches]

    version_0 = forward()
    assert policy.prepare(0, 0, micro_batches)  # the model's own version: the training forward serves
    kept = policy.versions[0]
    assert all(t.device.type == ("cpu" if on_host else "cuda") and t.is_pinned() == on_host for t in kept.values())
    # The sharded fp32 parameters (FSDP2 registers the gathered bf16 ones while a block is unsharded,
    # as every block still is after forward() on one rank), as the optimizer sees them.
    sharded = policy.params
    with torch.no_grad():  # "step 0's update"
        for p in sharded.values():
            _local(p).mul_(1.01)
    version_1 = {name: _local(p).clone() for name, p in sharded.items()}
    assert not policy.prepare(1, 0, micro_batches)  # batch 1, generated by version 0
    for mb, want in zip(micro_batches, version_0):
        assert torch.equal(mb["behaviour_logprobs"], want.masked_fill(~mb["loss_mask"], 0.0))
    assert all(torch.equal(_local(p), version_1[name]) for name, p in sharded.items())
    assert dict(model.named_parameters()).keys() == sharded.keys()
    assert all(p is sharded[name] for name, p in model.named_parameters())  # resharded: no stale gathered block
    assert not all(map(torch.equal, forward(), version_0))  # the model is version 1 again

    state = policy.state()  # version 1 only: batch 2 needs it
    assert list(state) == ["v1"] and all(t.device.type == "cuda" and hasattr(t, "to_local") for t in state["v1"].values())
    again = BehaviourPolicy(model, 1, torch.bfloat16, host=on_host)
    again.loaded_from(state)
    for name, t in again.versions[1].items():
        assert t.is_pinned() == on_host and torch.equal(t.to(device), version_1[name].bfloat16()), name


def test_offload_keeps_weights_gradients_and_adamw_in_pinned_host_memory_and_trains_alike():
    """trainer.offload on the GPU: the shards FSDP2 keeps (fp32 master weights), their gradients and
    AdamW's moments are pinned host tensors, the step's compute is on the GPU, and two steps give the
    losses of the trainer without offload (bf16 compute: to rounding)."""
    from prl.config import LossConfig, TrainerConfig
    from prl.trainer.loss import build_loss
    from prl.trainer.model import parallelize
    from prl.trainer.samples import synthetic_batch
    from prl.trainer.train import build_optimizer, train_step

    process_group()
    device = torch.device("cuda")
    batch = synthetic_batch(0, 1, 2, 3, 96, 512, seed=5)
    losses = {}
    for offload in (False, True):
        cfg = TrainerConfig(offload=offload, flat_params=False, lr=1e-3)  # FSDP either way
        model = parallelize(PolicyModel(tiny(attn_implementation(device)).float()), cfg, torch.bfloat16, device)
        optimizer, scheduler = build_optimizer(model, cfg, device)
        losses[offload] = [train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, device,
                                      build_loss(LossConfig()))["train/loss"] for _ in range(3)]
    shards = [p.to_local() for p in model.parameters()]
    moments = [t.to_local() for state in optimizer.state.values() for t in (state["exp_avg"], state["exp_avg_sq"])]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in shards)
    assert moments and all(t.device.type == "cpu" for t in moments)
    assert losses[True] == pytest.approx(losses[False], rel=2e-2, abs=1e-3)
    assert losses[True][2] != losses[True][0]  # the weights moved


def test_bf16_master_weights_compile_their_update_before_the_first_step_and_train_like_fp32():
    """trainer.master_dtype=bfloat16 on the GPU: the stochastic-rounding AdamW's compiled update is
    built by its warm() (the prewarm's), so the steps compile nothing; weights and moments stay bf16,
    and the losses follow the fp32 trainer's."""
    from torch._dynamo.utils import counters

    from prl.config import LossConfig, TrainerConfig
    from prl.trainer.loss import build_loss
    from prl.trainer.model import parallelize
    from prl.trainer.optim import StochasticAdamW
    from prl.trainer.samples import synthetic_batch
    from prl.trainer.train import build_optimizer, train_step

    process_group()
    device = torch.device("cuda")
    batch = synthetic_batch(0, 1, 2, 3, 96, 512, seed=5)
    losses = {}
    for master in ("float32", "bfloat16"):
        cfg = TrainerConfig(master_dtype=master, flat_params=False, lr=1e-3)  # FSDP either way
        causal_lm = tiny(attn_implementation(device)).to(getattr(torch, master))
        model = parallelize(PolicyModel(causal_lm), cfg, torch.bfloat16, device)
        optimizer, scheduler = build_optimizer(model, cfg, device)
        if master == "bfloat16":
            assert isinstance(optimizer, StochasticAdamW) and optimizer.compiled
            optimizer.warm()
            frames = counters["frames"]["total"]
        losses[master] = [train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, device,
                                     build_loss(LossConfig()))["train/loss"] for _ in range(3)]
    assert counters["frames"]["total"] == frames
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2, abs=1e-3)
    assert losses["bfloat16"][2] != losses["bfloat16"][0]


def test_offloaded_moments_stream_through_the_gpu_and_update_exactly_as_on_it(monkeypatch, tmp_path):
    """trainer.offload_optimizer on the GPU, bf16 and fp32 master weights: AdamW's moments in page-locked
    host memory, the update compiled by warm() and streamed through the GPU in chunks of 64 K elements
    (tensors of several chunks, both slots reused); 3 steps give the weights and moments of the same
    update with the moments on the GPU bit for bit, compile nothing, and a DCP checkpoint after step 2
    resumes to step 3's weights bit for bit, the moments back in the host arena."""
    from torch._dynamo.utils import counters

    from prl.config import LossConfig, TrainerConfig
    from prl.run.rundir import RunDir
    from prl.trainer import optim
    from prl.trainer.ckpt import load_checkpoint, save_checkpoint
    from prl.trainer.loss import build_loss
    from prl.trainer.model import parallelize
    from prl.trainer.samples import synthetic_batch
    from prl.trainer.train import build_optimizer, train_step

    monkeypatch.setitem(optim.CHUNK, True, 1 << 16)
    process_group()
    device = torch.device("cuda")
    batches = [synthetic_batch(step, 1, 2, 3, 96, 512, seed=5).micro_batches[0] for step in range(3)]

    def built(master: str, on_host: bool):
        cfg = TrainerConfig(master_dtype=master, offload_optimizer=on_host, flat_params=False, lr=1e-3)  # FSDP either way
        causal_lm = tiny(attn_implementation(device)).to(getattr(torch, master))
        model = parallelize(PolicyModel(causal_lm), cfg, torch.bfloat16, device)
        if on_host:
            optimizer, scheduler = build_optimizer(model, cfg, device)
        else:  # the same update, its moments on the GPU (fp32's default would be torch's fused AdamW)
            optimizer = optim.StochasticAdamW(list(model.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                              compiled=True)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        optimizer.warm()
        return cfg, model, optimizer, scheduler

    for master in ("bfloat16", "float32"):
        runs = {}
        for on_host in (False, True):
            cfg, model, optimizer, scheduler = built(master, on_host)
            frames = counters["frames"]["total"]
            losses = []
            for step, batch in enumerate(batches):
                losses.append(train_step(model, optimizer, scheduler, batch, cfg, device, build_loss(LossConfig()))["train/loss"])
                if step == 1 and on_host:
                    rd = RunDir(tmp_path / master)
                    save_checkpoint(rd, 2, model=model, optimizer=optimizer, scheduler=scheduler, keep_last=1)
            assert counters["frames"]["total"] == frames, (master, on_host)
            runs[on_host] = losses, model, optimizer
        (plain_losses, plain, plain_opt), (losses, model, optimizer) = runs[False], runs[True]
        assert losses == plain_losses and losses[2] != losses[0], master
        moments = [state[key].to_local() for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
        assert moments and all(t.device.type == "cpu" and t.is_pinned() for t in moments), master
        for (a, b), (sa, sb) in zip(zip(plain.parameters(), model.parameters()),
                                    zip(plain_opt.state.values(), optimizer.state.values())):
            assert torch.equal(a.to_local(), b.to_local()), master
            assert all(torch.equal(sa[k].to_local().cpu(), sb[k].to_local()) for k in ("exp_avg", "exp_avg_sq")), master

        cfg, resumed, resumed_opt, resumed_sched = built(master, True)
        assert load_checkpoint(RunDir(tmp_path / master), 2, resumed, resumed_opt, resumed_sched) == 2
        assert all(state[k].to_local().data_ptr() == resumed_opt._arena[p][k].data_ptr()
                   for p, state in resumed_opt.state.items() for k in ("exp_avg", "exp_avg_sq"))
        assert train_step(resumed, resumed_opt, resumed_sched, batches[2], cfg, device,
                          build_loss(LossConfig()))["train/loss"] == losses[2]
        for a, b in zip(model.parameters(), resumed.parameters()):
            assert torch.equal(a.to_local(), b.to_local()), master


def test_flat_params_train_as_fsdp_on_one_gpu_with_compiled_blocks():
    """trainer.flat_params on the GPU, blocks compiled: the module's parameters are bf16 views of one flat
    tensor cast from the fp32 master weights, fused AdamW updates that one tensor, the steps after the first
    compile nothing more, and the losses are the FSDP trainer's."""
    from torch._dynamo.utils import counters

    from prl.config import LossConfig, TrainerConfig
    from prl.trainer.loss import build_loss
    from prl.trainer.model import parallelize
    from prl.trainer.samples import synthetic_batch
    from prl.trainer.train import build_optimizer, train_step

    process_group()
    device = torch.device("cuda")
    batch = synthetic_batch(0, 1, 2, 3, 96, 512, seed=5)
    losses, frames = {}, []
    for flat in (False, True):
        cfg = TrainerConfig(flat_params=flat, compile=True, lr=1e-3)
        model = parallelize(PolicyModel(tiny(attn_implementation(device)).float()), cfg, torch.bfloat16, device)
        optimizer, scheduler = build_optimizer(model, cfg, device)
        losses[flat] = []
        for _ in range(3):
            losses[flat].append(train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, device,
                                           build_loss(LossConfig()))["train/loss"])
            frames.append(counters["frames"]["total"])
    assert frames[4] == frames[5]  # the flat model's third step compiled nothing
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.flat.master.dtype == torch.float32
    assert all(p.untyped_storage().data_ptr() == model.flat.compute.untyped_storage().data_ptr()
               for p in model.parameters())
    assert optimizer.defaults["fused"] and optimizer.param_groups[0]["params"] == [model.flat.master]
    assert losses[True] == pytest.approx(losses[False], rel=1e-2, abs=1e-3)
    assert losses[True][2] != losses[True][0]  # the weights moved
