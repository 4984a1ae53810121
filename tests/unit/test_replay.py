"""Routing replay (trainer.routing_replay): the routers of three MoE families take recorded experts,
the trainer's step with them, the route's payload through the orchestrator into the batch, and the
refusals of a run that cannot replay. vLLM's CPU build records no experts (docs/moe.md), so what vLLM
sends is built here in its format; tests/gpu/test_gpu_rl.py runs the whole loop on a GPU.

    pytest tests/unit/test_replay.py
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from helpers import TOY, prl, tiny_model_dir

from prl.config import ConfigError, LossConfig, ModelConfig, TrainerConfig, load_config
from prl.inference.generate import parse, routed_payload
from prl.orchestrator.trajectory import routing_of, sample_from_trajectory
from prl.run.batch import ROUTED_KEY, Batch, read_batch, write_batch
from prl.run.packing import NO_ROUTE, Sample, pack_batch
from prl.run.rundir import RunDir
from prl.trainer import replay
from prl.trainer.loss import build_loss
from prl.trainer.model import build_model
from prl.trainer.samples import synthetic_batch
from prl.trainer.train import build_optimizer, train_step

CPU = torch.device("cpu")


def own_routing(lm, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The experts the model itself picks for `ids` [1, T] (packed samples: their `positions`): uint8
    [1, T, layers, top_k]."""
    k = lm.config.num_experts_per_tok
    with torch.no_grad():
        logits = lm(input_ids=ids, position_ids=positions, use_cache=False, output_router_logits=True).router_logits
    return torch.stack([torch.topk(layer.float(), k, dim=-1).indices for layer in logits], 1)[None].to(torch.uint8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_routers_replay_recorded_experts_and_keep_their_own_where_none_was_recorded(family):
    """Replaying the model's own choice changes nothing (logits to the bit); other experts from position 5
    on change those positions and no earlier one; NO_ROUTE rows route as the router does; the router still
    gets a gradient (the replayed experts' weights are its softmax)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32)
    ids = torch.randint(0, 100, (1, 24))
    reference = lm(input_ids=ids).logits
    own = own_routing(lm, ids)
    routers = replay.install(lm)
    assert len(routers) == lm.config.num_hidden_layers and replay.install(lm) == routers  # twice: no double class

    replay.set_replay(routers, own)
    assert torch.equal(lm(input_ids=ids).logits, reference)
    unknown = own.clone()
    unknown[0, 10:] = NO_ROUTE
    replay.set_replay(routers, unknown)
    assert torch.equal(lm(input_ids=ids).logits, reference)

    other = own.clone()
    other[0, 5:] = (other[0, 5:].long() + 1).remainder(lm.config.num_local_experts if family == "mixtral"
                                                         else lm.config.num_experts).to(torch.uint8)
    replay.set_replay(routers, other)
    logits = lm(input_ids=ids).logits
    assert torch.allclose(logits[0, :5], reference[0, :5], atol=1e-5)
    assert (logits[0, 5:] - reference[0, 5:]).abs().amax(-1).min() > 1e-4  # every replayed position moved
    logits.sum().backward()
    assert all(router.weight.grad.abs().sum() > 0 for router in routers)
    with pytest.raises(ValueError, match="1 layers, the model 2 routers"):
        replay.set_replay(routers, own[:, :, :1])
    replay.set_replay(routers, None)
    assert torch.equal(lm(input_ids=ids).logits.detach(), reference.detach())


def test_a_dense_model_has_no_routers_to_replay():
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="^trainer.routing_replay: .* has no top-k routers"):
        replay.install(AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32))


def test_the_training_step_replays_the_batch_and_says_how_much_it_replayed(process_group):
    """The real trainer (build_model, one gloo rank): a batch carrying the model's own experts trains as one
    without them; half the positions given other experts change the loss; train/routing_replayed is the
    share of positions with recorded experts."""
    from transformers import AutoModelForCausalLM

    moe = tiny_model_dir("qwen3_moe")
    plain = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)  # the trainer's own choice, unsharded

    def step(routed: str) -> dict:
        torch.manual_seed(0)
        cfg = TrainerConfig(gpus_per_node=0, lr=1e-3, routing_replay=routed != "off")
        model = build_model(ModelConfig(name=str(moe), dtype="float32"), cfg, 1.0, CPU)
        batch = synthetic_batch(0, world_size=1, micro_batches_per_rank=2, samples_per_micro_batch=2, seq_len=32,
                                vocab_size=model.causal_lm.config.vocab_size, seed=1)
        for mb in batch.micro_batches[0]:
            if routed in ("own", "other"):
                mb[ROUTED_KEY] = own_routing(plain, mb["input_ids"], mb["position_ids"])
            if routed == "other":
                mb[ROUTED_KEY][0, ::2] = (mb[ROUTED_KEY][0, ::2] + 1) % 8
                mb[ROUTED_KEY][0, 1::4] = NO_ROUTE
        optimizer, scheduler = build_optimizer(model, cfg, CPU)
        return train_step(model, optimizer, scheduler, batch.micro_batches[0], cfg, CPU, build_loss(LossConfig()))

    off, own, other, none = step("off"), step("own"), step("other"), step("none")
    assert "train/routing_replayed" not in off
    assert own["train/loss"] == off["train/loss"] and own["train/routing_replayed"] == 1.0
    assert other["train/loss"] != off["train/loss"] and other["train/routing_replayed"] == 0.75
    assert none["train/loss"] == off["train/loss"] and none["train/routing_replayed"] == 0.0


def payload(rows: np.ndarray, start: int = 0) -> dict:
    return {"data": base64.b64encode(rows.astype(np.uint8).tobytes()).decode(), "shape": list(rows.shape),
            "start": start, "dtype": "uint8"}


def test_a_samples_routing_is_laid_along_its_tokens_each_position_kept_from_the_turn_that_ran_it_first():
    """Turn 1 (prompt 3, completion 2) records positions 0-3; turn 2 (its prompt the 5 tokens before plus 2
    of the environment, completion 2) records 0-7 again. Positions 0-3 keep turn 1's experts, 4-7 come from
    turn 2, the last token none; a trajectory without payloads has no routing (None, not "none recorded")."""
    first = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 7
    second = np.full((8, 2, 2), 6)
    turns = [{"tokens": {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "completion_mask": [1, 1],
                         "completion_logprobs": [-1.0, -1.0], "routed_experts": payload(first)}},
             {"tokens": {"prompt_ids": [1, 2, 3, 4, 5, 6, 7], "completion_ids": [8, 9], "completion_mask": [1, 1],
                         "completion_logprobs": [-1.0, -1.0], "routed_experts": payload(second)}}]
    sample = sample_from_trajectory(turns, 1.0)
    assert len(sample) == 9 and sample.routed_experts.shape == (9, 2, 2)
    assert (sample.routed_experts[:4] == first).all() and (sample.routed_experts[4:8] == 6).all()
    assert (sample.routed_experts[8] == NO_ROUTE).all()
    incremental = [turns[0], {"tokens": {**turns[1]["tokens"], "routed_experts": payload(second[5:], start=5)}}]
    assert (routing_of(incremental, 9)[4] == NO_ROUTE).all() and (routing_of(incremental, 9)[5:8] == 6).all()
    for turn in turns:
        turn["tokens"]["routed_experts"] = None
    assert sample_from_trajectory(turns, 1.0).routed_experts is None


def test_the_batch_carries_routed_experts_per_micro_batch_and_its_reader_checks_them(tmp_path):
    """Packed along the samples (a sample without any: NO_ROUTE throughout), written and read back; a
    malformed tensor is refused by the reader with what is wrong."""
    routed = np.full((3, 2, 2), 5, dtype=np.uint8)
    samples = [Sample([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 1.0, routed_experts=routed),
               Sample([4, 5], [False, True], [0.0, -1.0], -1.0)]
    (micro_batch,) = pack_batch(samples, world_size=1, micro_batch_size=2)[0]
    assert micro_batch[ROUTED_KEY].dtype == torch.uint8 and micro_batch[ROUTED_KEY].shape == (1, 5, 2, 2)
    assert micro_batch[ROUTED_KEY][0, :3].eq(5).all() and micro_batch[ROUTED_KEY][0, 3:].eq(NO_ROUTE).all()
    assert ROUTED_KEY not in pack_batch(samples[1:], 1, 2)[0][0]
    rd = RunDir(tmp_path)
    write_batch(rd, Batch(step=0, policy_version=0, micro_batches=[[micro_batch]], metrics={}))
    assert torch.equal(read_batch(rd, 0).micro_batches[0][0][ROUTED_KEY], micro_batch[ROUTED_KEY])
    for bad in (micro_batch[ROUTED_KEY].long(), micro_batch[ROUTED_KEY][:, :4]):
        write_batch(rd, Batch(step=0, policy_version=0, micro_batches=[[micro_batch | {ROUTED_KEY: bad}]], metrics={}))
        with pytest.raises(ValueError, match="routed_experts must be uint8 \\[1, T, layers, top_k\\] along input_ids"):
            read_batch(rd, 0)


def test_the_route_answers_vllms_experts_as_raw_bytes_and_refuses_a_flag_that_is_not_a_bool():
    experts = np.random.default_rng(0).integers(0, 128, (7, 3, 8))
    sent = routed_payload(experts)
    assert sent["shape"] == [7, 3, 8] and sent["start"] == 0 and json.loads(json.dumps(sent)) == sent
    assert (np.frombuffer(base64.b64decode(sent["data"]), np.uint8).reshape(7, 3, 8) == experts).all()
    assert routed_payload(None) is None  # a server that recorded none: unknown, not an empty routing
    assert parse({"token_ids": [1], "routed_experts": True})[3] is True
    assert parse({"token_ids": [1]})[3] is False
    with pytest.raises(ValueError, match="routed_experts must be true or false"):
        parse({"token_ids": [1], "routed_experts": "yes"})


def test_the_token_route_asks_for_routed_experts_and_hands_them_to_verifiers(tiny_model):
    """The payload lands in verifiers' ResponseTokens on both of the client's paths (the direct one, and
    the ChatCompletion that answers with tool calls go through), whence verifiers puts it into the step."""
    import asyncio

    from openai import AsyncOpenAI

    from prl.orchestrator.tokens import RouteAnswer, TokenClient

    client = TokenClient(AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x"), str(tiny_model),
                         routed_experts=True)
    sent = routed_payload(np.ones((5, 2, 2)))
    answer = RouteAnswer({"token_ids": [5, 6], "finish_reason": "stop", "logprobs": [-1.0, -2.0],
                          "routed_experts": sent}, [1, 2, 3, 4], "m")
    assert client.to_response(answer).message.tokens.routed_experts == sent
    via_chat = asyncio.run(client.from_native_response(RouteAnswer(
        {**answer.result, "content": "x", "tool_calls": []}, answer.prompt_ids, "m")))
    assert via_chat.message.tokens.routed_experts == sent


def test_a_run_that_cannot_replay_is_refused_naming_the_key(tmp_path):
    """CPU inference (vLLM's CPU build records no experts), Chat Completions, a v1 environment, a dense model:
    one line naming trainer.routing_replay, exit 2, nothing written. The servers of a replaying run are
    started with vLLM's switch, a teacher's not."""
    from prl.inference.server import vllm_args
    from prl.inference.teacher import teacher_config

    moe, out = tiny_model_dir("qwen3_moe"), tmp_path / "out"
    gpu = ["trainer.routing_replay=true", "inference.gpus_per_node=1", f"model.name={moe}"]
    for extra, said in ((["inference.gpus_per_node=0"], "needs GPU inference"),
                        (["orchestrator.rollout_route=chat"], "needs orchestrator.rollout_route=tokens"),
                        ([f"model.name={tiny_model_dir()}"], "is dense: it has no routing to replay")):
        r = prl("submit", str(TOY), "--dry-run", f"run.output_dir={out}", *gpu, *extra, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("prl: error: trainer.routing_replay: "), r.stderr
        assert said in r.stderr and r.stderr.count("\n") == 1 and not out.exists()
    with pytest.raises(ConfigError, match="^trainer.routing_replay: not with verifiers v1 environments"):
        load_config(TOY, [*gpu, "orchestrator.environment.api=v1"])
    cfg = load_config(TOY, [*gpu, "teacher.model=/models/t", "trainer.loss.teacher_kl_coef=1",
                            "orchestrator.filter_zero_advantage=false", "inference.gpu_memory_utilization=0.6"])
    assert "--enable-return-routed-experts" in vllm_args(cfg)
    assert "--enable-return-routed-experts" not in vllm_args(teacher_config(cfg))
