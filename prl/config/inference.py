"""The `inference` section: the vLLM servers."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from prl.config.common import _check, _one_of, _positive
from prl.config.slurm import ComponentSlurm, _check_batch_options
from prl.config.validate import check_env_name

MULTI_NODE = ("servers", "data_parallel")
WEIGHT_TRANSFERS = ("filesystem", "broadcast")
EXPERT_PARALLEL_FLAGS = ("--enable-expert-parallel", "--no-enable-expert-parallel", "-ep")
"""vLLM 0.32's spellings of its expert-parallel switch (a BooleanOptionalAction, "-ep" its short form)."""


KNOWN_VARIABLES = frozenset(
    "PATH HOME USER LOGNAME SHELL PWD OLDPWD HOSTNAME HOST TERM LANG LANGUAGE TZ TMPDIR TMP TEMP MAIL DISPLAY "
    "EDITOR VISUAL PAGER PS1 PS2 IFS UID EUID PPID SHLVL MANPATH MODULEPATH CPATH LIBRARY_PATH PKG_CONFIG_PATH "
    "VIRTUAL_ENV CONDA_PREFIX CONDA_DEFAULT_ENV HF_HOME CUDA_VISIBLE_DEVICES MASTER_ADDR MASTER_PORT WORLD_SIZE "
    "RANK LOCAL_RANK PRL_RUN_DIR PRL_HOME PRL_PYTHON PRL_ATTEMPT PRL_LOG_DIR PRL_INFERENCE_URLS PRL_NODE_RANK "
    "PRL_GPU_SLICE PRL_INFERENCE_REPLICA PRL_COMPILE_CACHE PRL_WEIGHTS_ROOT".split())
"""Variables whose values are the system's, SLURM's or prl's wiring: known to, or guessable by, others."""
KNOWN_PREFIXES = ("LC_", "LD_", "XDG_", "SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SSH_", "BASH", "PYTHON")
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/root",
               "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/tmp")
"""Never a weights_root, nor anything under those of UNDER_SYSTEM: the system's files or everybody's."""
UNDER_SYSTEM = ("/boot", "/dev", "/etc", "/proc", "/root", "/run", "/sys")


def known_variable(name: str) -> bool:
    return name in KNOWN_VARIABLES or name.startswith(KNOWN_PREFIXES)


