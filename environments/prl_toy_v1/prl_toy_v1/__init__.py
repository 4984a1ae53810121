"""prl's toy task as a verifiers v1 taskset (the v1 port of prl/envs/toy.py; same prompts, same reward).

    orchestrator.environment: {id: prl_toy_v1, api: v1, args: {target_chars: aeiou}}

`args` are the taskset's config fields (ToyConfig); `split: eval` gives the held-out prompts. The
harness is prl's in-process chat loop (prl_chat): nothing is installed or spawned per episode.
`turns: N` makes an episode N assistant turns: a scripted user (ToyEnv) asks for more after each
reply, and the reward is the last reply's.
"""

import verifiers.v1 as vf

DEFAULT_EXAMPLES = 512
EVAL_EXAMPLES = 64


def target_fraction(text: str, target_chars: str) -> float:
    """Share of `text`'s characters found in `target_chars` (0 for an empty text)."""
    if not text:
        return 0.0
    targets = set(target_chars)
    return sum(ch in targets for ch in text) / len(text)


class ToyData(vf.TaskData):
    target_chars: str = "aeiou"


class ToyTask(vf.Task[ToyData]):
    @vf.reward(weight=1.0)
    async def target_char_fraction(self, trace: vf.Trace) -> float:
        return target_fraction(trace.last_reply or "", self.data.target_chars)


class ToyConfig(vf.TasksetConfig):
    target_chars: str = "aeiou"
    """Characters the reward counts."""
    num_examples: int = DEFAULT_EXAMPLES
    """Training prompts (distinct only so that groups are distinct examples; the task ignores them)."""
    split: str = "train"
    """train, or eval: the 64 held-out prompts, none of them a training prompt."""
    turns: int = 1
    """Assistant turns per episode; after each but the last the scripted user says FOLLOW_UP."""


class ToyTaskset(vf.Taskset[ToyTask, ToyConfig]):
    def load(self) -> list[ToyTask]:
        tag, n = ("eval ", EVAL_EXAMPLES) if self.config.split == "eval" else ("", self.config.num_examples)
        return [ToyTask(ToyData(prompt=f"Write some text. ({tag}{i})", target_chars=self.config.target_chars),
                        self.config.task) for i in range(n)]


FOLLOW_UP = "Write some more."


class ToyEnv(vf.SingleAgentEnv):
    """The one `agent` seat; with `turns` > 1 a scripted user answers each reply with FOLLOW_UP (the
    harness relaunches on the whole conversation, so the trace's turns are one token sequence)."""

    async def run(self, task: vf.Task, agents) -> None:
        await converse(agents.agent, task, self.taskset.config.turns)


async def converse(agent, task: vf.Task, turns: int) -> vf.Trace:
    """`agent` answers `task`, then FOLLOW_UP after each reply but the last (`turns` replies in all)."""
    if turns == 1:
        return await agent.run(task)
    async with agent.interaction(task) as chat:
        reply = await chat.turn()  # a prompted task speaks first
        for _ in range(turns - 1):
            if reply.terminated:
                break
            reply = await chat.turn(FOLLOW_UP)
    return chat.trace


__all__ = ["ToyEnv", "ToyTaskset", "converse"]
