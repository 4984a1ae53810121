"""Secrets through the job's environment: `${oc.env:NAME}` is never resolved at submit.

    env:
      HF_TOKEN: ${oc.env:HF_TOKEN}                 # the value of HF_TOKEN in the job's environment
      AUTH: Bearer ${oc.env:TOKEN}                 # inside a larger string
      WANDB_API_KEY: ${oc.env:MY_WANDB_KEY,none}   # a default when MY_WANDB_KEY is unset
      KEY: ${oc.env:A,${oc.env:B}}                 # a default that is another reference
    slurm: {setup: ["huggingface-cli login --token ${oc.env:HF_TOKEN}"]}
    orchestrator: {environment: {id: my_env, args: {judge_key: "${oc.env:JUDGE_KEY}"}}}

A reference stays one wherever it stands in a position resolved at run time (RUNTIME): the four env
sections, the `setup` lines of `slurm` and of the components' `slurm`, and the args of every
environment. Loading escapes each reference there (`keep_references`), so OmegaConf never resolves it:
RUN/config.yaml, job.sbatch, `--dry-run`, the W&B run config and every log show the reference. SLURM
hands the submitting shell's environment to the job, so the variable travels there without being
written, and the process that needs the value resolves it from its own environment: the batch script
exports an env section's values as shell expansions (`bash_value`), a setup line runs with each
reference as the shell's `${NAME}` (`shell_line`), the launchers and the inference server resolve
the env sections (`resolve`), the orchestrator an environment's args (`resolve_args`). A reference
to a variable that is unset and has no default is refused at submit (`check_set`) and on the node.

Anywhere else prl reads the value at submit (a number, a path it creates, an #SBATCH line) and would
write it where others see it: a reference there is refused, naming the key. Pass such a value itself
(`prl submit C run.output_dir=$SCRATCH/runs`: the shell expands it, it is no secret).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterator, Mapping
from typing import Any, Union

from prl.config.validate import ConfigError

SECTIONS = ("env", "inference.env", "trainer.env", "orchestrator.env")
START = "${oc.env:"
_COMPONENT = r"(?:(?:inference|trainer|orchestrator)\.)?"
RUNTIME = re.compile(
    rf"{_COMPONENT}env\.[^.\[]+"                                       # an env section's value
    rf"|{_COMPONENT}slurm\.setup\[\d+\]"                               # a setup line
    r"|orchestrator\.(?:environment|environments\[\d+\]|eval\.environments\[\d+\])\.args[.\[].+")  # env args
"""Config paths where a reference stays one: prl resolves it at run time, in the process that needs it."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NOT_HERE = ("${oc.env:...} is resolved only at run time, in env sections, slurm setup lines and environment "
            "args; prl reads this value at submit and would write it in clear: give the value itself")


@dataclasses.dataclass(frozen=True)
class Ref:
    """One `${oc.env:NAME[,default]}`; `default` holds literal text and nested references."""
    name: str
    default: list[Part] | None


Part = Union[str, Ref]


def parse(text: str, where: str) -> list[Part]:
    """`text` as literal parts and references; ConfigError naming `where` for a malformed reference."""
    parts: list[Part] = []
    i = 0
    while (j := text.find(START, i)) != -1:
        if j > i:
            parts.append(text[i:j])
        end = _close(text, j, where)
        parts.append(_ref(text[j + len(START):end], where))
        i = end + 1
    return parts + ([text[i:]] if i < len(text) else [])


def _close(text: str, start: int, where: str) -> int:
    """Index of the `}` that closes the `${` at `start` (nested `${...}` counted)."""
    depth, k = 0, start
    while k < len(text):
        if text.startswith("${", k):
            depth, k = depth + 1, k + 2
            continue
        if text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    raise ConfigError(f"{where}: unterminated {START}...}} reference in {text!r}")


def _ref(body: str, where: str) -> Ref:
    name, comma, default = body.partition(",")
    if not _NAME.fullmatch(name.strip()):
        raise ConfigError(f"{where}: {START}{body}}} does not name a variable ([A-Za-z_][A-Za-z0-9_]*)")
    if not comma:
        return Ref(name.strip(), None)
    default = default.strip()
    if len(default) >= 2 and default[0] == default[-1] and default[0] in "'\"":
        default = default[1:-1]  # OmegaConf's quoted default
    parts = parse(default, where)
    if any(isinstance(p, str) and "${" in p for p in parts):
        raise ConfigError(f"{where}: only another {START}...}} may stand in a reference's default, got {default!r}")
    return Ref(name.strip(), parts)


def has_reference(value: Any) -> bool:
    return isinstance(value, str) and START in value


