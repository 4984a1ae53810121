"""Two seats on the toy task, an episode of two agents (a v1 multi-agent environment):

    orchestrator.environment: {id: prl_toy_v1, api: v1, env: prl_toy_duo}

`writer` answers the task's prompt (with `args: {turns: N}`, N replies to a scripted user, as ToyEnv);
`editor` is shown the writer's last reply and asked to rewrite it. Each
seat's trace is scored by the toy reward on its own last reply, and each is a training sample of its
own. The seats see different prompts, so their rewards are not comparable: prl takes each seat's
advantage baseline over that seat's traces of the group.
"""

import verifiers.v1 as vf

from prl_toy_v1 import ToyData, ToyTask, converse

EDIT = "Rewrite this text:"


class DuoConfig(vf.EnvConfig):
    writer: vf.AgentConfig = vf.AgentConfig()
    """Answers the task's prompt."""
    editor: vf.AgentConfig = vf.AgentConfig()
    """Rewrites the writer's reply."""


class DuoEnv(vf.Env[DuoConfig]):
    async def run(self, task: vf.Task, agents) -> None:
        draft = await converse(agents.writer, task, self.taskset.config.turns)
        data = ToyData(prompt=f"{EDIT} {draft.last_reply or ''}", target_chars=task.data.target_chars)
        await agents.editor.run(ToyTask(data, self.taskset.config.task))


__all__ = ["DuoEnv"]
