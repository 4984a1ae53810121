"""Pre-submit checks (prl.control.checks): each mistake that used to fail only after the queue wait is
refused by `prl submit --dry-run` with exit 2, one line naming the key, and nothing written."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, TOY, fake_commands, prl, tiny_model_dir

from prl.config import ConfigError, EnvironmentConfig, LossConfig, ModelConfig, load_config
from prl.config.validate import check_slurm_time
from prl.control import checks, envchecks, moechecks
from prl.control.modelfiles import hf_cache

MATH = str(ROOT / "configs/hendrycks_math.yaml")
CACHE = hf_cache(dict(os.environ))
"""The HF cache the MoE checks read here, as prl submit passes it (no hub model is in it)."""


def model_dir(path: Path, files=("config.json", "tokenizer.json")) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for f in files:
        (path / f).write_text("{}")
    return path


REFUSED = [
    (["model.name=/nonexistent"], "model.name: no such model directory: /nonexistent"),
    (["model.name=Qwen/Qwen2.5--1.5B"], "model.name: 'Qwen/Qwen2.5--1.5B' is neither a model directory"),
    (["orchestrator.environment.id=prl.envs.revrse_text"],
     "orchestrator.environment.id: no module named 'prl.envs.revrse_text'; did you mean prl.envs.reverse_text?"),
    (["orchestrator.environment.args.dataset_nme=x"],
     "orchestrator.environment.args.dataset_nme: not a parameter of prl.envs.hendrycks_math.load_environment"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: prl.envs.toy}, {id: prl.envs.tyo}]"],
     "orchestrator.environments[1].id: no module named 'prl.envs.tyo'; did you mean prl.envs.toy?"),
    (["orchestrator.environment=null",
      "orchestrator.environments=[{id: prl.envs.toy}, {id: prl.envs.reverse_text, args: {text_ky: t}}]"],
     "orchestrator.environments[1].args.text_ky: not a parameter of prl.envs.reverse_text.load_environment"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: prl.envs.toy}, {id: prl.envs.calculator}]"],
     "inference.tool_call_parser: orchestrator.environments[1] (prl.envs.calculator) gives the model tools "
     "(StatefulToolEnv in its source), and the servers have no parser of tool calls: set vLLM's parser"),
    (["orchestrator.eval.environments=[{id: prl.envs.calculator}]"],
     "inference.tool_call_parser: orchestrator.eval.environments[0] (prl.envs.calculator) gives the model tools"),
    (["orchestrator.eval.environments=[{id: prl.envs.reverse_text, args: {eval_splt: test}}]"],
     "orchestrator.eval.environments[0].args.eval_splt: not a parameter of prl.envs.reverse_text.load_environment"),
    (["slurm.time=1h"], "slurm.time: '1h' is not a SLURM time"),
    (["slurm.extra_sbatch=[--mem=lots]"], "slurm.extra_sbatch[0]: 'lots' is not a SLURM memory size"),
    (["run.output_dir=/proc/prl"], "run.output_dir: /proc/prl is under /proc"),
    (["trainer.loss.type=custom", "trainer.loss.custom=no_such_prl_loss:f"],
     "trainer.loss.custom: no module named 'no_such_prl_loss'"),
    (["trainer.loss.type=custom", "trainer.loss.custom=prl.trainer.loss:nope"],
     "trainer.loss.custom: prl.trainer.loss ("),
    (["trainer.loss.type=custom", "trainer.loss.custom=not-a-path"], "trainer.loss.custom: must be an import path"),
    (["trainer.clip_low=-0.1"], "trainer.loss.clip_low: must be >= 0"),
    (["orchestrator.sampling.top_p=0.95"], "orchestrator.sampling.top_p: must be 1 or unset, got 0.95"),
    (["orchestrator.sampling.extra_body.top_k=20"], "orchestrator.sampling.extra_body.top_k: must be -1 or unset"),
    (["orchestrator.sampling.extra_body.min_p=0.05"], "orchestrator.sampling.extra_body.min_p: must be 0 or unset"),
    (["trainer.micro_batch_tokens=1024"], "trainer.micro_batch_tokens: 1024 is less than model.max_model_len=4096"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[o[0] for o, _ in REFUSED])
def test_dry_run_refuses_before_writing(tmp_path, overrides, message):
    out = tmp_path / "out"
    r = prl("submit", MATH, "--dry-run", f"run.output_dir={out}", *overrides, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"prl: error: {message}" + r.stderr.split(message, 1)[1]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not out.exists() and r.stdout == ""


def test_output_dir_that_is_a_file_or_not_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = load_config(MATH, [f"run.output_dir={tmp_path / 'file' / 'sub'}"])
    with pytest.raises(ConfigError, match=r"^run\.output_dir: .*/file is a file, not a directory$"):
        checks.check_output_dir(cfg)
    cfg = load_config(MATH, [f"run.output_dir={tmp_path}", "run.name=file"])
    with pytest.raises(ConfigError, match=r"^run\.name: .*/file is a file"):
        checks.check_output_dir(cfg)
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        cfg = load_config(MATH, [f"run.output_dir={tmp_path / 'ro' / 'x'}"])
        with pytest.raises(ConfigError, match="is not writable"):
            checks.check_output_dir(cfg)


@pytest.mark.parametrize("name,output_dir,key", [("exp[1]", "runs", "run.name"), ("a", "runs[2]", "run.output_dir"),
                                                  ("what?", "runs", "run.name"), ("a", "r*", "run.output_dir")])
def test_a_run_directory_vllm_would_read_as_a_glob_pattern_is_refused(tmp_path, name, output_dir, key):
    cfg = load_config(MATH, [f"run.output_dir={tmp_path / output_dir}", f"run.name={name}"])
    with pytest.raises(ConfigError, match=rf"^{key}: .* contains '.': vLLM reads a weight version's directory as a glob"):
        checks.check_output_dir(cfg)
    checks.check_output_dir(load_config(MATH, [f"run.output_dir={tmp_path / 'runs]'}", "run.name=a]"]))  # no pattern
    bracketed = model_dir(tmp_path / "qwen[1.5b]")
    with pytest.raises(ConfigError, match=r"^model\.name: .*qwen\[1\.5b\] contains '\[': vLLM reads the model's directory"):
        checks.check_model(ModelConfig(name=str(bracketed)), {})


def test_model_directory_needs_config_and_tokenizer(tmp_path):
    ok = model_dir(tmp_path / "ok")
    checks.check_model(ModelConfig(name=str(ok)), {})
    no_tok = model_dir(tmp_path / "no_tok", files=("config.json",))
    with pytest.raises(ConfigError, match=r"^model\.name: .* has no tokenizer"):
        checks.check_model(ModelConfig(name=str(no_tok)), {})
    with pytest.raises(ConfigError, match=r"^model\.name: .* has no config\.json"):
        checks.check_model(ModelConfig(name=str(model_dir(tmp_path / "empty", files=()))), {})
    adapters = model_dir(tmp_path / "step_3", files=("adapter_config.json", "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=r"^model\.name: .* holds LoRA adapters .* name its base model"):
        checks.check_model(ModelConfig(name=str(adapters)), {})


def test_the_tool_call_parser_is_one_the_installed_vllm_knows(monkeypatch, capsys):
    """Read from vLLM's own registry without importing vLLM; without vLLM here it is unknown, which
    is said, not taken for a refusal (nor for a pass of the check)."""
    checks.check_tool_parser("hermes")
    checks.check_tool_parser(None)
    with pytest.raises(ConfigError, match=r"^inference\.tool_call_parser: 'hermez' is not a tool-call parser "
                                          r"of the installed vLLM; did you mean 'hermes'\? \(it has \d+: .*hermes"):
        checks.check_tool_parser("hermez")
    monkeypatch.setattr(checks, "find_spec", lambda name: None)
    assert checks.vllm_tool_parsers() is None
    checks.check_tool_parser("hermez")
    assert "inference.tool_call_parser=hermez: no vLLM here to check it against" in capsys.readouterr().err


def test_hub_id_offline_must_be_cached(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    checks.check_model(ModelConfig(name="Qwen/Qwen2.5-0.5B-Instruct"), {})  # online: syntax only
    with pytest.raises(ConfigError, match=r"^model\.name: Qwen/Qwen2.5-0.5B-Instruct is not in the Hugging Face cache"):
        checks.check_model(ModelConfig(name="Qwen/Qwen2.5-0.5B-Instruct"), env)
    model_dir(tmp_path / "hf/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc")
    checks.check_model(ModelConfig(name="Qwen/Qwen2.5-0.5B-Instruct"), env)
    assert checks.hf_cache({"HF_HUB_CACHE": "/c"}) == Path("/c")


def test_environment_args_from_source_and_by_import(tmp_path, monkeypatch):
    pkg = tmp_path / "userenvs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('a package __init__ must not run in the control plane')\n")
    (pkg / "plain.py").write_text("def load_environment(n, k=1, *, mode='a'):\n    pass\n")
    (pkg / "kwargs.py").write_text("def load_environment(**kw):\n    pass\n")
    (pkg / "dynamic.py").write_text(textwrap.dedent("""
        import sys
        def _make():
            def load_environment(size=3):
                pass
            return load_environment
        load_environment = _make()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    envchecks.check_environment(EnvironmentConfig(id="userenvs.plain", args={"n": 1, "mode": "b"}))
    with pytest.raises(ConfigError, match=r"^orchestrator\.environment\.args: userenvs\.plain\.load_environment needs n$"):
        envchecks.check_environment(EnvironmentConfig(id="userenvs.plain", args={}))
    with pytest.raises(ConfigError, match=r"args\.x: not a parameter of .*\(accepts: n, k, mode\)"):
        envchecks.check_environment(EnvironmentConfig(id="userenvs.plain", args={"n": 1, "x": 2}))
    envchecks.check_environment(EnvironmentConfig(id="userenvs.kwargs", args={"anything": 1}))
    # defined at run time: the source cannot say, a subprocess imports it (and runs the package __init__)
    (pkg / "__init__.py").write_text("")
    envchecks.check_environment(EnvironmentConfig(id="userenvs.dynamic", args={"size": 2}))
    with pytest.raises(ConfigError, match=r"args\.colour: not a parameter .*\(accepts: size\)"):
        envchecks.check_environment(EnvironmentConfig(id="userenvs.dynamic", args={"colour": 2}))


