"""The Chat Completions route to the inference servers: verifiers' OpenAI client with prl's
per-request seeds (the token route, prl.orchestrator.tokens, builds on it)."""

from __future__ import annotations

import verifiers as vf
from loguru import logger

from prl.orchestrator.dataset import SEED_KEY, derive_seed


class RolloutClient(vf.OpenAIChatCompletionsClient):
    """verifiers' Chat Completions adapter, plus a per-request seed, and an empty answer is a valid
    (bad) action.

    Seed: the rollout input's `SEED_KEY` mixed with the turn index, sent as vLLM's per-request
    `seed` (vLLM then samples that request from its own generator, whatever it is batched with).
    verifiers' run_group sends one set of sampling args for every rollout of a group, but hands the
    rollout's state to the client, and state["input"] is the rollout's own input.

    Empty answers: verifiers raises EmptyModelResponseError when the model stops at once, which turns
    the rollout into an error without tokens: it could never be trained on, so a policy drifting
    toward empty answers would never be pushed back. Here it stays a rollout, with its tokens and reward.
    """

    _warned_unseeded = False

    async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        state = kwargs.get("state")
        seed = (state.get("input") or {}).get(SEED_KEY) if state is not None else None
        if seed is not None:
            turn = len(state.get("trajectory") or [])
            sampling_args = {**sampling_args, "seed": derive_seed(seed, turn)}
        elif not RolloutClient._warned_unseeded:
            # verifiers replaces the input by its task payload when it has one (info["task"], "task").
            RolloutClient._warned_unseeded = True
            logger.warning(f"a rollout input came without {SEED_KEY!r}: its samples are not reproducible")
        return await super().get_response(prompt, model, sampling_args, tools, **kwargs)

    async def raise_from_native_response(self, response) -> None:
        choices = getattr(response, "choices", None)
        if not choices or len(choices) != 1:
            await super().raise_from_native_response(response)
