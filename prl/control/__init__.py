"""The control plane: the `prl` command and what it needs on a login node (no torch, no vLLM).

    cli.py            the `prl` command: submit, status, cancel, logs, resume, eval, ...
    submit.py         `prl submit`: validate, resolve, write the run directory, render, submit
    checks.py         pre-submit checks of what a valid config still needs from the world
    envchecks.py      pre-submit checks of the modules a config names: environments, a custom loss
    v1checks.py       pre-submit checks of a verifiers v1 environment, in its worker's Python
    moechecks.py      pre-submit checks that read an MoE's expert count: CPU data parallelism, expert parallelism
    vocab.py          the teacher's vocabulary against the student's, from their tokenizer files
    modelfiles.py     a model's files on the login node: the Hugging Face cache, its directory, its expert count
    toolparser.py     `inference.tool_call_parser: auto`: the model family's parser, resolved at submit
    fork.py           `prl submit --from RUN[:STEP]`: a new run from another run's checkpoint
    render.py         the sbatch script, a pure function of the resolved config
    slurm.py          the subprocess boundary to SLURM: sbatch, squeue, sacct, scancel
    runstate.py       whether a run is busy: its SLURM jobs and their states
    local.py          local mode: the run's three programs as processes on this machine
    status.py         `prl status`: the run's jobs and its progress
    progress.py       how far a run is, from its run directory alone
    logview.py        `prl logs`: every component's and rank's log, each line prefixed
    watch.py          `prl watch`: the components' logs side by side, following
    plot.py           `prl plot`: reward, loss, entropy and step time in one PNG
    evaluate.py       `prl eval`: a run's saved weights evaluated with its eval settings
    completion.py     `prl completion bash`: completion built from prl's own argument parser
"""
