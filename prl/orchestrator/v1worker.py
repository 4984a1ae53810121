"""The environment worker: one verifiers v1 environment, run in its own Python (verifiers>=0.4), for the
orchestrator (prl.orchestrator.v1env starts it as its child and talks to it over its stdin/stdout).

    .venv-v1/bin/python -m prl.orchestrator.v1worker      # stdin: one JSON line of setup, then requests

Never imported by the orchestrator: it runs where `import verifiers.v1` works. Setup line: {"taskset":
{"id", ...args}, "env": env id or null, "harness": id, "model": served name, "tokenizer": path, "renderer":
renderers config or null}; the ready line names the sizes of its splits, the env's seats and the taskset's
`sampling_args` (its own, as a classic environment's; {} for most); the run's secret comes in the
environment variable KEY_VAR (never argv, never a file). With "server" (an address, ipc://SOCKET) in the
setup, the episodes run in verifiers v1's environment server there (prl.orchestrator.v1server), reached
through v1's EnvClient; this worker keeps the tasksets and turns the episodes into rollouts.
Each request {"id", "split", "task", "seeds", "sampling", "url"} is answered by {"id", "rollouts": [...]}:
one output per seed and seat (seat by seat), in the shape prl.orchestrator.rollouts reads (reward,
metrics, error, trajectory of turns with token ids).
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
        # branches: 1 when every turn continued from the ids before it (more are dropped as prompt_mismatch).
        "metrics": {**({k: float(v) for k, v in (trace.metrics or {}).items()} if hasattr(trace, "metrics") else {}),
                    "branches": float(len(trace.branches))},
        "error": None if error is None else {"error": error.type, "message": error.message},
        "is_truncated": bool(trace.is_truncated),
        "trajectory": turns,
        "completion": completion,
        "seat": getattr(getattr(trace, "agent", None), "name", None),
    }


def seats_of(config_type) -> list[str]:
    """The seats an env config declares (its AgentConfig fields), in declaration order."""
    from verifiers.v1.configs.agent import AgentConfig

    return [name for name, f in config_type.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, AgentConfig)]


def seat_major(episodes: list, seats: list[str], example: int) -> list[dict]:
    """Every seat's trace of every episode, seat by seat (the orchestrator takes each seat's baseline over
    its own traces), each marked with its episode. A seat an episode has no trace of (it errored first)
    gets an errored output in its place, so each seat has one output per episode."""
    if len(seats) <= 1:
        return [trace_output(trace, ep, example) | {"episode": i} for i, ep in enumerate(episodes) for trace in ep.traces]
    outputs = []
    for seat in seats:
        for i, ep in enumerate(episodes):
            trace = next((t for t in ep.traces if getattr(getattr(t, "agent", None), "name", None) == seat), None)
            outputs.append({"example_id": example, "prompt": [], "completion": [], "reward": 0.0, "metrics": {},
                            "error": {"error": "NoTrace", "message": f"the episode ended before seat {seat!r} played"},
                            "is_truncated": False, "trajectory": [], "seat": seat} if trace is None
                           else trace_output(trace, ep, example) | {"seat": seat})
            outputs[-1]["episode"] = i
    return outputs


def env_data(setup: dict, taskset: dict, seats: list[str]) -> dict:
    """The env config (verifiers' resolve_env_config input) that plays `taskset`: the env `env` names,
    else the package's own if it exports one (a scripted user), else SingleAgentEnv (one `agent` seat);
    every seat plays through the harness. The environment server (prl.orchestrator.v1server) builds the same."""
    agent = {"harness": {"id": setup["harness"]}, "runtime": {"type": "subprocess"}}
    named = {"id": setup["env"]} if setup.get("env") else {}
    return {**named, "taskset": taskset, **{s: agent for s in seats}}


class Worker:
    def __init__(self, setup: dict):
        import verifiers.v1 as vf

        self.vf, self.model, self.tokenizer, self.renderer = vf, setup["model"], setup["tokenizer"], setup.get("renderer")
        from verifiers.v1.utils.loaders import env_config_type, load_environment, resolve_env_config

        self.seats = seats_of(env_config_type(setup["taskset"]["id"], setup.get("env") or ""))

        def env(taskset: dict):
            return load_environment(resolve_env_config(env_data(setup, taskset, self.seats)))

        train = env(setup["taskset"])
        # v1 has no held-out split of its own; a taskset whose config has a `split` field gets split=eval.
        fields = type(train.taskset.config).model_fields
        held_out = "split" in fields and "split" not in setup["taskset"]
        self.envs = {"train": train, "eval": env({**setup["taskset"], "split": "eval"}) if held_out else train}
        self.tasks = {split: list(env.taskset) for split, env in self.envs.items()}
        # A taskset may constrain its sampling as a classic environment does (e.g. prl_calc_v1's hermes_format).
        self.sampling_args = dict(getattr(train.taskset, "sampling_args", None) or {})
        # With an environment server (setup "server": its address) this worker holds the tasksets and
        # sends each episode there through v1's client; the server plays it (prl.orchestrator.v1server).
        self.server = None
        if setup.get("server"):
            from verifiers.v1.serve import EnvClient

            self.server = EnvClient(setup["server"])

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
        contexts = [self.context(request["url"], request["sampling"], s) for s in request["seeds"]]
        if self.server is None:
            episodes = await asyncio.gather(*(env.run_slot(RunSlot(task), ctx) for ctx in contexts))
        else:  # the server rebuilds the task from its data: the train split's config plays both splits
            data = task.data.model_dump(mode="json")
            episodes = await asyncio.gather(*(self.server.run(ctx.client, ctx.model, ctx.sampling, data)
                                              for ctx in contexts))
        return {"id": request["id"], "rollouts": seat_major(episodes, self.seats, request["task"])}


async def enter_all(stack: contextlib.AsyncExitStack, managers: list) -> None:
    """Enter the async context managers at once, each then left by `stack`: an env's serving starts its
    taskset's tool servers, each a Python that imports verifiers (3 s of CPU), and the train and eval
    envs have one each. One that fails to enter fails the whole, after the others are registered."""
    entered = await asyncio.gather(*(m.__aenter__() for m in managers), return_exceptions=True)
    for manager, result in zip(managers, entered):
        if not isinstance(result, BaseException):
            stack.push_async_exit(manager)
    for result in entered:
        if isinstance(result, BaseException):
            raise result


async def serve(setup: dict, out) -> None:
    worker = Worker(setup)
    async with contextlib.AsyncExitStack() as stack:
        if worker.server is not None:  # episodes run in the server: nothing to serve here
            await worker.server.wait_for_server_startup(timeout=float(setup.get("server_timeout_s", 120)))
            stack.push_async_callback(worker.server.close)
        else:
            await enter_all(stack, [e.serving() for e in {id(e): e for e in worker.envs.values()}.values()])
        out.write(json.dumps({"ready": {k: len(v) for k, v in worker.tasks.items()}, "seats": worker.seats,
                              "sampling_args": worker.sampling_args}) + "\n")
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
