"""Full fine-tuning in less memory: trainer.master_dtype (bf16 weights and AdamW moments, rounded
stochastically: prl.trainer.optim), trainer.offload (FSDP2's shards, gradients and optimizer
state in host memory) and trainer.offload_optimizer (AdamW's moments in a host arena, streamed
through the parameters' device a chunk at a time), each on the real trainer model (build_model over a one-rank gloo group, the
tiny Qwen2) against the default float32 trainer on the same batches."""

from __future__ import annotations

import pytest
import torch

from prl.config import ConfigError, LoraConfig, LossConfig, ModelConfig, TrainerConfig
from prl.trainer.loss import build_loss
from prl.trainer.model import build_model, checkpointed_blocks
from prl.trainer.optim import StochasticAdamW, hash32, round_stochastic
from prl.trainer.samples import synthetic_batch
from prl.trainer.train import build_optimizer, train_step

CPU = torch.device("cpu")


def train(model_dir, steps: int, model: torch.nn.Module | None = None,
          **trainer) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """`steps` steps of 2 micro-batches on fixed synthetic batches: (the losses, the model, its optimizer).
    `model`: one built already (with these trainer options), else a new one."""
    torch.manual_seed(0)
    cfg = TrainerConfig(gpus_per_node=0, lr=3e-3, **trainer)
    model = model or build_model(ModelConfig(name=str(model_dir), dtype="float32"), cfg, 1.0, CPU)
    optimizer, scheduler = build_optimizer(model, cfg, CPU)
    losses = []
    for step in range(steps):
        batch = synthetic_batch(step % 2, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=2,
                                seq_len=48, vocab_size=model.causal_lm.config.vocab_size, seed=3)
        metrics = train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, CPU, build_loss(LossConfig()))
        losses.append(metrics["train/loss"])
    return losses, model, optimizer


