"""On-policy distillation's orchestrator side: the teacher's logprob of every token of each sample.

After a batch's rollouts are scored, each sample goes to a teacher server (PRL_INFERENCE_URLS' hosts
at teacher.port; prl.inference.teacher) as one `/v1/completions` request whose prompt is the sample's
token ids, with `prompt_logprobs: 0` (the logprob of each given token, vLLM's raw model distribution,
no temperature) and `max_tokens: 1` (vLLM's least). The answers land in `Sample.teacher_logprobs`,
which prl.run.packing puts into the batch as `teacher_logprobs`; the trainer's loss reads them
(trainer.loss.teacher_kl_coef). Requests go round-robin over the servers, teacher.max_concurrent at once.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from prl.config import Config
from prl.orchestrator.client import REQUEST_TIMEOUT_S, Servers, server_url
from prl.orchestrator.http_client import ServerRoutes
from prl.orchestrator.rollouts import StepRollouts
from prl.run.packing import Sample
from prl.run.watchdog import Watchdog


def teacher_urls(policy_urls: list[str], port: int) -> list[str]:
    """The teacher servers' /v1 URLs: one on each distinct host of the policy's (PRL_INFERENCE_URLS),
    where the inference component starts them (teacher.placement inference_nodes)."""
    hosts = list(dict.fromkeys(urlsplit(url).hostname for url in policy_urls))
    return [f"http://{f'[{h}]' if ':' in h else h}:{port}/v1" for h in hosts]


def token_logprobs(answer: dict, ids: list[int], mask: list[bool]) -> list[float]:
    """The logprob the answer's prompt_logprobs give each of `ids` (0.0 where `mask` is False, as the
    batch's other logprobs); ValueError where a masked-in token has none (a server that scored other ids)."""
    entries = answer["choices"][0].get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ValueError(f"teacher answered prompt_logprobs for {got} tokens, the sample has {len(ids)}")
    out = []
    for token, entry, trained in zip(ids, entries, mask):
        if not trained:
            out.append(0.0)
            continue
        scored = (entry or {}).get(str(token))
        if not isinstance(scored, dict) or not isinstance(scored.get("logprob"), (int, float)):
            raise ValueError(f"teacher answered no logprob for token {token}: {str(entry)[:200]}")
        out.append(max(float(scored["logprob"]), -1e4))  # -inf (a token the teacher rules out) stays finite
    return out


class Teacher:
    """The teacher's servers as the orchestrator sees them: readiness, and scoring a batch's samples."""

    def __init__(self, cfg: Config, policy_urls: list[str], api_key: str | None):
        self.model, self.max_concurrent = cfg.teacher.model, cfg.teacher.max_concurrent
        self.servers = Servers(teacher_urls(policy_urls, cfg.teacher.port), api_key)
        self.routes = [ServerRoutes(server_url(url), api_key, REQUEST_TIMEOUT_S, proofs=self.servers.proofs)
                       for url in self.servers.urls]

    @property
    def urls(self) -> list[str]:
        return self.servers.urls

    async def wait_ready(self, timeout_s: float) -> None:
        await self.servers.wait_ready(timeout_s=timeout_s)

    async def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set every sample's teacher_logprobs; the batch's teacher metrics (rollout/teacher_*)."""
        began, gate = time.perf_counter(), asyncio.Semaphore(self.max_concurrent)

        async def one(i: int, sample: Sample) -> None:
            body = {"model": self.model, "prompt": sample.input_ids, "max_tokens": 1, "prompt_logprobs": 0,
                    "temperature": 1.0}
            async with gate:
                answer = await self.routes[i % len(self.routes)].post("/v1/completions", body)
            sample.teacher_logprobs = token_logprobs(answer, sample.input_ids, sample.loss_mask)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        return {"teacher_s": time.perf_counter() - began,
                "teacher_tokens": float(sum(sum(s.loss_mask) for s in samples))}

    async def score_batch(self, step: int, result: StepRollouts, watchdog: Watchdog) -> None:
        """Batch `step`'s samples scored before it is written (batch by batch and continuous alike),
        within the stall window as its rollouts are; the metrics into the batch's."""
        watchdog.expect(f"batch {step}: the teacher's logprobs", watchdog.window())
        result.metrics |= await self.score(result.samples)

    async def close(self) -> None:
        await asyncio.gather(self.servers.close(), *(route.close() for route in self.routes))
