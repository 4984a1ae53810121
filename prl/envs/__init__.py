"""RL environments: local modules with `load_environment(**args) -> verifiers.Environment`.

    orchestrator:
      environment:
        id: prl.envs.toy               # or prl.envs.reverse_text, prl.envs.hendrycks_math, any importable module
        args: {target_chars: aeiou}

Several at once: `orchestrator.environments: [{id, args, name, ratio}, ...]` (docs/evals.md). Each may
have an `eval_dataset` (verifiers' held-out split), which evals use; the shipped ones do.

They use verifiers' classic API (`import verifiers as vf`; pinned `verifiers>=0.3.1,<0.4`): 0.4 is a
rewrite whose harness installs packages from the network at run time, which compute nodes without
internet cannot do. Datasets default to small samples shipped in `prl/envs/data/` (model hubs are
often unreachable from clusters); pass `dataset_name` to load a Hugging Face dataset instead.

    toy.py            a task a randomly initialised tiny model learns in a few dozen steps on CPU
    reverse_text.py   reverse a text; reward: similarity to the reversed text
    hendrycks_math.py competition math; reward 1 if the last \\boxed{} answer is right
    calculator.py     add two numbers, with an `add` tool the model may call (tool use)
    guess_letter.py   guess a secret letter over several turns (multi-turn)
    math_grading.py   a final answer graded against the reference with math-verify
    common.py         what the environments share: argument checks, shipped samples, HF datasets
    make_samples.py   generates the datasets shipped in `prl/envs/data/`
"""