def resumed(model_dir, tmp_path, saved: dict | None = None, loaded: dict | None = None,
            **trainer) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer, float, torch.nn.Module,
                                torch.optim.Optimizer]:
    """Step 0, prl's DCP checkpoint, step 1 (the straight run); then a fresh trainer loaded from that
    checkpoint takes step 1: (the straight losses, its model and first optimizer, the resumed step's loss,
    the resumed model and optimizer). `saved`, `loaded`: trainer options of the run that saves and of
    the one that resumes, besides `trainer`."""
    from prl.run.rundir import RunDir
    from prl.trainer.ckpt import load_checkpoint, save_checkpoint

    rd = RunDir(tmp_path / "run")
    _, model, first_optimizer = train(model_dir, 1, **trainer, **(saved or {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(first_optimizer, lambda s: 1.0)
    save_checkpoint(rd, 1, model=model, optimizer=first_optimizer, scheduler=scheduler, keep_last=1)
    straight, model, _ = train(model_dir, 2, **trainer, **(saved or {}))

    cfg = TrainerConfig(gpus_per_node=0, lr=3e-3, **trainer, **(loaded or {}))
    resumed_model = build_model(ModelConfig(name=str(model_dir), dtype="float32"), cfg, 1.0, CPU)
    resumed_optimizer, resumed_scheduler = build_optimizer(resumed_model, cfg, CPU)
    assert load_checkpoint(rd, 1, resumed_model, resumed_optimizer, resumed_scheduler) == 1
    batch = synthetic_batch(1, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=2, seq_len=48,
                            vocab_size=resumed_model.causal_lm.config.vocab_size, seed=3)
    metrics = train_step(resumed_model, resumed_optimizer, resumed_scheduler, batch.micro_batches[0], cfg, CPU,
                         build_loss(LossConfig()))
    return straight, model, first_optimizer, metrics["train/loss"], resumed_model, resumed_optimizer


def test_stochastic_rounding_keeps_bf16_values_and_is_unbiased_between_them():
    gen = torch.Generator().manual_seed(0)

    def noise(n: int) -> torch.Tensor:
        return torch.randint(0, 1 << 16, (n,), generator=gen)

    exact = torch.randn(1000, generator=gen).bfloat16()
    assert torch.equal(round_stochastic(exact.float(), noise(1000)), exact)  # nothing to round
    low = torch.tensor(0.02).bfloat16().float()
    spacing = 2.0**-13  # bf16's spacing at 0.02 = 1.28 * 2**-6: 7 fraction bits
    for sign in (1, -1):
        x = torch.full((200_000,), sign * (low.item() + 0.3 * spacing))
        rounded = round_stochastic(x, noise(len(x))).float()
        assert set(rounded.abs().unique().tolist()) == {low.item(), low.item() + spacing}
        assert abs(rounded.mean().item() - x[0].item()) < 0.01 * spacing  # on average 0.3 of a step up


def test_the_rounding_noise_hash_is_uniform_and_differs_between_keys_that_differ():
    """StochasticAdamW's noise: the low and high 16 bits of hash32 over consecutive keys (one chunk) are
    uniform, and the keys of another step or tensor (other high bits) give other values."""
    keys = torch.arange(1 << 18)
    h = hash32(keys)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    for half in (h & 0xFFFF, h >> 16):
        counts = torch.bincount(half >> 12, minlength=16).float()  # 16 bins of 4,096 values each
        assert (counts / counts.mean() - 1).abs().max() < 0.03
        assert abs(half.float().mean().item() / 32767.5 - 1) < 0.01
    other = hash32(keys + (1 << 44))  # the next step
    assert (other == h).float().mean() < 1e-3
    assert abs(torch.corrcoef(torch.stack([h.double(), other.double()]))[0, 1].item()) < 0.01


def test_bf16_adamw_moves_weights_by_updates_under_bf16_resolution_as_fp32_does():
    """lr 1e-6 on weights near 0.02 (bf16 spacing 1.2e-4): torch's AdamW on bf16 weights rounds every
    update away; StochasticAdamW's weights move as the fp32 ones do, on average."""
    start = torch.full((20_000,), 0.02).bfloat16().float()  # representable: each copy starts alike
    params = {name: torch.nn.Parameter(start.clone().to(dtype)) for name, dtype in
              (("fp32", torch.float32), ("nearest", torch.bfloat16), ("stochastic", torch.bfloat16))}
    optimizers = [torch.optim.AdamW([params["fp32"]], lr=1e-6), torch.optim.AdamW([params["nearest"]], lr=1e-6),
                  StochasticAdamW([params["stochastic"]], lr=1e-6)]
    for _ in range(20):
        for p in params.values():
            p.grad = torch.ones_like(p)
        for optimizer in optimizers:
            optimizer.step()
    moved = {name: (p.detach().float() - start).mean().item() for name, p in params.items()}
    assert moved["fp32"] == pytest.approx(-20e-6, rel=1e-3)
    assert moved["nearest"] == 0.0
    assert moved["stochastic"] == pytest.approx(moved["fp32"], rel=0.1)


def test_bf16_master_weights_train_the_tiny_model_as_fp32_does(tiny_model, process_group):
    """The toy run's losses with bf16 master weights (bf16 compute on CPU too) against fp32: the same
    curve to a few percent, and both learn; the weights and AdamW's moments are bf16."""
    fp32, _, _ = train(tiny_model, 6)
    bf16, model, optimizer = train(tiny_model, 6, master_dtype="bfloat16")
    assert isinstance(optimizer, StochasticAdamW)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    for losses in (fp32, bf16):  # both learn each of the two batches (steps alternate between them)
        assert losses[4] < losses[0] - 0.1 and losses[5] < losses[1] - 0.05, losses
    # Measured: 0.3948 0.2651 0.2417 0.0510 0.1975 0.0226 (fp32) against 0.3947 0.2643 0.2415 0.0515 0.1977
    # 0.0226: at most 8e-4 apart.
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 5e-3, (fp32, bf16)


def test_offload_keeps_the_shards_on_the_host_and_trains_as_without(tiny_model, process_group):
    """trainer.offload: every FSDP parameter group offloads (shards and gradients on the host, the
    optimizer fused over them there); the losses and weights are those of the trainer without it."""
    plain, plain_model, _ = train(tiny_model, 2)
    offloaded, model, optimizer = train(tiny_model, 2, offload=True)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    params = [p for g in groups if g is not None for p in g.fsdp_params]
    assert params and all(p.offload_to_cpu for p in params)
    assert optimizer.defaults["fused"]
    assert offloaded == pytest.approx(plain, rel=1e-5)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        # (fused AdamW against the CPU default's foreach: the same update to rounding)
        torch.testing.assert_close(a.detach().to_local(), b.detach().to_local(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3])  # clipped, and not
def test_fused_adamw_clips_by_its_grad_scale_as_clip_grad_norm_does(process_group, max_grad_norm):
    """With torch's fused AdamW, optimizer_step hands the clip to the kernel (optimizer.grad_scale):
    the same grad norm, the same weights as clip_grad_norm_ before a foreach AdamW, and no grad_scale
    left behind for a later step."""
    from torch.distributed.fsdp import fully_shard

    from prl.trainer.train import optimizer_step

    def make(fused):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    (fused, fused_opt, fused_sched), (plain, plain_opt, plain_sched) = make(True), make(False)
    cfg = TrainerConfig(gpus_per_node=0, max_grad_norm=max_grad_norm)
    x = torch.randn(4, 16)
    for _ in range(3):
        norms = []
        for model, optimizer, scheduler in ((fused, fused_opt, fused_sched), (plain, plain_opt, plain_sched)):
            (model(x).square().sum() * 10).backward()
            norms.append(optimizer_step(model, optimizer, scheduler, cfg)[0])
        assert norms[0] == pytest.approx(norms[1], rel=1e-6) and (norms[0] > max_grad_norm) == (max_grad_norm < 1)
        assert not hasattr(fused_opt, "grad_scale")
        for a, b in zip(fused.parameters(), plain.parameters()):
            torch.testing.assert_close(a.detach().to_local(), b.detach().to_local(), rtol=1e-5, atol=1e-7)


def test_a_checkpoint_of_bf16_offloaded_state_resumes_bit_for_bit(tiny_model, process_group, tmp_path):
    """Both options together through prl's DCP checkpoint: the step after a resume gives the loss and
    weights of the step without one (the rounding noise is a hash of the step, not a generator's state)."""
    straight, model, _, loss, resumed_model, _ = resumed(tiny_model, tmp_path, master_dtype="bfloat16", offload=True)
    assert loss == straight[1]
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a.detach().to_local(), b.detach().to_local())


def test_moments_streamed_through_buffers_update_exactly_as_in_place(monkeypatch):
    """StochasticAdamW(state_on_host=True): the moments live in one host arena (a view per parameter)
    and pass through the streamer's two slots a chunk at a time; with chunks of 7 elements (tensors of
    several chunks, a slot reused many times) 3 steps give the weights and moments of the update in
    place bit for bit, bf16 and fp32. The fp32 update is torch's AdamW's to rounding."""
    from prl.trainer import optim

    monkeypatch.setitem(optim.CHUNK, False, 7)
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 6), (3,), (40,), (1,)]
    for dtype in (torch.bfloat16, torch.float32):
        start = [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]
        grads = [[torch.randn(shape, generator=gen).to(dtype) for shape in shapes] for _ in range(3)]
        runs = {}
        for on_host in (False, True):
            params = [torch.nn.Parameter(t.clone()) for t in start]
            optimizer = StochasticAdamW(params, lr=1e-2, weight_decay=0.1, state_on_host=on_host)
            for step in range(3):
                for p, g in zip(params, grads[step]):
                    p.grad = g.clone()
                optimizer.step()
            runs[on_host] = params, optimizer
        (plain, plain_opt), (streamed, streamed_opt) = runs[False], runs[True]
        assert streamed_opt._streamer.count == 3 * sum(-(-t.numel() // 7) for t in start)
        for a, b in zip(plain, streamed):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(plain_opt.state[a][key], streamed_opt.state[b][key])
        bases = {streamed_opt.state[p][key].untyped_storage().data_ptr() for p in streamed for key in ("exp_avg", "exp_avg_sq")}
        assert len(bases) == 1  # one arena
        if dtype == torch.float32:
            reference = [torch.nn.Parameter(t.clone()) for t in start]
            adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
            for step in range(3):
                for p, g in zip(reference, grads[step]):
                    p.grad = g.clone()
                adamw.step()
            for a, b in zip(reference, streamed):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_offloaded_moments_train_and_resume_from_a_checkpoint_bit_for_bit(tiny_model, process_group, tmp_path):
    """trainer.offload_optimizer through the real trainer model and prl's DCP checkpoint: the moments
    are DTensors around the host arena's views; the losses follow the default trainer's (fp32: torch's
    AdamW to rounding); the step after a resume gives the loss and weights of the step without one,
    and the loaded moments are back in the arena."""
    plain, _, _ = train(tiny_model, 2)
    straight, model, optimizer, loss, resumed_model, resumed_optimizer = resumed(tiny_model, tmp_path,
                                                                                offload_optimizer=True)
    assert isinstance(optimizer, StochasticAdamW) and optimizer.state_on_host
    state = next(iter(optimizer.state.values()))
    assert hasattr(state["exp_avg"], "to_local") and state["exp_avg"].to_local().device.type == "cpu"
    assert straight == pytest.approx(plain, rel=1e-5)
    for param, state in resumed_optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].to_local().data_ptr() == resumed_optimizer._arena[param][key].data_ptr(), key
    assert loss == straight[1]
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a.detach().to_local(), b.detach().to_local())