# --- loading: keep references, refuse them where prl reads the value at submit -----------------------
def keep_references(layer: Any, path: str = "") -> Any:
    """A config layer (plain YAML data) with every reference escaped so that OmegaConf keeps it as
    text; ConfigError naming the key for one outside RUNTIME or malformed."""
    if isinstance(layer, dict):
        for key, value in layer.items():
            layer[key] = keep_references(value, f"{path}.{key}" if path else str(key))
    elif isinstance(layer, list):
        layer[:] = [keep_references(item, f"{path}[{i}]") for i, item in enumerate(layer)]
    elif has_reference(layer):
        _check_position(path, layer)
        # OmegaConf reads `\\${` as a backslash and an interpolation it would resolve.
        if f"\\{START}" in layer:
            raise ConfigError(f"{path}: a backslash before {START} is ambiguous (OmegaConf would resolve it)")
        return layer.replace(START, "\\" + START)
    return layer


def _check_position(path: str, value: str) -> None:
    if not RUNTIME.fullmatch(path):
        raise ConfigError(f"{path}: {NOT_HERE}")
    parse(value, path)
    # RUN/config.yaml is written through OmegaConf, which parses the text as an interpolation.
    from omegaconf import OmegaConf
    from omegaconf.errors import GrammarParseError

    try:
        OmegaConf.create({"value": value})
    except GrammarParseError as e:
        raise ConfigError(f"{path}: {value!r} is not a reference OmegaConf can read ({str(e).splitlines()[0]})") from None


def references(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, value) of every string holding a reference in a config tree (dataclasses, dicts, lists)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from references(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from references(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from references(item, f"{path}[{i}]")
    elif has_reference(node):
        yield path, node


def check_positions(cfg: Any) -> None:
    """After merging: no reference reached a key outside RUNTIME (through an interpolation `${a.b}`)."""
    for path, value in references(cfg):
        _check_position(path, value)


# --- run time: each process resolves what it needs from its own environment ----------------------------
def substitute(text: str, environ: Mapping[str, str], where: str) -> str:
    """`text` with every reference replaced from `environ`; ConfigError naming `where` for a variable
    that is unset and has no default."""
    return "".join(p if isinstance(p, str) else _value(p, environ, where, text) for p in parse(text, where))


def _value(ref: Ref, environ: Mapping[str, str], where: str, text: str) -> str:
    if ref.name in environ:
        return environ[ref.name]
    if ref.default is not None:
        return "".join(p if isinstance(p, str) else _value(p, environ, where, text) for p in ref.default)
    raise ConfigError(f"{where}: {text} but {ref.name} is not set in this environment")


def resolve(env: Mapping[str, Any], environ: Mapping[str, str], where: str) -> dict[str, str]:
    """An env section's values with every reference replaced from `environ`."""
    return {key: substitute(str(value), environ, f"{where}.{key}") for key, value in env.items()}


def resolve_args(node: Any, environ: Mapping[str, str], where: str) -> Any:
    """An environment's args (nested dicts and lists) with every reference replaced from `environ`:
    what the orchestrator passes to `load_environment`, never what it writes."""
    if isinstance(node, dict):
        return {k: resolve_args(v, environ, f"{where}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_args(v, environ, f"{where}[{i}]") for i, v in enumerate(node)]
    return substitute(node, environ, where) if has_reference(node) else node


def check_set(cfg: Any, environ: Mapping[str, str]) -> None:
    """At submit: every reference without a default names a variable set here (the job inherits it)."""
    for path, value in references(cfg):
        substitute(value, environ, path)


def bash_value(key: str, value: Any, where: str) -> str:
    """`value` as one word for `export KEY=...` in a batch script: literal text quoted, each reference
    a shell expansion that the node resolves (and that stops the script, naming the key, when the
    variable is unset and has no default)."""
    text, path = str(value), f"{where}.{key}"
    if not has_reference(text):
        return shlex.quote(text)
    return "".join(shlex.quote(p) if isinstance(p, str) else f'"{_expansion(p, path)}"' for p in parse(text, path))


def shell_line(line: str, where: str) -> str:
    """A setup line with each reference as the shell's own expansion of the variable (`${NAME}`,
    `${NAME-default}`, or `${NAME?message}` that fails the line when it is unset), so that the value
    is read on the node and the written script holds the name only; quote it as you would `$NAME`."""
    if not has_reference(line):
        return line
    return "".join(p if isinstance(p, str) else _expansion(p, where) for p in parse(line, where))


def _expansion(ref: Ref, where: str) -> str:
    """`${NAME-default}` or `${NAME?message}` (bash: `-` keeps a variable set to "", as oc.env does)."""
    if ref.default is None:
        return f"${{{ref.name}?{_dq(f'{where}: {ref.name} is not set in the job environment')}}}"
    return f"${{{ref.name}-{''.join(_dq(p) if isinstance(p, str) else _expansion(p, where) for p in ref.default)}}}"


def _dq(text: str) -> str:
    """Text safe inside a ${...} word, quoted or not."""
    return re.sub(r'([\\"$`}])', r"\\\1", text)
