"""trainer.flat_params (prl.trainer.flat): one rank without FSDP, the master weights, gradients and AdamW's
moments in flat tensors. On the real trainer model (the tiny Qwen2, build_model over a one-rank gloo
group) against the FSDP path on the same batches, and through prl's DCP checkpoints both ways."""

from __future__ import annotations

import pytest
import torch

from prl.config import LossConfig, ModelConfig, TrainerConfig
from prl.trainer.flat import ALIGN, ROW, FlatParams, check_fits, chosen
from prl.trainer.loss import build_loss
from prl.trainer.model import build_model
from prl.trainer.prewarm import prewarm
from prl.trainer.train import build_optimizer
from test_trainer_memory import resumed, train

CPU = torch.device("cpu")


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(local(x.detach()).float(), local(y.detach()).float())
               for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_flat_params_train_bit_for_bit_as_fsdp_on_one_rank(tiny_model, process_group):
    """Unclipped, the same losses and weights bit for bit: the same fp32 sums of the micro-batches'
    gradients, the same AdamW update element by element. The module's parameters are views of the flat
    tensor; after a step no per-parameter gradient is held, the flat one stays allocated."""
    fsdp, fsdp_model, _ = train(tiny_model, 3, max_grad_norm=1e3)
    flat, model, optimizer = train(tiny_model, 3, max_grad_norm=1e3, flat_params=True)
    assert flat == fsdp
    assert same_weights(model, fsdp_model)
    assert optimizer.param_groups[0]["params"] == [model.flat.master]
    storage = model.flat.master.untyped_storage().data_ptr()  # CPU: fp32 compute, the master weights themselves
    assert all(p.untyped_storage().data_ptr() == storage for p in model.parameters())
    assert all(p.grad is None for p in model.parameters()) and model.flat.master.grad is not None


def test_flat_params_clip_as_fsdp_does(tiny_model, process_group):
    """Clipped (max_grad_norm 1.0 is under these gradients' norms): the norm of one flat tensor against
    the norm of the per-parameter norms, the same to rounding."""
    fsdp, fsdp_model, _ = train(tiny_model, 3)
    flat, model, _ = train(tiny_model, 3, flat_params=True)
    assert flat == pytest.approx(fsdp, rel=1e-6)
    for a, b in zip(model.parameters(), fsdp_model.parameters()):
        # AdamW divides by sqrt(v): where a gradient is near 0, rounding moves an update by a part of lr (3e-3)
        torch.testing.assert_close(a.detach(), local(b.detach()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("saved_flat, resumed_flat", [(True, True), (True, False), (False, True)])
def test_a_checkpoint_resumes_bit_for_bit_with_or_without_flat_params(tiny_model, process_group, tmp_path,
                                                                       saved_flat, resumed_flat):
    """Flat checkpoints have FSDP's names and layout: saved with flat_params and resumed with or without it
    (and the other way), the step after the resume gives the loss and weights of the straight run."""
    straight, model, first_optimizer, loss, resumed_model, resumed_optimizer = resumed(
        tiny_model, tmp_path, max_grad_norm=1e3, saved={"flat_params": saved_flat},
        loaded={"flat_params": resumed_flat})
    assert loss == straight[1]
    assert same_weights(resumed_model, model)
    assert resumed_optimizer.param_groups[0]["lr"] == first_optimizer.param_groups[0]["lr"]


def test_prewarm_leaves_the_flat_gradients_to_the_first_step(tiny_model, process_group):
    """The prewarm's backward runs the gradient hooks too: the first real step must start its sums anew,
    not add to the prewarm's gradients."""
    cfg = TrainerConfig(gpus_per_node=0, lr=3e-3, flat_params=True, max_grad_norm=1e3)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=str(tiny_model), dtype="float32"), cfg, 1.0, CPU)
    prewarm(model, lambda m, last: None, CPU, model.causal_lm.config.vocab_size, [[32]], False,
            build_loss(LossConfig()))
    assert model.flat.master.grad.abs().sum() > 0  # the prewarm's, left where the first step overwrites them
    warmed, warmed_model, _ = train(tiny_model, 2, max_grad_norm=1e3, flat_params=True, model=model)
    plain, plain_model, _ = train(tiny_model, 2, max_grad_norm=1e3, flat_params=True)
    assert warmed == plain and same_weights(warmed_model, plain_model)