def test_activation_checkpointing_recomputes_the_first_share_of_the_blocks_and_trains_alike(tiny_model, process_group):
    """trainer.activation_checkpointing_fraction: the first round(fraction x blocks) blocks (at least one)
    run their forward again in the backward, the others once; the step's loss and weights are the run's
    without checkpointing."""
    batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=2, seq_len=48,
                            vocab_size=768, seed=3)
    runs = []
    for trainer in ({}, dict(activation_checkpointing=True),
                    dict(activation_checkpointing=True, activation_checkpointing_fraction=0.5)):
        torch.manual_seed(0)
        cfg = TrainerConfig(gpus_per_node=0, lr=3e-3, **trainer)
        model = build_model(ModelConfig(name=str(tiny_model), dtype="float32"), cfg, 1.0, CPU)
        calls = [0] * len(model.causal_lm.model.layers)
        for i, layer in enumerate(model.causal_lm.model.layers):
            # A pre-hook: the recompute stops as soon as it has what the backward needs, before a forward hook.
            layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        optimizer, scheduler = build_optimizer(model, cfg, CPU)
        metrics = train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, CPU, build_loss(LossConfig()))
        runs.append((calls, metrics["train/loss"], [p.detach().to_local().clone() for p in model.parameters()]))
    assert [calls for calls, _, _ in runs] == [[2, 2], [4, 4], [4, 2]]  # forwards a block ran for 2 micro-batches
    (_, plain_loss, plain_weights), *checkpointed = runs
    for _, loss, weights in checkpointed:
        assert loss == plain_loss
        for a, b in zip(weights, plain_weights):
            torch.testing.assert_close(a, b)