def test_custom_loss_is_located_and_its_function_found_in_the_source_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "userlosses"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('a package __init__ must not run in the control plane')\n")
    (pkg / "plain.py").write_text("import torch\nfrom torch.nn.functional import mse_loss as borrowed\n"
                                  "def my_loss(inputs):\n    pass\nalias = my_loss\n")
    (pkg / "star.py").write_text("from somewhere_else import *\n")
    (pkg / "lazy.py").write_text("def __getattr__(name):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("userlosses.plain:my_loss", "userlosses.plain.my_loss", "userlosses.plain:alias",
                 "userlosses.plain:borrowed", "userlosses.star:anything", "userlosses.lazy:anything"):
        envchecks.check_custom_loss(LossConfig(type="custom", custom=path))
    with pytest.raises(ConfigError, match=r"^trainer\.loss\.custom: userlosses\.plain \(.*plain\.py\) defines no my_los$"):
        envchecks.check_custom_loss(LossConfig(type="custom", custom="userlosses.plain:my_los"))
    with pytest.raises(ConfigError, match=r"^trainer\.loss\.custom: no module named 'userlosses\.plane'"):
        envchecks.check_custom_loss(LossConfig(type="custom", custom="userlosses.plane:my_loss"))
    envchecks.check_custom_loss(LossConfig())  # not a custom loss: nothing to check
    assert "userlosses.plain" not in sys.modules  # located, never imported


