"""The environment worker: one verifiers v1 environment, run in its own Python (verifiers>=0.4), for the
orchestrator (prl.orchestrator.v1env starts it as its child and talks to it over its stdin/stdout).

    .venv-v1/bin/python -m prl.orchestrator.v1worker      # stdin: one JSON line of setup, then requests

Never imported by the orchestrator: it runs where `import verifiers.v1` works. Setup line: {"taskset":
{"id", ...args}, "harness": id, "model": served name, "tokenizer": path}; the run's secret comes in the
environment variable KEY_VAR (never argv, never a file). Each request {"id", "split", "task", "seeds",
"sampling", "url"} is answered by {"id", "rollouts": [...]}: one output per seed, in the shape
prl.orchestrator.rollouts reads (reward, metrics, error, trajectory of turns with token ids).
Episodes reach the policy through verifiers' TrainClient: rendered to ids here, sampled by vLLM's
/inference/v1/generate with the run's secret, once the server has proved it holds it (prl.run.proof,
asked again for every request); each turn continues from the ids before it (verifiers'
renderer bridge), and a trace that could not (more than one branch) becomes turns that do not extend
each other, which prl drops as prompt_mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

KEY_VAR = "PRL_V1_SERVER_KEY"
"""The environment variable that holds the servers' key in the worker (verifiers reads keys from one)."""


def branch_turns(ids: list[int], sampled: list[bool], logprobs: list[float]) -> list[dict]:
    """One branch (one token sequence) as turns: each run of sampled tokens a completion, the ids before
    it its prompt; prl.orchestrator.trajectory joins them back into the same sequence."""
    turns, i = [], 0
    while i < len(ids):
        if not sampled[i]:
            i += 1
            continue
        end = i
        while end < len(ids) and sampled[end]:
            end += 1
        turns.append({"tokens": {"prompt_ids": ids[:i], "completion_ids": ids[i:end], "completion_mask": [1] * (end - i),
                                 "completion_logprobs": [float(x) for x in logprobs[i:end]]}})
        i = end
    return turns


def chat(trace) -> tuple[list[dict], list[dict]]:
    """The final branch's messages as the completions file shows them: the prompt (what came before the
    first reply) and the completion (the rest)."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages = [message_to_wire(m) for m in trace.messages]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return messages[:first], messages[first:]


def trace_output(trace, episode, example: int) -> dict:
    """A v1 trace as the orchestrator's rollout output. An errored trace (or episode) carries `error`."""
    turns = [turn for branch in trace.branches
             for turn in branch_turns(branch.token_ids, branch.sampled_mask, branch.logprobs)]
    error = trace.last_error or (episode.errors[-1] if episode.errors else None)
    prompt, completion = chat(trace)
    return {
        "example_id": example,
        "prompt": prompt,
        "reward": float(trace.reward or 0.0),
        "metrics": {k: float(v) for k, v in (trace.metrics or {}).items()} if hasattr(trace, "metrics") else {},
        "error": None if error is None else {"error": error.type, "message": error.message},
        "is_truncated": bool(trace.is_truncated),
        "trajectory": turns,
        "completion": completion,
        "seat": getattr(getattr(trace, "agent", None), "name", None),
    }


class Worker:
    def __init__(self, setup: dict):
        import verifiers.v1 as vf

        self.vf, self.model, self.tokenizer, self.renderer = vf, setup["model"], setup["tokenizer"], setup.get("renderer")
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        agent = {"harness": {"id": setup["harness"]}, "runtime": {"type": "subprocess"}}

        def env(taskset: dict):
            """The package's own Env if it exports one (a scripted user), else SingleAgentEnv: one `agent` seat."""
            return load_environment(resolve_env_config({"taskset": taskset, "agent": agent}))

        train = env(setup["taskset"])
        # v1 has no held-out split of its own; a taskset whose config has a `split` field gets split=eval.
        fields = type(train.taskset.config).model_fields
        held_out = "split" in fields and "split" not in setup["taskset"]
        self.envs = {"train": train, "eval": env({**setup["taskset"], "split": "eval"}) if held_out else train}
        self.tasks = {split: list(env.taskset) for split, env in self.envs.items()}

    def context(self, url: str, sampling: dict, seed: int):
        vf = self.vf
        client = vf.TrainClientConfig(base_url=url, api_key_var=KEY_VAR, renderer_model_name=self.tokenizer,
                                      renderer=self.renderer)
        return vf.ModelContext(client=client, model=self.model, sampling=vf.SamplingConfig(**sampling, seed=seed))

    async def run(self, request: dict) -> dict:
        from verifiers.v1.env import RunSlot

        from prl.run.proof import prove

        # verifiers' TrainClient sends the key on every request and proves nothing: each request first
        # has the server prove it holds the key (prl.run.proof), else Unproven fails it, nothing sent.
        await prove(request["url"], os.environ[KEY_VAR])
        env, task = self.envs[request["split"]], self.tasks[request["split"]][request["task"]]
        episodes = await asyncio.gather(*(env.run_slot(RunSlot(task), self.context(request["url"], request["sampling"], s))
                                          for s in request["seeds"]))
        outputs = [trace_output(trace, ep, request["task"]) for ep in episodes for trace in ep.traces]
        return {"id": request["id"], "rollouts": outputs}


async def serve(setup: dict, out) -> None:
    worker = Worker(setup)
    async with contextlib.AsyncExitStack() as stack:
        for env in {id(e): e for e in worker.envs.values()}.values():
            await stack.enter_async_context(env.serving())
        out.write(json.dumps({"ready": {k: len(v) for k, v in worker.tasks.items()}}) + "\n")
        out.flush()
        loop, pending = asyncio.get_running_loop(), set()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

        async def answer(request: dict) -> None:
            try:
                reply = await worker.run(request)
            except Exception as e:  # a failed request is this request's answer, not the worker's end
                reply = {"id": request["id"], "failed": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()

        while line := await reader.readline():
            task = asyncio.create_task(answer(json.loads(line)))
            pending.add(task)
            task.add_done_callback(pending.discard)


def main() -> None:
    # The protocol owns the real stdout; everything verifiers and its libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    asyncio.run(serve(json.loads(sys.stdin.readline()), out))


if __name__ == "__main__":
    main()