def wildcard(host: str) -> bool:
    """An address that binds every interface: 0.0.0.0, ::, and the shorthands inet_aton takes (0, 0.0)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        pass
    try:
        return socket.inet_aton(host) == bytes(4)
    except OSError:
        return False


def check_weights_root(root: str, private: list[Path]) -> None:
    """inference.weights_root is none of SYSTEM_DIRS, nothing under UNDER_SYSTEM, and neither one of the
    `private` directories (the run directory, the home directory) nor a parent of one (links resolved,
    as the server resolves them)."""
    real = os.path.realpath(os.path.expanduser(root))
    _check(real not in SYSTEM_DIRS and not any(real.startswith(d + "/") for d in UNDER_SYSTEM),
           "inference.weights_root", f"{root!r} is a system directory: name the directory that holds the weights")
    for directory in private:
        inner = os.path.realpath(directory)
        _check(inner != real and not inner.startswith(real.rstrip("/") + "/"), "inference.weights_root",
               f"{root!r} holds {directory} (the run's secret, keys): name the directory that holds the weights")


@dataclass(kw_only=True)
class InferenceConfig:
    nodes: int = 1
    """Nodes of the inference group (one server per node, unless multi_node is data_parallel)."""
    multi_node: str = "servers"
    """How several inference nodes serve: "servers" (each node an independent server with its own URL,
    the orchestrator spreads requests over them; one node failing to start does not stall the others)
    or "data_parallel" (vLLM's own data parallelism: the first node runs the one API endpoint and its
    engines, the others only engines, joined to it at DATA_PARALLEL_ADDRESS:DATA_PARALLEL_RPC_PORT;
    vLLM balances requests over every replica). Only with nodes > 1; data_parallel also needs
    slurm.fabric_isolated (vLLM's sockets between the nodes authenticate nobody)."""
    gpus_per_node: int = 1
    """GPUs per inference node; 0 for CPU-only vLLM."""
    cpus_per_node: int | None = None
    """CPUs per inference node (--cpus-per-task); None: SLURM's default."""
    tensor_parallel: int = 1
    """Tensor-parallel size of one replica."""
    data_parallel: int | None = None
    """Number of replicas in total. Unset: derived from the layout, nodes x gpus_per_node x
    servers_per_gpu / tensor_parallel; set, it must equal that. On CPU (gpus_per_node 0) with
    replica_servers it is free (the replicas split the node's cores), unset one a node."""
    replica_servers: bool | None = None
    """Run each replica of a node (data_parallel / nodes of them, tensor_parallel GPUs each) as an
    independent vLLM server on a port of its own (port, port + 1, ...) and a URL of its own, the
    orchestrator spreading requests over them, instead of one server with vLLM's data parallelism.
    Each then takes vLLM's single-replica path: its one front end in the server process, the model in
    the engine process, none of the extra interpreters data parallelism starts (docs/performance.md).
    Not with multi_node=data_parallel. On CPU (gpus_per_node 0) the replicas share the node's cores;
    on GPUs each server runs with one torch thread (OMP_NUM_THREADS=1 unless env sets it). Unset:
    derived, true where servers_per_gpu > 1 (servers that share a GPU are servers of their own), else false."""
    servers_per_gpu: int = 1
    """vLLM servers sharing each inference GPU; data_parallel and replica_servers follow from it, and
    each server takes gpu_memory_utilization / servers_per_gpu of its GPU. For a model small enough
    that one engine is bound by its engine core's CPU thread rather than its GPU: at 1.5B, 256 x 1,024
    tokens, that thread ran at 96 % of a core while the GPU was busy 39 % of the time
    (docs/performance.md, "The 1 + 1 loop second by second"); another engine's steps can use the rest.
    Two on the vLLM GPU of a 1 + 1 loop kept it busy 100 % of the time and took a step from 11.23 to
    8.05 s on one 2 x H200 host ("Two vLLM servers on the vLLM GPU"; configs/one_node_2gpu.yaml). Filesystem
    weight transfer only (NCCL takes one rank per GPU); tensor_parallel 1; each server's KV cache set
    in extra_args (--kv-cache-memory-bytes), since they start together."""
    port: int = 8000
    """HTTP port of each server (with replica_servers, of a node's first; the others count up from it)."""
    host: str = "auto"
    """Address each server listens on. "auto": under SLURM the address of the node's name (the one
    PRL_INFERENCE_URLS names), in local mode and for servers of one machine 127.0.0.1; else one
    address of the node. A wildcard (0.0.0.0, ::) is refused: it listens on every interface, those
    other networks reach too. Every request but /health needs the run's secret."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each inference GPU's memory vLLM may take: its servers_per_gpu servers share it evenly
    (server_memory_utilization each)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    weight_transfer: str = "filesystem"
    """How servers get each policy version: "filesystem" (they load the trainer's file) or "broadcast"
    (trainer rank 0 sends it to every worker, NCCL on GPUs, gloo otherwise; the file stays the fallback).
    Broadcast holds up to async_level + 2 versions in the trainer's host memory."""
    stage_weights: bool = True
    """With filesystem transfer, batch by batch: read the next batch's version into each worker's host
    memory while the current batch generates, once the trainer has written it, so that its update
    copies from memory instead of reading the file with the engine paused (docs/inference.md). Costs
    the checkpoint's size in pinned host memory per vLLM worker; a worker declines when the node's
    available memory is short."""
    tool_call_parser: str | None = None
    """vLLM's parser of the model family's tool calls (e.g. hermes for Qwen2.5), for environments that
    give the model tools: the servers run with --enable-auto-tool-choice --tool-call-parser NAME.
    auto: the one of the model's family (config.json's model_type, its chat template), resolved at
    submit into RUN/config.yaml; refused where none is known. Checked before submit against the
    parsers the installed vLLM registers (where it has none: a warning)."""
    expert_parallel: bool = False
    """Shard an MoE's experts over each server's GPUs (vLLM's --enable-expert-parallel): each of the
    server's tensor_parallel x engines ranks holds a share of the experts whole, instead of a slice of
    every expert; attention stays split as tensor_parallel splits it. Needs a server of more than one
    rank on GPUs and a mixture-of-experts model (checked at submit; docs/moe.md)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra vLLM server arguments, passed as given."""
    api_key_env: str | None = None
    """Name of an environment variable holding the servers' key, in place of the run's secret
    (RUN/secret, made at submit); the key itself is never written. Not a variable of the system,
    SLURM or prl (PATH, HOME, SLURM_JOB_ID, ...): their values are known to others."""
    weights_root: str | None = None
    """Directory whose contents POST /update_weights may load (links resolved), besides the served
    model's own directory; default (unset) the run's weights/. For a server started by hand that
    serves versions from elsewhere; a path outside it is refused. `prl submit` refuses a system
    directory, and the run directory, the home directory or one of their parents (the run's secret, keys)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for inference processes."""
    slurm: ComponentSlurm = field(default_factory=ComponentSlurm)
    """Batch and launch options of the inference group (unset keys: the top-level `slurm` values)."""

    @property
    def server_memory_utilization(self) -> float:
        """The fraction of its GPU each server takes (vLLM's --gpu-memory-utilization)."""
        return self.gpu_memory_utilization / self.servers_per_gpu

    @property
    def local_replicas(self) -> int:
        """Replicas on each node."""
        return max(1, self.data_parallel // self.nodes)

    @property
    def ports(self) -> list[int]:
        """The port of each server on a node: one, or one per replica (replica_servers)."""
        return [self.port + i for i in range(self.local_replicas)] if self.replica_servers else [self.port]

    @property
    def parses_tool_calls(self) -> bool:
        """The servers run a tool-call parser: this section's, or vLLM's own flag among extra_args."""
        return self.tool_call_parser is not None or "--tool-call-parser" in self.extra_args

    def __post_init__(self) -> None:
        _check_batch_options(self.slurm, "inference.slurm")
        _positive(self.nodes, "inference.nodes")
        _check(self.gpus_per_node >= 0, "inference.gpus_per_node", "must be >= 0")
        _positive(self.tensor_parallel, "inference.tensor_parallel")
        _check(0 < self.port < 65536, "inference.port", f"must be a TCP port, got {self.port}")
        _check(re.fullmatch(r"[A-Za-z0-9.:_-]+", self.host) is not None, "inference.host",
               f"must be an address, a host name or auto, got {self.host!r}")
        _check(0 < self.gpu_memory_utilization <= 1, "inference.gpu_memory_utilization", "must be in (0, 1]")
        _one_of(self.weight_transfer, WEIGHT_TRANSFERS, "inference.weight_transfer")
        _one_of(self.multi_node, MULTI_NODE, "inference.multi_node")
        _check(self.multi_node == "servers" or self.nodes > 1, "inference.multi_node",
               "data_parallel joins several inference nodes: needs inference.nodes > 1")
        _check(not wildcard(self.host), "inference.host",
               f"{self.host} listens on every interface, those other networks reach too: set auto (the node's "
               "address, the one the other components use) or one address of the node")
        if self.api_key_env is not None:
            check_env_name(self.api_key_env, "inference.api_key_env")
            _check(not known_variable(self.api_key_env), "inference.api_key_env",
                   f"{self.api_key_env} is a variable of the system, SLURM or prl, whose value others can read or "
                   "guess; name a variable that holds the key alone (e.g. MY_VLLM_KEY)")
        if self.tool_call_parser is not None:
            _check(re.fullmatch(r"[A-Za-z0-9_.-]+", self.tool_call_parser) is not None, "inference.tool_call_parser",
                   f"must be a parser's name, got {self.tool_call_parser!r}")
        _positive(self.servers_per_gpu, "inference.servers_per_gpu")
        if self.servers_per_gpu > 1:
            self._check_shared_gpus()
        _check(not self.replica_servers or self.multi_node == "servers", "inference.replica_servers",
               "runs a server per replica; multi_node=data_parallel runs one server over every node")
        self._check_layout()
        self._check_expert_parallel()
        if self.data_parallel is not None and self.replica_servers is not None:  # resolved
            _check(self.ports[-1] < 65536, "inference.port",
                   f"{self.port} + {len(self.ports) - 1} (one port per replica server) is past 65535")

    def _cpu_replica_servers(self) -> bool:
        """CPU replicas as servers of their own split the node's cores: any number of them."""
        return bool(self.replica_servers) and self.gpus_per_node == 0

    def _layout(self) -> tuple[int, str]:
        """The servers' devices (GPUs, times servers_per_gpu) and how they were counted, for messages."""
        devices = self.nodes * max(self.gpus_per_node, 1) * self.servers_per_gpu
        return devices, f"nodes x gpus_per_node{' x servers_per_gpu' if self.servers_per_gpu > 1 else ''} = {devices}"

    def _check_layout(self) -> None:
        """The layout holds whole replicas, and data_parallel, where the user set it, is what it holds."""
        devices, layout = self._layout()
        if self.data_parallel is not None:
            _positive(self.data_parallel, "inference.data_parallel")
        if not self._cpu_replica_servers():
            _check(devices % self.tensor_parallel == 0, "inference.tensor_parallel",
                   f"{self.tensor_parallel} does not divide {layout}")
            _check(self.data_parallel in (None, devices // self.tensor_parallel), "inference.data_parallel",
                   f"{self.data_parallel} replicas, but {layout} over tensor_parallel {self.tensor_parallel} "
                   f"holds {devices // self.tensor_parallel}: leave it unset, it is derived")
        replicas = self.resolved_data_parallel()
        _check(replicas % self.nodes == 0, "inference.data_parallel",
               f"{replicas} replicas cannot be split evenly over {self.nodes} nodes")

    def resolved_data_parallel(self) -> int:
        """data_parallel as set, else derived: the replicas the layout holds (one a node for CPU replica servers)."""
        if self.data_parallel is not None:
            return self.data_parallel
        return self.nodes if self._cpu_replica_servers() else self._layout()[0] // self.tensor_parallel

    def resolved_replica_servers(self) -> bool:
        """replica_servers as set, else derived: a server per replica where several share a GPU."""
        return self.servers_per_gpu > 1 if self.replica_servers is None else self.replica_servers

    def engine_ranks(self) -> int:
        """The GPUs (ranks) of one server: tensor_parallel x its engines, which are one for a replica
        server, the node's replicas for a server per node, every replica for one over every node."""
        replicas = self.resolved_data_parallel()
        if self.resolved_replica_servers():
            engines = 1
        else:
            engines = replicas if self.multi_node == "data_parallel" else max(1, replicas // self.nodes)
        return self.tensor_parallel * engines

    def _check_expert_parallel(self) -> None:
        """expert_parallel: said once, on GPUs, with more than one rank a server to spread the experts over.
        Whether the model has experts is checked at submit (prl.control.checks), where its files are read."""
        if not self.expert_parallel:
            return
        key = "inference.expert_parallel"
        given = [a for a in self.extra_args if a.split("=")[0].replace("_", "-") in EXPERT_PARALLEL_FLAGS]
        _check(not given, key, f"true, and inference.extra_args gives vLLM's switch too ({given[0] if given else ''}): "
               "drop it from extra_args, the key is the one prl checks")
        _check(self.gpus_per_node > 0, key, "needs GPUs: vLLM 0.32's CPU build cannot run an MoE's expert-parallel "
               "dispatch (its CPU communicator has no all_gatherv); inference.gpus_per_node is 0 (docs/moe.md)")
        how = "a server per replica" if self.resolved_replica_servers() else "one engine a server"
        _check(self.engine_ranks() > 1, key, f"each server runs on one GPU (inference.tensor_parallel 1, {how}): "
               "nothing to spread the experts over; give a server several GPUs (inference.tensor_parallel > 1, "
               "or inference.gpus_per_node > 1 with one server a node)")

    def resolved(self) -> InferenceConfig:
        """This section with the layout's keys left unset derived from nodes, gpus_per_node,
        servers_per_gpu and tensor_parallel (as torchtitan's ParallelDims derives the degree left open):
        a server per replica where several share a GPU, and the replicas the layout holds. Config builds
        every section so, and RUN/config.yaml holds the result; __post_init__ checked the keys set."""
        section = dataclasses.replace(self, replica_servers=self.resolved_replica_servers())
        return dataclasses.replace(section, data_parallel=section.resolved_data_parallel())

    def _check_shared_gpus(self) -> None:
        """servers_per_gpu > 1: separate servers on each GPU, each with its share of the memory."""
        key, k = "inference.servers_per_gpu", self.servers_per_gpu
        _check(self.gpus_per_node > 0, key, f"{k} servers share each GPU; inference.gpus_per_node is 0 (CPU vLLM: "
               "replica_servers with data_parallel splits the cores)")
        _check(self.replica_servers is not False, "inference.replica_servers",
               f"false, but {k} servers share each GPU (inference.servers_per_gpu), each a server of its own: "
               "leave it unset, it is derived")
        _check(self.multi_node == "servers", key, f"{k} servers a GPU are independent servers: needs "
               "inference.multi_node=servers")
        _check(self.tensor_parallel == 1, key, f"servers that share a GPU hold the whole model: needs "
               f"inference.tensor_parallel=1, got {self.tensor_parallel}")
        _check(self.weight_transfer == "filesystem", key, "NCCL takes one rank per GPU: needs "
               "inference.weight_transfer=filesystem")
        # vLLM sizes its KV cache by profiling the GPU's free memory, which the other servers starting
        # beside it change meanwhile; a fixed size skips that profile (rl_bench's shared GPU does the same).
        # It is not derived: the right size is the server's share less the model's weights and its peak
        # activations, which only that profile measures, on a GPU whose size the login node cannot know.
        _check(any(a.split("=")[0] == "--kv-cache-memory-bytes" for a in self.extra_args), "inference.extra_args",
               f"{k} servers that start together on a GPU (inference.servers_per_gpu) cannot size their KV caches "
               f"from its free memory: set each one's, inference.extra_args=[--kv-cache-memory-bytes, BYTES]")