def test_a_parameter_without_a_gradient_in_a_step_gets_zeros_and_padding_stays_zero():
    """Each parameter starts at a multiple of ALIGN; the step's first gradient is copied, the next added;
    one that got none this step has zeros, not the last step's."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(5, 3), "unused": torch.nn.Linear(3, 2)})
    flat = FlatParams(model, torch.float32)
    names = [name for name, _ in flat.named]
    assert [start % ALIGN for start, _ in flat.spans] == [0] * len(names)
    x = torch.randn(4, 5)
    model["unused"](model["used"](x)).sum().backward()  # a step where both got gradients
    flat.gradients_done()
    flat.stepped()
    want = {}
    for part in (x[:2], x[2:]):  # two micro-batches through `used` alone
        loss = model["used"](part).square().sum()
        grads = torch.autograd.grad(loss, list(model["used"].parameters()))
        for name, g in zip(("used.weight", "used.bias"), grads):
            want[name] = want.get(name, 0) + g
        model["used"](part).square().sum().backward()
    flat.gradients_done()
    for (name, p), (start, n) in zip(flat.named, flat.spans):
        got = flat.master.grad[start : start + n].view(p.shape)
        torch.testing.assert_close(got, want.get(name, torch.zeros_like(p)))
    used = sum(-(-n // ALIGN) * ALIGN for _, n in flat.spans)
    assert flat.master.numel() == ROW >= used and all(p.grad is None for p in model.parameters())
    assert torch.equal(flat.master.grad[used:], torch.zeros(ROW - used))


def test_behaviour_versions_of_a_flat_model_are_plain_tensors_and_recompute_exactly(tiny_model, process_group):
    """trainer.behaviour_logprobs recompute on a flat model: the version kept before a step reproduces that
    version's logprobs after it, its checkpoint state is plain tensors, and the model's own weights
    come back."""
    from prl.trainer.behaviour import BehaviourPolicy
    from prl.trainer.samples import synthetic_batch, to_device

    _, model, _ = train(tiny_model, 1, flat_params=True)
    batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=1, samples_per_micro_batch=2, seq_len=32,
                            vocab_size=model.causal_lm.config.vocab_size, seed=5)
    mb = to_device(batch.micro_batches[0][0], CPU)  # with the sample bounds, as the step's
    with torch.no_grad():
        before = model(mb["input_ids"], mb["position_ids"])[0]
    behaviour = BehaviourPolicy(model, async_level=1, dtype=torch.float32)
    behaviour.keep(1)
    assert all(type(t) is torch.Tensor for t in behaviour.state()["v1"].values())
    _, _, _ = train(tiny_model, 1, flat_params=True, model=model)  # one more step on the same model
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    behaviour.prepare(2, 1, [mb])
    assert torch.equal(mb["behaviour_logprobs"], before.masked_fill(~mb["loss_mask"], 0.0))
    assert all(torch.equal(p, after[name]) for name, p in model.named_parameters())


def test_bf16_compute_weights_are_cast_from_the_fp32_master_weights_after_each_step():
    """A GPU trainer's layout, on CPU: the module's parameters bf16 views of `compute`, the micro-batches'
    bf16 gradients summed in fp32, and after each update `compute` the master weights rounded to bf16;
    checkpoints hold the fp32 master weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    flat = FlatParams(model, torch.bfloat16)
    optimizer = torch.optim.AdamW([flat.master], lr=1e-2)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    params = [p for _, p in flat.named]
    for _ in range(2):
        want = [torch.zeros(p.shape) for p in params]
        for part in (x[:3], x[3:]):
            for total, g in zip(want, torch.autograd.grad(model(part).float().square().sum(), params)):
                total += g  # bf16 gradients, summed in fp32
            model(part).float().square().sum().backward()
        flat.gradients_done()
        for p, total in zip(params, want):
            assert p.dtype == torch.bfloat16 and p.grad is None
            assert torch.equal(flat._view(flat.master.grad, p), total)
        optimizer.step()
        flat.stepped()
        for p in params:
            master = flat._view(flat.master.detach(), p)
            assert torch.equal(p.detach(), master.to(torch.bfloat16)) and not torch.equal(p.detach().float(), master)
    assert {t.dtype for t in flat.model_state(model).values()} == {torch.float32}


def test_a_flat_state_that_would_not_leave_room_on_the_gpu_is_refused_naming_the_key():
    """18 bytes a parameter with bf16 compute: a 1.5B fits an H200 (143 GiB) with room, a 7B does not."""
    h200 = 143 * 2**30
    check_fits(1_543_714_304, torch.bfloat16, h200)
    with pytest.raises(ValueError, match=r"^trainer.flat_params: the flat state of 7.6B parameters takes 128 GiB, "
                                         r"over 80% of this GPU's 143 GiB; set it to false"):
        check_fits(7_615_616_512, torch.bfloat16, h200)


@pytest.mark.parametrize("setting, trainer, numel, gpu_bytes, want, why", [
    (None, {}, 1_543_714_304, 143 * 2**30, True, "unset: one GPU, and the state fits"),
    (None, {}, 1_543_714_304, None, False, "unset: FSDP on CPU"),
    (None, {"gpus_per_node": 2}, 1_543_714_304, 143 * 2**30, False, "unset; not possible here: is for one trainer rank; this run has 2"),
    (None, {"lora": {"rank": 8}}, 1_543_714_304, 143 * 2**30, False, "unset; not possible here: not with trainer.lora"),
    (None, {"master_dtype": "bfloat16"}, 1_543_714_304, 143 * 2**30, False, "unset; not possible here: needs trainer.master_dtype float32"),
    (None, {}, 7_615_616_512, 143 * 2**30, False, "unset, and its state of 128 GiB would take over 80% of the GPU's 143 GiB"),
    (False, {}, 1_543_714_304, 143 * 2**30, False, "trainer.flat_params=false"),
    (True, {}, 1_543_714_304, None, True, "trainer.flat_params=true"),
])
def test_unset_flat_params_is_on_for_one_gpu_where_it_can_run_and_the_state_fits(setting, trainer, numel, gpu_bytes,
                                                                                 want, why):
    """None (the default) resolves at the trainer's start: on for one GPU where nothing needs FSDP's layout and
    the state fits, else FSDP, saying why; off on CPU (CI's runs keep FSDP's path; set, it is what it says)."""
    from prl.config.trainer import LoraConfig

    cfg = TrainerConfig(**{k: LoraConfig(**v) if k == "lora" else v for k, v in trainer.items()})
    on, reason = chosen(setting, cfg.flat_params_blocker(), numel, torch.bfloat16, gpu_bytes)
    assert on == want and why in reason, reason
