"""Tool use on the token route against a real vLLM server (CPU build, tiny model, the hermes parser):
verifiers' ToolEnv and StatefulToolEnv through the orchestrator's rollouts (docs/tools.md).

    pytest -m vllm tests/integration/test_tool_use.py      # the session's one CPU server (conftest.cpu_server)
"""

from __future__ import annotations

import pytest
import torch
from inference_helpers import API_KEY

pytestmark = pytest.mark.vllm

GROUP = 4


def test_tool_calls_continue_from_token_ids_and_their_results_stay_out_of_the_loss(vllm_server, tiny_model):
    """prl.envs.calculator as verifiers' ToolEnv and as StatefulToolEnv (up to 2 turns), the random
    tiny model held to the Hermes format by a regex (hermes_format): the server's hermes parser finds
    its calls, the tools answer, and the next turn continues from the sampled ids. No rollout errors or
    is dropped; every call's result (a + b, and the stateful tool's own count) follows it in the sample,
    outside the loss mask, and the calls themselves are in it."""
    import asyncio
    import re

    from transformers import AutoTokenizer

    from prl.config import EnvironmentConfig, SamplingConfig
    from prl.orchestrator.client import Servers
    from prl.orchestrator.dataset import EnvGroups, example_indices, load_env, rollout_groups
    from prl.orchestrator.rollouts import generate_step, sampling_args

    parts = []
    for name, stateful in (("tool", False), ("stateful", True)):
        args = {"max_turns": 2, "hermes_format": True, "stateful": stateful, "num_examples": 16}
        env = load_env(EnvironmentConfig(id="prl.envs.calculator", args=args))
        groups = rollout_groups(env.get_dataset(), example_indices(0, 0, 4, 16), GROUP, 0, 0)
        parts.append(EnvGroups(name, env, groups, sampling_args(SamplingConfig(max_tokens=72), env)))

    async def rollouts():
        servers = Servers([f"{vllm_server.url}/v1"], API_KEY, tokenizer=str(tiny_model))
        try:
            return await generate_step(parts, servers, await servers.model_name(), 16, filter_zero_advantage=False)
        finally:
            await servers.close()

    result = asyncio.run(rollouts())
    assert result.metrics["dropped_frac"] == 0.0 and result.metrics["error_frac"] == 0.0, result.metrics
    assert len(result.samples) == 2 * 4 * GROUP
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    call = re.compile(r'<tool_call>\n\{"name": "add", "arguments": \{"a": (\d+), "b": (\d+)\}\}\n</tool_call><\|im_end\|>\n'
                      r"<\|im_start\|>user\n<tool_response>\n(\d+)(?: \(call (\d+)\))?\n</tool_response>")
    calls = {"tool": 0, "stateful": 0}
    for i, rollout in enumerate(result.rollouts):  # in part order: the ToolEnv's, then the StatefulToolEnv's
        ids, mask = torch.tensor(rollout.sample.input_ids), torch.tensor(rollout.sample.loss_mask)
        found = call.findall(tokenizer.decode(ids))
        stateful = i >= 4 * GROUP
        calls["stateful" if stateful else "tool"] += len(found)
        for number, (a, b, total, count) in enumerate(found, start=1):
            assert int(total) == int(a) + int(b) and (count == str(number) if stateful else count == "")
        trained, context = tokenizer.decode(ids[mask]), tokenizer.decode(ids[~mask])
        # The calls are trained on; the last turn's call (max_turns reached) has no result after it.
        assert trained.count("<tool_call>") - len(found) in (0, 1) and "<tool_response>" not in trained
        assert context.count("<tool_response>") == len(found)
        assert len(rollout.output["trajectory"]) == 1 + bool(found)  # a call, then the answer turn
    assert calls["tool"] > 0 and calls["stateful"] > 0, calls