def test_environment_import_that_hangs_is_not_blocking(tmp_path, monkeypatch, capsys):
    (tmp_path / "slowenv.py").write_text("import time\ntime.sleep(30)\nload_environment = lambda **kw: None\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    envchecks.check_environment(EnvironmentConfig(id="slowenv"), timeout_s=0.5)
    assert "importing slowenv took over" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["30", "0:30", "01:00:00", "2-0", "2-12:30", "1-00:00:00", "UNLIMITED", "infinite"])
def test_slurm_time_syntax_accepts(value):
    check_slurm_time(value, "slurm.time")


@pytest.mark.parametrize("value", ["1h", "", "1:2:3:4", "-1", "1-", "00:00:00", "1.5"])
def test_slurm_time_syntax_refuses(value):
    with pytest.raises(ConfigError, match=r"^slurm\.time: "):
        check_slurm_time(value, "slurm.time")


def fake_sbatch(tmp_path: Path, body: str) -> Path:
    return fake_commands(tmp_path / "bin", sbatch=body)


def test_scheduler_objection_names_the_key(tmp_path):
    bin_dir = fake_sbatch(tmp_path, 'echo "sbatch: error: invalid partition specified: gpux" >&2\n'
                                    'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2; exit 1')
    out = tmp_path / "out"
    r = prl("submit", MATH, "--dry-run", f"run.output_dir={out}", "slurm.partition=gpux", cwd=tmp_path, path_prefix=bin_dir)
    assert r.returncode == 2
    assert r.stderr == "prl: error: slurm.partition: sbatch --test-only refused the job: invalid partition specified: gpux\n"
    assert not out.exists()


