"""The config schema: shipped configs load, and each kind of bad input is refused naming its key."""

from pathlib import Path

import pytest

from prl.config import Config, ConfigError, load_config, to_yaml
from prl.control.submit import resolve

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "base.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_loads_resolves_and_round_trips(path, tmp_path):
    cfg = resolve(load_config(path))
    assert isinstance(cfg, Config)
    assert Path(cfg.run.output_dir).is_absolute()
    dumped = tmp_path / "config.yaml"
    dumped.write_text(to_yaml(cfg))
    assert load_config(dumped) == cfg


def test_defaults_compose_and_overrides_win():
    cfg = load_config(ROOT / "configs/hendrycks_math.yaml", ["trainer.nodes=4", "trainer.nodes=2", "slurm.partition=gpu"])
    assert cfg.trainer.nodes == 2  # later override wins
    assert cfg.slurm.partition == "gpu"
    assert cfg.slurm.time == "04:00:00"  # from base.yaml
    assert cfg.run.max_steps == 200  # the file wins over its defaults


BAD = [
    (["inference.weight_transfer=nccl"], "inference.weight_transfer"),
    (["trainer.nodez=2"], "trainer.nodez"),
    (["trainer.nodes=two"], "trainer.nodes"),
    (["trainer.nodes=0"], "trainer.nodes"),
    (["inference.tensor_parallel=3"], "inference.tensor_parallel"),
    (["orchestrator.batch_size=100"], "orchestrator.batch_size"),
    (["orchestrator.placement=somewhere"], "orchestrator.placement"),
    (["run.name=a/b"], "run.name"),
    (["trainer.env.1BAD=x"], "trainer.env.1BAD"),
    (["slurm.extra_sbatch=[mail-type=END]"], "slurm.extra_sbatch[0]"),
    (["trainer.nodes"], "trainer.nodes"),
    (["run.wandb.completions_per_step=-1"], "run.wandb.completions_per_step"),
    (["trainer.batch_poll_s=0"], "trainer.batch_poll_s"),
    (["trainer.prewarm=maybe"], "trainer.prewarm"),
    (["inference.replica_servers=yes please"], "inference.replica_servers"),
    (["inference.expert_parallel=maybe"], "inference.expert_parallel"),
    (["orchestrator.filter_zero_advantage=sometimes"], "orchestrator.filter_zero_advantage"),
    (["trainer.loss.type=ppo"], "trainer.loss.type"),
    (["trainer.loss.kl_tau=-0.001"], "trainer.loss.kl_tau"),
    (["trainer.loss.dppo_mask_high=-1"], "trainer.loss.dppo_mask_high"),
    (["trainer.loss.ratio_mask_low=1"], "trainer.loss.ratio_mask_low"),  # would mask the sampler's own
    (["trainer.loss.ratio_mask_low=0"], "trainer.loss.ratio_mask_low"),
    (["trainer.loss.ratio_mask_high=0.9"], "trainer.loss.ratio_mask_high"),
    (["trainer.loss.ratio_mask_high=inf"], "trainer.loss.ratio_mask_high"),
    (["trainer.loss.ratio_mask_high=wide"], "trainer.loss.ratio_mask_high"),
    (["trainer.loss.type=custom", "trainer.loss.custom=a:b", "trainer.loss.ratio_mask_high=5"],
     "trainer.loss.ratio_mask_high"),
    (["trainer.loss.custom=pkg.mod:fn"], "trainer.loss.custom"),  # without type=custom: unused
    (["trainer.loss.custom_args.x=1"], "trainer.loss.custom_args"),
    (["trainer.loss.type=custom"], "trainer.loss.custom"),
    (["trainer.loss.type=custom", "trainer.loss.custom=a:b:c"], "trainer.loss.custom"),
    (["trainer.loss.type=custom", "trainer.loss.custom=a:b", "trainer.loss.kl_tau=0.1"], "trainer.loss.kl_tau"),
    (["trainer.loss.type=custom", "trainer.loss.custom=a:b", "trainer.loss.custom_args.1x=1"],
     "trainer.loss.custom_args.1x"),
    (["trainer.behaviour_logprobs=vllm"], "trainer.behaviour_logprobs"),
    (["trainer.behaviour_logprobs=1"], "trainer.behaviour_logprobs"),
    (["trainer.behaviour_on_host=maybe"], "trainer.behaviour_on_host"),
    (["trainer.behaviour_on_host=true"], "trainer.behaviour_on_host"),  # vLLM's logprobs: nothing kept
    (["trainer.expert_parallel=true", "trainer.nodes=1", "trainer.gpus_per_node=1"], "trainer.expert_parallel"),
    (["trainer.expert_parallel=true", "trainer.nodes=2", "trainer.lora.rank=8"], "trainer.expert_parallel"),
    (["trainer.expert_parallel=true", "trainer.nodes=2", "trainer.offload=true"], "trainer.expert_parallel"),
    (["trainer.expert_parallel=maybe"], "trainer.expert_parallel"),
    (["orchestrator.environment.max_tokens=0"], "orchestrator.environment.max_tokens"),
    (["orchestrator.environment.max_tokens=long"], "orchestrator.environment.max_tokens"),
    (["orchestrator.environment.max_tokens=8", "orchestrator.environment.overlong.mode=penalty",
      "orchestrator.environment.overlong.buffer=8"], "orchestrator.environment.overlong.buffer"),
    (["orchestrator.continuous=sometimes"], "orchestrator.continuous"),
    (["orchestrator.continuous=true", "trainer.behaviour_logprobs=recompute"], "orchestrator.continuous"),
    (["orchestrator.continuous=true", "run.async_level=0"], "orchestrator.continuous"),
    (["trainer.micro_batch_tokens=0"], "trainer.micro_batch_tokens"),
    (["trainer.micro_batch_tokens=4095"], "trainer.micro_batch_tokens"),
    (["trainer.clip_high=-0.3"], "trainer.loss.clip_high"),
    (["orchestrator.sampling.top_p=0.99"], "orchestrator.sampling.top_p"),
    (["orchestrator.sampling.temperature=0"], "orchestrator.sampling.temperature"),
    (["orchestrator.sampling.extra_body.temperature=0.5"], "orchestrator.sampling.extra_body.temperature"),
    (["orchestrator.sampling.extra_body.repetition_penalty=1.1"], "orchestrator.sampling.extra_body.repetition_penalty"),
    (["orchestrator.sampling.extra_body.logit_bias={5: 10}"], "orchestrator.sampling.extra_body.logit_bias"),
    (["inference.tool_call_parser=hermes; rm"], "inference.tool_call_parser"),
    (["trainer.experts_implementation=fast"], "trainer.experts_implementation"),
    (["trainer.attention=fa3"], "trainer.attention"),
    (["trainer.lora.rank=-1"], "trainer.lora.rank"),
    (["trainer.lora.rank=8", "trainer.lora.alpha=0"], "trainer.lora.alpha"),
    (["trainer.lora.dropout=1"], "trainer.lora.dropout"),
    (["trainer.lora.target_modules=[]"], "trainer.lora.target_modules"),
    (["trainer.lora.target_modules=[q_proj, 'up proj']"], "trainer.lora.target_modules"),
    (["slurm.one_node=yes please"], "slurm.one_node"),
    (["slurm.one_node=true"], "slurm.hetjob"),  # het groups are not one allocation
    (["slurm.one_node=true", "slurm.hetjob=false", "trainer.nodes=2"], "trainer.nodes"),
    (["slurm.one_node=true", "slurm.hetjob=false", "inference.nodes=2", "inference.data_parallel=16"], "inference.nodes"),
    (["slurm.one_node=true", "slurm.hetjob=false", "orchestrator.placement=own_node"], "orchestrator.placement"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[k for _, k in BAD])
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/hendrycks_math.yaml", overrides)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_loss_and_budget_options_that_load():
    cfg = load_config(ROOT / "configs/hendrycks_math.yaml", [
        "trainer.loss.type=custom", "trainer.loss.custom=my_pkg.losses:my_loss", "trainer.loss.custom_args.scale=2",
        "trainer.micro_batch_tokens=4096", "orchestrator.sampling.extra_body.top_k=-1",
        "orchestrator.sampling.extra_body.temperature=1.0", "orchestrator.sampling.extra_body.ignore_eos=true"])
    assert (cfg.trainer.loss.custom, cfg.trainer.loss.custom_args) == ("my_pkg.losses:my_loss", {"scale": 2})
    assert cfg.trainer.micro_batch_tokens == 4096
    default = load_config(ROOT / "configs/hendrycks_math.yaml")
    assert (default.trainer.loss.type, default.trainer.loss.kl_tau, default.trainer.micro_batch_tokens) == ("clip", 0.0, 12288)
    assert load_config(ROOT / "configs/toy.yaml").trainer.micro_batch_tokens is None  # by count unless a config says


def test_moved_keys_are_read_at_their_old_place(tmp_path):
    """Every RUN/config.yaml written before trainer.loss existed sets trainer.clip_low and clip_high."""
    path = tmp_path / "c.yaml"
    path.write_text(f"defaults: [{ROOT / 'configs/toy.yaml'}]\ntrainer:\n  clip_low: 0.1\n  clip_high: 0.3\n")
    cfg = load_config(path)
    assert (cfg.trainer.loss.clip_low, cfg.trainer.loss.clip_high) == (0.1, 0.3)
    assert load_config(path, ["trainer.loss.clip_low=0.15"]).trainer.loss.clip_low == 0.15  # a later layer wins
    assert load_config(path, ["trainer.clip_high=0.5"]).trainer.loss.clip_high == 0.5
    assert "clip_low" not in to_yaml(cfg).split("loss:")[0]  # written back at the new place only
    path.write_text(f"defaults: [{ROOT / 'configs/toy.yaml'}]\ntrainer:\n  clip_low: 0.1\n  loss: {{clip_low: 0.2}}\n")
    with pytest.raises(ConfigError, match=r"^trainer\.clip_low: moved to trainer\.loss\.clip_low, which is set too \(in .*c\.yaml\)$"):
        load_config(path)


def test_missing_required_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: x, output_dir: /tmp}\norchestrator: {environment: {id: prl.envs.toy}}\n")
    with pytest.raises(ConfigError, match=r"^model: missing required value"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^model\.name: missing required value"):
        load_config(path, ["model.dtype=float32"])


def test_newline_in_a_value_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('defaults: [%s]\nslurm: {partition: "gpu\\n#SBATCH --x"}\n' % (ROOT / "configs/hendrycks_math.yaml"))
    with pytest.raises(ConfigError, match=r"^slurm\.partition: must be a single line"):
        load_config(path)


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


def test_defaults_cycle_is_reported(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


# --- several environments, evals -----------------------------------------------------------------

TOY = ROOT / "configs/toy.yaml"
TWO = ["orchestrator.environment=null",
       "orchestrator.environments=[{id: prl.envs.toy, ratio: 3}, {id: prl.envs.reverse_text, name: rev}]"]


def test_examples_split_by_largest_remainder():
    from prl.config import split_examples

    assert split_examples(8, [1.0]) == [8]
    assert split_examples(8, [3, 1]) == [6, 2]
    assert split_examples(8, [0.5, 0.3, 0.2]) == [4, 2, 2]  # 4, 2.4, 1.6: the one left over goes to .6
    assert split_examples(9, [1, 1, 1, 1]) == [3, 2, 2, 2]  # equal remainders: the earlier entry
    assert split_examples(7, [1e-9, 1]) == [0, 7]
    for per_step, ratios in [(64, [0.1, 0.7, 0.2]), (5, [2, 2, 1]), (1, [1, 1])]:
        counts = split_examples(per_step, ratios)
        assert sum(counts) == per_step
        assert all(abs(c - per_step * r / sum(ratios)) < 1 for c, r in zip(counts, ratios))


def test_several_environments_and_the_single_one():
    cfg = load_config(TOY, TWO)
    orch = cfg.orchestrator
    assert [e.label for e in orch.train_environments] == ["toy", "rev"] and orch.examples_per_env == [6, 2]
    assert orch.environment_paths == ["orchestrator.environments[0]", "orchestrator.environments[1]"]
    assert orch.eval_environments == orch.train_environments  # no eval environments of its own
    single = load_config(TOY).orchestrator
    assert single.train_environments == [single.environment] and single.examples_per_env == [8]


ENV_BAD = [
    (["orchestrator.environments=[{id: prl.envs.toy}]"], "orchestrator.environments: set orchestrator.environment"),
    (["orchestrator.environment=null"], "orchestrator.environment: missing required value"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: prl.envs.toy}, {id: prl.envs.toy}]"],
     "orchestrator.environments[1].name: 'toy' is already the name of orchestrator.environments[0]"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: prl.envs.toy, ratio: 20}, {id: x.y}]"],
     "orchestrator.environments[1].ratio: a ratio of 1 gives y none of the 8 examples of a step"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: a}, {id: b, ratio: 0}]"],
     "orchestrator.environments[1].ratio: must be a finite number > 0"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: a}, {id: b, ratoi: 2}]"],
     "orchestrator.environments[1].ratoi: unknown key; did you mean ratio?"),
    (["orchestrator.environment=null", "orchestrator.environments=[{id: a}, {id: 'b c'}]"],
     "orchestrator.environments[1].id: must be a Python module name"),
    (["orchestrator.environment.name=a/b"], "orchestrator.environment.name: must be letters, digits"),
    (["orchestrator.environment.ratio=.inf"], "orchestrator.environment.ratio: must be a finite number"),
    (["orchestrator.eval.interval=-1"], "orchestrator.eval.interval: must be >= 0"),
    (["orchestrator.eval.num_examples=0"], "orchestrator.eval.num_examples: must be -1 (all) or > 0"),
    (["orchestrator.eval.rollouts_per_example=0"], "orchestrator.eval.rollouts_per_example: must be > 0"),
    (["orchestrator.eval.sampling.top_p=0"], "orchestrator.eval.sampling.top_p: must be in (0, 1]"),
    (["orchestrator.eval.sampling.max_tokens=0"], "orchestrator.eval.sampling.max_tokens: must be > 0"),
    (["orchestrator.eval.environments=[{id: prl.envs.toy, ratio: 2}]"],
     "orchestrator.eval.environments[0].ratio: only training environments have ratios"),
    (["orchestrator.eval.environments={id: prl.envs.toy}"], "orchestrator.eval.environments: must be a list"),
]


@pytest.mark.parametrize("overrides,message", ENV_BAD, ids=[m.split(":")[0] for _, m in ENV_BAD])
def test_bad_environments_and_evals_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TOY, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
