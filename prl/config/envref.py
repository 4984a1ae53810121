"""Secrets through the job's environment: `${oc.env:NAME}` in an `env` section is resolved where the
component starts, never at submit.

    env:
      HF_TOKEN: ${oc.env:HF_TOKEN}               # the value of HF_TOKEN in the job's environment
      WANDB_API_KEY: ${oc.env:MY_WANDB_KEY,none}  # with a default when MY_WANDB_KEY is unset

Elsewhere OmegaConf resolves `${oc.env:...}` while loading; in the four `env` sections (env,
inference.env, trainer.env, orchestrator.env) a value that is exactly such a reference stays one: it
is what RUN/config.yaml, job.sbatch and --dry-run show. SLURM hands the submitting shell's
environment to the job, so the variable travels there without being written; the batch script
exports it as a shell expansion on the node (`bash_value`), and every launcher and the inference
server resolve the sections with `resolve` from their own environment. A reference to a variable
that is unset and has no default is refused at submit (`check_set`) and on the node, naming the key.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from prl.config.validate import ConfigError

SECTIONS = ("env", "inference.env", "trainer.env", "orchestrator.env")
_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")


def reference(value: Any) -> tuple[str, str | None] | None:
    """(NAME, default or None) when `value` is exactly `${oc.env:NAME}` or `${oc.env:NAME,default}`."""
    m = _REF.fullmatch(value) if isinstance(value, str) else None
    return (m.group(1), None if m.group(2) is None else m.group(2).strip()) if m else None


def keep_references(layer: dict) -> dict:
    """A config layer (plain YAML data) whose env references OmegaConf will not resolve: escaped."""
    for path in SECTIONS:
        node = layer
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            for key, value in node.items():
                if reference(value) is not None:
                    node[key] = "\\" + value
    return layer


def resolve(env: Mapping[str, Any], environ: Mapping[str, str], where: str) -> dict[str, str]:
    """The section's values with every reference replaced from `environ`; ConfigError naming the key
    for a variable that is unset and has no default."""
    out = {}
    for key, value in env.items():
        if (ref := reference(value)) is None:
            out[key] = str(value)
        elif ref[0] in environ:
            out[key] = environ[ref[0]]
        elif ref[1] is not None:
            out[key] = ref[1]
        else:
            raise ConfigError(f"{where}.{key}: {value} but {ref[0]} is not set in this environment")
    return out


def check_set(sections: Mapping[str, Mapping[str, Any]], environ: Mapping[str, str]) -> None:
    """At submit: every reference without a default names a variable set here (the job inherits it)."""
    for where, env in sections.items():
        resolve(env, environ, where)


def bash_value(key: str, value: Any, where: str) -> str:
    """`value` for `export KEY=...` in the batch script: a reference becomes a shell expansion that
    the node resolves (and that stops the script, naming the key, when the variable is unset)."""
    if (ref := reference(value)) is None:
        return shlex.quote(str(value))
    name, default = ref
    if default is not None:
        return f'"${{{name}-{_dq(default)}}}"'
    return f'"${{{name}?{_dq(f"{where}.{key}: {name} is not set in the job environment")}}}"'


def _dq(text: str) -> str:
    """Text safe inside a double-quoted ${...} word."""
    return re.sub(r'([\\"$`}])', r"\\\1", text)