def test_scheduler_that_hangs_does_not_block(tmp_path, monkeypatch, capsys):
    bin_dir = fake_sbatch(tmp_path, "sleep 30")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    checks.check_with_scheduler("#!/bin/bash\n", timeout_s=0.5)
    assert "sbatch --test-only: no answer within 0s" in capsys.readouterr().err


def test_scheduler_that_cannot_be_reached_does_not_block(tmp_path, monkeypatch, capsys):
    bin_dir = fake_sbatch(tmp_path, 'echo "sbatch: error: Batch job submission failed: Unable to contact slurm '
                                    'controller (connect failure)" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    checks.check_with_scheduler("#!/bin/bash\n")
    assert "Unable to contact slurm controller" in capsys.readouterr().err


def test_local_mode_checks_gpus_before_creating_anything(tmp_path):
    model = model_dir(tmp_path / "m")
    out = tmp_path / "out"
    r = prl("submit", str(ROOT / "configs/toy.yaml"), "--local", f"run.output_dir={out}", f"model.name={model}",
            "trainer.gpus_per_node=64", "orchestrator.batch_size=512", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("prl: error: inference.gpus_per_node/trainer.gpus_per_node: local mode needs 0 + 64 GPUs")
    assert not out.exists()


def test_dry_run_with_every_check_imports_no_rl_stack(tmp_path):
    """A custom loss too: its module (tests/custom_loss.py imports torch) is only located."""
    model = model_dir(tmp_path / "m")
    loss = "'trainer.loss.type=custom', 'trainer.loss.custom=custom_loss:reinforce'"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from prl.control.cli import main;"
            f"rc = main(['submit', {MATH!r}, '--dry-run', 'run.output_dir={tmp_path / 'out'}', 'model.name={model}', {loss}]);"
            "print(rc, [m for m in ('torch', 'vllm', 'transformers', 'verifiers') if m in sys.modules])")
    bin_dir = fake_sbatch(tmp_path, "exit 0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert r.stdout.splitlines()[-1] == "0 []", r.stderr


def test_tool_call_parser_auto_maps_the_model_family_to_a_parser_the_installed_vllm_has():
    from prl.inference.toolcalls import FAMILY_PARSERS, TEMPLATE_PARSERS, auto_parser

    assert auto_parser("qwen2", "...<tool_call>...") == "hermes" and auto_parser("qwen3_moe", None) == "hermes"
    assert auto_parser("qwen3_moe", "<tool_call>\n<function=add>") == "qwen3_coder"
    assert auto_parser("llama", "<|start_header_id|> <|python_tag|>") == "llama3_json"
    assert auto_parser("llama", "[INST]") is None  # Llama 2: no tool calls to parse
    assert auto_parser("mixtral", "") == "mistral" and auto_parser("gpt2", "") is None
    known = checks.vllm_tool_parsers()
    assert known is not None  # this checkout's venv has vLLM: every name auto picks is one it registers
    assert set(FAMILY_PARSERS.values()) | {p for _, p in TEMPLATE_PARSERS} <= known


def test_tool_call_parser_auto_is_resolved_at_submit_or_refused_in_one_line(tmp_path):
    """The tiny Qwen2 -> hermes, written into RUN/config.yaml (the servers' flag comes from it); a
    family without a mapping exits 2 naming the key, nothing written."""
    calc, out = str(ROOT / "configs/calculator.yaml"), tmp_path / "out"
    r = prl("submit", calc, f"run.output_dir={out}", f"model.name={ROOT / '.cache/tiny-qwen2'}",
            "inference.tool_call_parser=auto", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "inference.tool_call_parser: auto -> hermes" in r.stderr
    assert load_config(out / "calculator/config.yaml").inference.tool_call_parser == "hermes"
    gpt2 = model_dir(tmp_path / "gpt2")
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    r = prl("submit", calc, f"run.output_dir={tmp_path / 'refused'}", f"model.name={gpt2}",
            "inference.tool_call_parser=auto", "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "prl: error: inference.tool_call_parser: auto knows no tool-call parser for model_type 'gpt2' "
        f"({gpt2}); name vLLM's parser of its family"], r.stderr
    assert not (tmp_path / "refused").exists()


def test_model_experts_reads_the_expert_count_of_a_local_or_cached_config(tmp_path):
    from prl.control.modelfiles import model_experts
    cache = tmp_path / "hub"
    for config, want in (({"num_experts": 8}, 8), ({"num_local_experts": 4}, 4), ({"text_config": {"n_routed_experts": 64}}, 64),
                         ({"hidden_size": 64}, 0), ({"num_experts": None}, 0)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert model_experts(str(tmp_path), cache) == want, config
    (tmp_path / "config.json").write_text("{not json")
    assert model_experts(str(tmp_path), cache) is None
    assert model_experts("Qwen/Qwen3-30B-A3B", cache) is None  # no config here: unknown, not dense
    snapshot = cache / "models--Qwen--Qwen3-30B-A3B/snapshots/abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"num_experts": 128}))
    assert model_experts("Qwen/Qwen3-30B-A3B", cache) == 128  # a hub id in the cache: its snapshot's config


def test_an_moe_on_cpu_is_refused_as_one_data_parallel_server(tmp_path):
    """vLLM 0.32's CPU engines fail every request of a data-parallel MoE (all_gatherv): refused at submit,
    naming the key, nothing written; a server per node, a dense model or GPUs pass this check."""
    moe, out = tiny_model_dir("qwen3_moe"), tmp_path / "out"
    base = [f"model.name={moe}", "inference.nodes=2", "inference.multi_node=data_parallel", "slurm.fabric_isolated=true"]
    r = prl("submit", str(TOY), "--dry-run", f"run.output_dir={out}", *base, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("prl: error: inference.data_parallel: "), r.stderr
    assert "one data-parallel server of 2 engines" in r.stderr and "inference.multi_node=servers" in r.stderr
    assert r.stderr.count("\n") == 1 and not out.exists()
    for extra in (["inference.multi_node=servers"], ["inference.gpus_per_node=1"], [f"model.name={tiny_model_dir()}"]):
        moechecks.check_cpu_moe_data_parallel(load_config(TOY, [*base, *extra]), CACHE)


def test_trainer_expert_parallel_needs_experts_as_many_on_every_rank(tmp_path, capsys):
    """Refused at submit, naming the key, nothing written: a dense model, 8 experts over 3 ranks. 8 over
    2 passes; a hub id whose config is not here is unknown (a warning), not dense."""
    moe, out = tiny_model_dir("qwen3_moe"), tmp_path / "out"
    base = ["trainer.expert_parallel=true", "trainer.nodes=2"]
    three = [f"model.name={moe}", "trainer.nodes=3", "orchestrator.batch_size=48"]
    for extra, said in (([f"model.name={tiny_model_dir()}"], "is dense: it has no experts"),
                        (three, "8 experts per layer cannot be split evenly over 3")):
        r = prl("submit", str(TOY), "--dry-run", f"run.output_dir={out}", *base, *extra, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("prl: error: trainer.expert_parallel: "), r.stderr
        assert said in r.stderr and r.stderr.count("\n") == 1 and not out.exists()
    moechecks.check_trainer_expert_parallel(load_config(TOY, [*base, f"model.name={moe}"]), CACHE)
    moechecks.check_trainer_expert_parallel(load_config(TOY, [*base, "model.name=Qwen/Qwen3-30B-A3B"]), CACHE)
    assert "its experts are not checked" in capsys.readouterr().err


def test_expert_parallelism_is_refused_at_submit_where_it_cannot_run_and_passes_an_moe_on_two_gpus(tmp_path):
    """inference.expert_parallel: a dense model (its config.json has no expert count) and a server of one GPU are
    refused by `prl submit`, exit 2, one line naming the key, nothing written; the tiny MoE on two GPUs a server
    passes and RUN/config.yaml keeps the key."""
    out = tmp_path / "out"
    base = ["--dry-run", f"run.output_dir={out}", "inference.expert_parallel=true", "inference.gpus_per_node=2"]
    refused = (([f"model.name={tiny_model_dir('qwen3')}"], "is dense (no expert count in its config.json)"),
               ([f"model.name={tiny_model_dir('qwen3_moe')}", "inference.gpus_per_node=1"], "each server runs on one"))
    for extra, said in refused:
        r = prl("submit", str(TOY), *base, *extra, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("prl: error: inference.expert_parallel: "), r.stderr
        assert said in r.stderr and r.stderr.count("\n") == 1 and not out.exists()
    agrees = fake_sbatch(tmp_path, "exit 0")  # its --test-only: no cluster's GPUs decide here
    r = prl("submit", str(TOY), *base, f"model.name={tiny_model_dir('qwen3_moe')}", cwd=tmp_path, path_prefix=agrees)
    assert r.returncode == 0, r.stderr
    assert load_config(out / "toy/config.yaml").inference.expert_parallel


def test_expert_parallelism_with_a_model_whose_files_are_not_here_is_warned_not_taken_for_dense(tmp_path, capsys):
    """A hub id not in the cache: its experts are unknown, which is not "dense" (that would refuse an MoE the
    login node cannot see); a warning, and vLLM refuses a dense model at start."""
    cfg = load_config(TOY, ["model.name=Qwen/Qwen3-30B-A3B", "inference.gpus_per_node=2",
                            "inference.expert_parallel=true"])
    moechecks.check_inference_expert_parallel(cfg, tmp_path / "hub")
    assert "inference.expert_parallel: Qwen/Qwen3-30B-A3B's config is not on this node" in capsys.readouterr().err
    snapshot = tmp_path / "hub/models--Qwen--Qwen3-30B-A3B/snapshots/abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"hidden_size": 64}))  # cached, and dense
    with pytest.raises(ConfigError, match="^inference.expert_parallel: Qwen/Qwen3-30B-A3B is dense"):
        moechecks.check_inference_expert_parallel(cfg, tmp_path / "hub")


def test_an_eval_entry_written_as_a_training_one_is_checked_once(monkeypatch):
    """It is that environment (its ratio and over-long rule aside): checking it again would import the same
    package once more (3-9 s for a v1 one); an eval entry that differs in anything else is checked."""
    from prl.config import Config, EvalConfig, OrchestratorConfig, OverlongConfig, RunConfig

    checked, probed = [], []
    monkeypatch.setattr(envchecks, "check_environment", lambda env, path, run_env: checked.append(path))
    monkeypatch.setattr(envchecks, "v1_problems", lambda entries, timeout_s, run_env: probed.append(
        [path for _, path in entries]) or [None] * len(entries))
    calc = EnvironmentConfig(id="prl_calc_v1", api="v1", name="calc", args={"hermes_format": "m"}, ratio=2,
                             overlong=OverlongConfig(mode="mask"))
    evals = [EnvironmentConfig(id="prl_calc_v1", api="v1", name="calc", args={"hermes_format": "m"}),
             EnvironmentConfig(id="prl_calc_v1", api="v1", name="calc2", args={"hermes_format": "m"}),
             EnvironmentConfig(id="prl.envs.toy")]
    orch = OrchestratorConfig(environments=[EnvironmentConfig(id="prl.envs.toy", name="toy2"), calc],
                              eval=EvalConfig(environments=evals), batch_size=16, rollouts_per_example=2)
    cfg = Config(run=RunConfig(name="r"), model=ModelConfig(name="m"), orchestrator=orch)
    envchecks.check_environments(cfg)
    # The v1 entries in one probe (one interpreter per worker Python), the others one by one.
    assert probed == [["orchestrator.environments[1]", "orchestrator.eval.environments[1]"]]
    assert checked == ["orchestrator.environments[0]", "orchestrator.eval.environments[2]"]


def test_environments_are_refused_in_the_configs_order_whatever_the_kind(monkeypatch):
    """The v1 entries are probed first, all at once, but the first entry at fault in the config is the one
    named: here a v1 training entry before a bad eval entry of the other kind."""
    from prl.config import Config, EvalConfig, OrchestratorConfig, RunConfig

    def other(env, path, run_env):
        raise ConfigError(f"{path}.id: refused")

    monkeypatch.setattr(envchecks, "check_environment", other)
    monkeypatch.setattr(envchecks, "v1_problems", lambda entries, timeout_s, run_env: [
        ConfigError(f"{path}.args: refused") for _, path in entries])
    v1, toy = EnvironmentConfig(id="prl_calc_v1", api="v1", name="calc"), EnvironmentConfig(id="prl.envs.toy")
    for train, evaluated, named in ((v1, toy, "args"), (toy, v1, "id")):
        orch = OrchestratorConfig(environments=[train], eval=EvalConfig(environments=[evaluated]), batch_size=16,
                                  rollouts_per_example=2)
        with pytest.raises(ConfigError, match=rf"^orchestrator.environments\[0\].{named}: refused$"):
            envchecks.check_environments(Config(run=RunConfig(name="r"), model=ModelConfig(name="m"), orchestrator=orch))