def test_the_checkpointed_blocks_are_the_first_share_and_at_least_one():
    assert [checkpointed_blocks(28, f) for f in (1.0, 0.5, 0.25, 0.01)] == [28, 14, 7, 1]


@pytest.mark.parametrize("fields, message", [
    (dict(activation_checkpointing=True, activation_checkpointing_fraction=0.0),
     r"trainer.activation_checkpointing_fraction: must be in \(0, 1\], got 0.0"),
    (dict(activation_checkpointing=True, activation_checkpointing_fraction=1.5), "trainer.activation_checkpointing_fraction"),
    (dict(activation_checkpointing_fraction=0.5), "trainer.activation_checkpointing_fraction: takes effect with"),
    (dict(master_dtype="float16"), "trainer.master_dtype"),
    (dict(offload_optimizer=True, offload=True), "trainer.offload_optimizer: not with trainer.offload"),
    (dict(offload_optimizer=True, lora=LoraConfig(rank=8)), "trainer.offload_optimizer: the adapters'"),
    (dict(master_dtype="bfloat16", lora=LoraConfig(rank=8)), "trainer.master_dtype: bfloat16 is for full fine-tuning"),
    (dict(flat_params=True, gpus_per_node=2), "trainer.flat_params: is for one trainer rank; this run has 2"),
    (dict(flat_params=True, nodes=2), "trainer.flat_params: is for one trainer rank"),
    (dict(flat_params=True, master_dtype="bfloat16"), "trainer.flat_params: needs trainer.master_dtype float32"),
    (dict(flat_params=True, lora=LoraConfig(rank=8)), "trainer.flat_params: not with trainer.lora"),
    (dict(flat_params=True, offload=True), "trainer.flat_params: not with trainer.offload$"),
    (dict(flat_params=True, offload_optimizer=True), "trainer.flat_params: not with trainer.offload_optimizer"),
])
def test_memory_options_refuse_what_they_cannot_do(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainerConfig(**fields)
