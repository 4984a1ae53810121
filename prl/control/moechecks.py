"""The checks before submit that read a mixture-of-experts model's config (its expert count, from the
model's files on the login node: prl.control.modelfiles): what vLLM's CPU build cannot serve, and the
expert parallelism of the trainer and of the servers. A model whose files are not here is unknown, not
dense: a warning, and the programs' own checks at start."""

from __future__ import annotations

from pathlib import Path

from prl.config import Config
from prl.config.validate import check, warn
from prl.control.modelfiles import model_experts


def check_moe(cfg: Config, cache: Path) -> None:
    """Every check of this module (`cache`: the HF cache the job's programs read)."""
    check_cpu_moe_data_parallel(cfg, cache)
    check_trainer_expert_parallel(cfg, cache)
    check_inference_expert_parallel(cfg, cache)
    check_routing_replay(cfg, cache)


def check_cpu_moe_data_parallel(cfg: Config, cache: Path) -> None:
    """vLLM 0.32's CPU build cannot run an MoE data-parallel: with several engines in one server its MoE layers
    gather every engine's tokens (all_gatherv), which its CPU communicator lacks, and every request fails
    (NotImplementedError in the engine). Independent servers per replica run it."""
    inference = cfg.inference
    if inference.gpus_per_node or inference.replica_servers or not model_experts(cfg.model.name, cache):
        return
    engines = inference.data_parallel if inference.multi_node == "data_parallel" else inference.local_replicas
    check(engines <= 1, "inference.data_parallel",
          f"{cfg.model.name} is a mixture of experts, which vLLM's CPU build cannot run as one data-parallel "
          f"server of {engines} engines: run a server per node (inference.multi_node=servers) or per replica "
          "(inference.replica_servers=true)")


def check_trainer_expert_parallel(cfg: Config, cache: Path) -> None:
    """trainer.expert_parallel needs experts, as many on every trainer rank: read from the model's config.json
    where this node has it. A model whose files are not here (a hub id not in the cache) is unknown, not
    dense: a warning, and the trainer refuses it at start in one line naming the key if it must."""
    if not cfg.trainer.expert_parallel:
        return
    experts, ranks = model_experts(cfg.model.name, cache), cfg.trainer.world_size
    if experts is None:
        warn(f"trainer.expert_parallel: {cfg.model.name}'s config is not on this node: its experts are not checked")
        return
    check(experts > 0, "trainer.expert_parallel", f"{cfg.model.name} is dense: it has no experts to spread over "
          "the trainer's ranks")
    check(experts % ranks == 0, "trainer.expert_parallel",
          f"{cfg.model.name}'s {experts} experts per layer cannot be split evenly over {ranks} trainer ranks")


def check_inference_expert_parallel(cfg: Config, cache: Path) -> None:
    """inference.expert_parallel needs experts: vLLM refuses a dense model at start ("Number of experts in the
    model must be greater than 0 when expert parallelism is enabled"), after the queue wait. Where the model's
    config cannot be read here (a hub id not in this node's cache) its experts are unknown, and unknown is
    not dense: it passes with a warning, as check_cpu_moe_data_parallel lets it pass rather than guess, and
    vLLM refuses a dense one at start. The layout (GPUs, more than one rank a server) is the config's own
    check (InferenceConfig._check_expert_parallel)."""
    if not cfg.inference.expert_parallel or "inference" not in cfg.components:
        return
    experts = model_experts(cfg.model.name, cache)
    if experts is None:
        warn(f"inference.expert_parallel: {cfg.model.name}'s config is not on this node: its experts are not "
             "checked (vLLM refuses a dense model at start)")
        return
    check(experts > 0, "inference.expert_parallel", f"{cfg.model.name} is dense (no expert count in its "
          "config.json): it has no experts to spread over a server's GPUs")


def check_routing_replay(cfg: Config, cache: Path) -> None:
    """trainer.routing_replay needs experts, fewer than 255 a layer (the batch keeps their ids as uint8, 255
    for "none recorded", prl.trainer.replay.NONE). Unknown (the model's files not here) passes with a warning."""
    if not cfg.trainer.routing_replay:
        return
    experts = model_experts(cfg.model.name, cache)
    if experts is None:
        warn(f"trainer.routing_replay: {cfg.model.name}'s config is not on this node: its experts are not checked")
        return
    check(experts > 0, "trainer.routing_replay", f"{cfg.model.name} is dense: it has no routing to replay")
    check(experts < 255, "trainer.routing_replay", f"{cfg.model.name} has {experts} experts a layer; "
          "replay keeps expert ids as uint8 and handles at most 254")
