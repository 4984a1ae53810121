"""Pre-submit checks: what a valid config still needs from the world (a writable output dir, the
model, the environment module and its arguments, a custom loss's module and function, the
scheduler's consent), checked before anything
is written or queued, so that a mistake fails in a second instead of after the queue wait.

    from prl.control.checks import check_before_submit
    check_before_submit(cfg, script_text, local=False)   # raises ConfigError naming the key

Called by prl.control.submit.prepare (`prl submit`, `--dry-run`, `--local`). They must stay fast (--dry-run
< 0.5 s cold) and keep the control plane free of torch. The modules a config names (environments, a
custom loss) are checked by prl.control.envchecks, an MoE's expert count by prl.control.moechecks.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import os
import re
import shutil
import subprocess
from importlib.util import find_spec
from pathlib import Path

from prl.config import Config, ModelConfig, envref
from prl.config.sft import DATA_FORMATS, SftConfig
from prl.config.validate import ConfigError, check, warn
from prl.control import vocab
from prl.control.envchecks import check_custom_loss, check_environments, check_tools_have_parser
from prl.control.modelfiles import hf_cache
from prl.control.moechecks import check_moe
from prl.run import lora

TEST_ONLY_TIMEOUT_S = 10.0
"""Limit for `sbatch --test-only`; a slow or broken controller must not block a submission."""
PSEUDO_FILE_SYSTEMS = ("/proc", "/sys", "/dev")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}", re.ASCII)
"""Hugging Face repo ids: optional `org/`, then the name; `--` and `..` are refused separately."""


def check_before_submit(cfg: Config, text: str, *, local: bool) -> None:
    """Every pre-submit check, cheapest first; the first failure raises."""
    check_output_dir(cfg)
    envref.check_set(cfg, os.environ)  # the job takes them from this shell's environment
    if cfg.run.mode == "train":  # probe mode loads neither the model nor the environment
        check_model(cfg.model, job_environ(cfg))
        if cfg.sft is not None:
            check_sft_data(cfg.sft)
        else:
            check_environments(cfg)
            check_custom_loss(cfg.trainer.loss)
            check_tool_parser(cfg.inference.tool_call_parser)
            check_tools_have_parser(cfg)
            check_teacher(cfg, job_environ(cfg))
        check_moe(cfg, hf_cache(job_environ(cfg)))
    if not local:
        check_with_scheduler(text)


def glob_character(path) -> str | None:
    """The first of `*?[` in `path`, else None. vLLM's loader finds a directory's weights with
    glob(DIR/*.safetensors), so any of them makes DIR a pattern that matches no weights ('[' opens a
    character class): the model fails to load at start, a weight version at its first update."""
    return next((c for c in "*?[" if c in str(path)), None)


def check_output_dir(cfg: Config) -> None:
    """The run directory can be created: no file in its way, a writable directory, real storage."""
    run_dir = cfg.run.run_dir
    real = os.path.realpath(run_dir)
    for top in PSEUDO_FILE_SYSTEMS:
        check(real != top and not real.startswith(top + "/"), "run.output_dir",
              f"{cfg.run.output_dir} is under {top}, a kernel file system, not storage")
    if magic := glob_character(run_dir):  # seen on an H200: version 1 failed to load mid-run
        key = "run.name" if magic in cfg.run.name else "run.output_dir"
        check(False, key, f"{run_dir} contains {magic!r}: vLLM reads a weight version's directory as a glob "
                          "pattern, and would find no weights in it")
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    key = "run.name" if existing == run_dir else "run.output_dir"
    check(existing.is_dir(), key, f"{existing} is a file, not a directory")
    check(os.access(existing, os.W_OK | os.X_OK), key, f"{existing} is not writable")


def check_sft_data(sft: SftConfig) -> None:
    """`sft.data` is a saved dataset or a file of a known format; a JSON Lines file's first row holds
    a list of messages under `sft.messages_key` (the other formats are read by the job itself)."""
    path = Path(sft.data)
    if path.is_dir():
        check((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file(), "sft.data",
              f"{path} is a directory but not one written by datasets' save_to_disk")
        return
    check(path.is_file(), "sft.data", f"no such file: {path}")
    check(path.suffix in DATA_FORMATS, "sft.data", f"{path.name}: a {', '.join(DATA_FORMATS)} file or a saved "
          "datasets directory is expected")
    if path.suffix != ".jsonl":
        return
    with path.open() as f:
        first = next((line for line in f if line.strip()), None)
    check(first is not None, "sft.data", f"{path} holds no rows")
    try:
        row = json.loads(first)
    except ValueError as e:
        raise ConfigError(f"sft.data: {path}: the first row is not JSON ({e})") from None
    messages = row.get(sft.messages_key) if isinstance(row, dict) else None
    check(isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages),
          "sft.messages_key", f"{path}'s first row has no list of {{role, content}} messages under "
          f"{sft.messages_key!r} (its keys: {', '.join(row) if isinstance(row, dict) else type(row).__name__})")


def job_environ(cfg: Config) -> dict[str, str]:
    """The variables the model loaders see: ours, then the config's (the job exports those)."""
    return {**os.environ, **envref.resolve(cfg.env, os.environ, "env"),
            **envref.resolve(cfg.inference.env, os.environ, "inference.env")}


TOOL_PARSER_REGISTRIES = ("tool_parsers/__init__.py", "entrypoints/openai/tool_parsers/__init__.py")
"""Where vLLM lists its tool-call parsers (`_TOOL_PARSERS_TO_REGISTER`), newest layout first."""


def vllm_tool_parsers() -> set[str] | None:
    """The tool-call parser names the installed vLLM registers, read from its source: importing vLLM
    takes seconds and a GPU stack. None: unknown (no vLLM where prl submit runs, or another layout)."""
    spec = find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for registry in (Path(root) / rel for rel in TOOL_PARSER_REGISTRIES):
            if not registry.is_file():
                continue
            for node in ast.walk(ast.parse(registry.read_text())):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_TOOL_PARSERS_TO_REGISTER"
                                                        for t in node.targets):
                    return set(ast.literal_eval(node.value))
    return None


def check_tool_parser(name: str | None) -> None:
    if name is None:
        return
    known = vllm_tool_parsers()
    if known is None:
        warn(f"inference.tool_call_parser={name}: no vLLM here to check it against; the servers check it at start")
        return
    close = difflib.get_close_matches(name, sorted(known), n=1)
    check(name in known, "inference.tool_call_parser",
          f"{name!r} is not a tool-call parser of the installed vLLM" + (f"; did you mean {close[0]!r}?" if close else "")
          + f" (it has {len(known)}: {', '.join(sorted(known))})")


def check_model(model: ModelConfig, environ: dict[str, str], key: str = "model.name") -> None:
    """A local directory with config and tokenizer, or a well-formed hub id (cached, when offline);
    `key`: the config key that names it (teacher.model: a ModelConfig of the teacher's name)."""
    path = Path(os.path.expanduser(model.name))
    if path.is_dir():
        check(not lora.is_adapter_version(path), key,
              f"{path} holds LoRA adapters (an RL run's policy version), not a model: name its base model "
              "(adapter_config.json: base_model_name_or_path); an SFT job's versions are whole models")
        check((path / "config.json").is_file(), key, f"{path} has no config.json")
        check(any((path / f).is_file() for f in TOKENIZER_FILES), key,
              f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)})")
        full = os.path.abspath(path)
        check(not (magic := glob_character(full)), key, f"{full} contains {magic!r}: vLLM reads the model's "
                                                        "directory as a glob pattern, and would find no weights in it")
        return
    looks_like_path = model.name.startswith(("/", "./", "../", "~")) or path.exists()
    check(not looks_like_path, key, f"no such model directory: {model.name}")
    ok = HUB_ID.fullmatch(model.name) and "--" not in model.name and ".." not in model.name
    check(bool(ok), key, f"{model.name!r} is neither a model directory (here: {os.getcwd()}) "
          "nor a Hugging Face id (org/name)")
    if offline(environ):
        cache = hf_cache(environ)
        snapshots = cache / f"models--{model.name.replace('/', '--')}" / "snapshots"
        found = snapshots.is_dir() and any((s / "config.json").exists() for s in snapshots.iterdir())
        check(found, key, f"{model.name} is not in the Hugging Face cache {cache}, and offline mode "
              "(HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE) forbids downloading it")


def check_teacher(cfg: Config, environ: dict[str, str]) -> None:
    """The teacher's model as the student's is checked, and its tokenizer against the student's
    (prl.control.vocab): the teacher scores the student's token ids as its own."""
    if cfg.teacher is None:
        return
    check_model(dataclasses.replace(cfg.model, name=cfg.teacher.model), environ, "teacher.model")
    if problem := vocab.mismatch(cfg.model.name, cfg.teacher.model, hf_cache(environ)):
        raise ConfigError(f"teacher.model: {problem}")


def offline(environ: dict[str, str]) -> bool:
    flags = (environ.get("HF_HUB_OFFLINE", ""), environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(v.strip().upper() in ("1", "ON", "YES", "TRUE") for v in flags)


SBATCH_KEYS = (("account", "slurm.account"), ("qos", "slurm.qos"), ("partition", "slurm.partition"),
               ("time limit", "slurm.time"), ("feature", "slurm.constraint"), ("constraint", "slurm.constraint"),
               ("gres", "inference.gpus_per_node/trainer.gpus_per_node"),
               ("node configuration", "inference.gpus_per_node/trainer.gpus_per_node/orchestrator.cpus"),
               ("node", "inference.nodes/trainer.nodes"), ("memory", "slurm.extra_sbatch"), ("mem", "slurm.extra_sbatch"))
"""Words of sbatch's refusals -> the key most likely at fault (first match wins)."""


UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused",
               "communication connection failure")
"""sbatch's words for a controller that did not answer (as opposed to one that objected)."""


def check_with_scheduler(text: str, timeout_s: float = TEST_ONLY_TIMEOUT_S) -> None:
    """`sbatch --test-only` of the script: the scheduler's objections (unknown partition or account,
    more nodes than exist) now rather than after the real submit. Skipped without sbatch."""
    if shutil.which("sbatch") is None:
        return
    try:
        r = subprocess.run(["sbatch", "--test-only"], input=text, capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError) as e:
        reason = f"no answer within {timeout_s:.0f}s" if isinstance(e, subprocess.TimeoutExpired) else str(e)
        warn(f"sbatch --test-only: {reason}; the scheduler's objections, if any, will come at submit")
        return
    if r.returncode == 0:
        return
    said = r.stderr.lower()
    # Only the scheduler's own refusal is bad input; a controller that is down or a client that is not
    # configured (no slurm.conf here) leaves the answer unknown.
    refused = "batch job submission failed" in said or "allocation failure" in said
    if not refused or any(w in said for w in UNREACHABLE):
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        warn(f"sbatch --test-only: {last}; the scheduler's objections, if any, will come at submit")
        return
    errors = [line.strip() for line in r.stderr.splitlines() if line.strip()] or [f"exit status {r.returncode}"]
    message = errors[0].removeprefix("sbatch: error: ")
    words = " ".join(errors).lower()
    key = next((k for word, k in SBATCH_KEYS if word in words), "slurm")
    raise ConfigError(f"{key}: sbatch --test-only refused the job: {message}")
