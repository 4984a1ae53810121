"""What the orchestrator sends to the inference servers: sampling args, per-turn seeds, server URLs.

    pytest tests/unit/test_orchestrator_client.py
"""

from __future__ import annotations

import asyncio
import re

import pytest

from prl.config import ConfigError, EnvironmentConfig, SamplingConfig
from prl.orchestrator.chat import RolloutClient
from prl.orchestrator.client import inference_urls, server_url
from prl.orchestrator.dataset import SEED_KEY, derive_seed, load_env
from prl.orchestrator.rollouts import sampling_args


def test_sampling_args_ask_vllm_for_tokens_and_logprobs():
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    args = sampling_args(SamplingConfig(temperature=0.7, max_tokens=12), env)
    assert args["logprobs"] is True and args["extra_body"]["return_token_ids"] is True
    assert (args["temperature"], args["top_p"], args["max_tokens"]) == (0.7, 1.0, 12)


def test_sampling_extra_body_reaches_vllm_but_cannot_turn_off_token_ids():
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    extra = {"ignore_eos": True, "return_token_ids": False}
    args = sampling_args(SamplingConfig(max_tokens=12, extra_body=extra), env)
    assert args["extra_body"] == {"ignore_eos": True, "return_token_ids": True}


@pytest.mark.parametrize("own,key", [
    ({"top_k": 20}, "environment sampling_args.top_k"),
    ({"presence_penalty": 0.5}, "environment sampling_args.presence_penalty"),
    ({"extra_body": {"min_p": 0.1}}, "environment sampling_args.extra_body.min_p"),
    ({"extra_body": {"top_p": 0.9}}, "environment sampling_args.extra_body.top_p"),
    ({"extra_body": {"temperature": 0.3}}, "environment sampling_args.extra_body.temperature"),
])
def test_environment_sampling_args_that_truncate_the_distribution_are_refused(own, key):
    """The config's own fields are checked at load; an environment's are known only once it is loaded."""
    env = load_env(EnvironmentConfig(id="prl.envs.toy", args={"num_examples": 8}))
    env.sampling_args = own
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        sampling_args(SamplingConfig(max_tokens=12), env)
    env.sampling_args = {"top_p": 0.5, "top_k": -1, "extra_body": {"top_k": 0}}  # top_p: the config's 1.0 wins
    assert sampling_args(SamplingConfig(max_tokens=12), env)["top_p"] == 1.0


def test_client_sends_a_per_turn_seed(monkeypatch):
    import verifiers as vf
    from openai import AsyncOpenAI

    sent = []

    async def parent_get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        sent.append(sampling_args)

    monkeypatch.setattr(vf.OpenAIChatCompletionsClient, "get_response", parent_get_response)
    client = RolloutClient(AsyncOpenAI(base_url="http://localhost:1/v1", api_key="x"))
    args = {"temperature": 1.0}
    state = {"input": {SEED_KEY: 42}, "trajectory": []}
    asyncio.run(client.get_response([], "m", args, state=state))
    state["trajectory"].append({})
    asyncio.run(client.get_response([], "m", args, state=state))
    asyncio.run(client.get_response([], "m", args, state={"input": {}, "trajectory": []}))
    assert [a.get("seed") for a in sent] == [derive_seed(42, 0), derive_seed(42, 1), None]
    assert args == {"temperature": 1.0}  # the group's shared sampling args stay untouched


def test_inference_urls():
    urls = inference_urls({"PRL_INFERENCE_URLS": "http://a:8000/v1, http://b:8000/v1/"})
    assert urls == ["http://a:8000/v1", "http://b:8000/v1"]
    assert server_url("http://a:8000/v1") == "http://a:8000"
    with pytest.raises(RuntimeError, match="PRL_INFERENCE_URLS"):
        inference_urls({})
