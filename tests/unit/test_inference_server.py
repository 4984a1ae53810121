"""The inference server's argv and environment, built from the config without starting vLLM
(prl.inference.server), the request shape prl's middleware gives verifiers v1's generate requests
(prl.inference.routes), and the tiny model the vLLM tests serve (tests/integration/test_inference.py).

    pytest tests/unit/test_inference_server.py
"""

from __future__ import annotations

import asyncio
import json
import os
import py_compile
import sys
from pathlib import Path

import pytest

from inference_helpers import API_KEY
from prl.config import load_config, to_yaml
from prl.config.validate import ConfigError
from prl.inference.replicas import log_rank, replica, replica_env
from prl.inference.routes import SCALE_OUT_GENERATE, default_output_mode, with_body
from prl.inference.server import (_QuietShutdown, cpu_engine_environment, export_environment, refuse_taken_port,
                                  uncompiled_source, vllm_args)
from prl.run.protocol import REPLICA_ENV


def gpu_config(tmp_path: Path, *overrides: str):
    (tmp_path / "c.yaml").write_text(
        "run: {name: r, output_dir: /tmp}\nmodel: {name: /models/m}\norchestrator: {environment: {id: e}}\n"
    )
    return load_config(tmp_path / "c.yaml", list(overrides))


def test_vllm_args_split_replicas_per_node_and_keep_extra_args_last(tmp_path):
    cfg = gpu_config(
        tmp_path, "inference.nodes=2", "inference.gpus_per_node=4", "inference.tensor_parallel=2",
        "inference.data_parallel=4", "inference.port=9000", "run.seed=7", "inference.enforce_eager=true",
        "inference.extra_args=[--max-num-seqs,32,--seed,8]",
    )
    args = vllm_args(cfg)
    value = lambda flag: args[args.index(flag) + 1]
    assert value("--tensor-parallel-size") == "2" and value("--data-parallel-size") == "2"
    assert value("--port") == "9000" and value("--seed") == "7" and value("--model") == "/models/m"
    assert value("--generation-config") == "vllm" and value("--logprobs-mode") == "processed_logprobs"
    assert args[-5:] == ["--enforce-eager", "--max-num-seqs", "32", "--seed", "8"]
    assert "--data-parallel-size" not in vllm_args(gpu_config(tmp_path, "inference.gpus_per_node=1"))


def test_replica_servers_each_take_their_port_and_gpus_without_vllm_data_parallelism(tmp_path):
    cfg = gpu_config(tmp_path, "inference.nodes=2", "inference.gpus_per_node=4", "inference.tensor_parallel=2",
                     "inference.data_parallel=4", "inference.port=9000", "inference.replica_servers=true")
    assert cfg.inference.ports == [9000, 9001]
    for index, gpus in ((0, "3,5"), (1, "6,7")):
        env = replica_env(cfg, index, {"CUDA_VISIBLE_DEVICES": "3,5,6,7", "PRL_NODE_RANK": "1"})
        assert env[REPLICA_ENV] == f"{index}/2" and env["CUDA_VISIBLE_DEVICES"] == gpus and env["PRL_NODE_RANK"] == "1"
        assert replica(env) == index and log_rank(env) == 2 + index  # node 1's servers log as ranks 2 and 3
        args = vllm_args(cfg, env)
        assert args[args.index("--port") + 1] == str(9000 + index) and args[args.index("--tensor-parallel-size") + 1] == "2"
        assert not [a for a in args if a.startswith("--data-parallel")] and "--api-server-count" not in args
    # No CUDA_VISIBLE_DEVICES (a server started by hand): the node's first GPUs.
    assert replica_env(cfg, 1, {})["CUDA_VISIBLE_DEVICES"] == "2,3"
    # On CPU the replicas share the node's cores: no devices, each server's threads a share of them.
    cpu = gpu_config(tmp_path, "inference.gpus_per_node=0", "inference.data_parallel=2", "inference.replica_servers=true")
    assert "CUDA_VISIBLE_DEVICES" not in replica_env(cpu, 1, {})
    cores = len(os.sched_getaffinity(0)) - 1
    assert cpu_engine_environment(cpu)["OMP_NUM_THREADS"] == str(max(1, cores // 2))


def test_servers_that_share_a_gpu_each_take_it_and_count_as_its_workers(tmp_path):
    """inference.servers_per_gpu: the node's servers 0-1 on its first GPU, 2-3 on its second, each on
    a port of its own; staging counts every server's worker on the node."""
    cfg = gpu_config(tmp_path, "inference.gpus_per_node=2", "inference.servers_per_gpu=2", "inference.port=9000",
                     "inference.extra_args=[--kv-cache-memory-bytes,8000000000]")
    assert cfg.inference.ports == [9000, 9001, 9002, 9003]
    gpus = [replica_env(cfg, i, {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] for i in range(4)]
    assert gpus == ["4", "4", "6", "6"]
    environ = {}
    export_environment(cfg, environ)
    assert environ["PRL_STAGING_WORKERS"] == "4"
    assert environ["OMP_NUM_THREADS"] == "1"  # a replica server's engine: one torch thread


def test_servers_per_gpu_derives_the_replicas_their_servers_and_each_ones_memory_share(tmp_path):
    """The user sets the layout; replicas, a server each and each server's share of its GPU follow, and
    the same keys set by hand to what they would be derived to give the same config."""
    kv = "inference.extra_args=[--kv-cache-memory-bytes,8000000000]"
    cfg = gpu_config(tmp_path, "inference.gpus_per_node=2", "inference.servers_per_gpu=2", kv)
    assert (cfg.inference.data_parallel, cfg.inference.replica_servers) == (4, True)
    args = vllm_args(cfg, {REPLICA_ENV: "1/4"})
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.45"  # 0.9 of the GPU over its 2 servers
    assert gpu_config(tmp_path, "inference.gpus_per_node=2", "inference.servers_per_gpu=2", kv,
                      "inference.data_parallel=4", "inference.replica_servers=true") == cfg
    assert (gpu_config(tmp_path, "inference.gpus_per_node=3").inference.data_parallel,
            gpu_config(tmp_path, "inference.gpus_per_node=3").inference.replica_servers) == (3, False)
    resolved = tmp_path / "resolved.yaml"  # what RUN/config.yaml holds: the derived values, written out
    resolved.write_text(to_yaml(cfg))
    assert load_config(resolved) == cfg and "data_parallel: 4" in resolved.read_text()


@pytest.mark.parametrize("overrides, key", [
    (["inference.gpus_per_node=1", "inference.servers_per_gpu=2", "inference.data_parallel=2",
      "inference.replica_servers=false", "inference.gpu_memory_utilization=0.45"],
     "inference.replica_servers"),  # not replica servers: set by hand against the layout
    (["inference.gpus_per_node=1", "inference.servers_per_gpu=2", "inference.data_parallel=2",
      "inference.replica_servers=true"], "inference.extra_args"),  # 0.9 of one GPU is 0.45 each; no KV size
    (["inference.gpus_per_node=1", "inference.servers_per_gpu=2", "inference.data_parallel=2",
      "inference.replica_servers=true", "inference.gpu_memory_utilization=0.45",
      "inference.weight_transfer=broadcast"], "inference.servers_per_gpu"),
    (["inference.gpus_per_node=2", "inference.servers_per_gpu=2", "inference.tensor_parallel=2",
      "inference.data_parallel=2", "inference.replica_servers=true", "inference.gpu_memory_utilization=0.45"],
     "inference.servers_per_gpu"),
    (["inference.gpus_per_node=0", "inference.servers_per_gpu=2", "inference.data_parallel=2",
      "inference.replica_servers=true"], "inference.servers_per_gpu"),
    (["inference.gpus_per_node=1", "inference.servers_per_gpu=2", "inference.replica_servers=true",
      "inference.data_parallel=1", "inference.gpu_memory_utilization=0.45",
      "inference.extra_args=[--kv-cache-memory-bytes=8000000000]"],
     "inference.data_parallel"),  # set by hand to 1: the layout holds 2
    (["inference.gpus_per_node=1", "inference.servers_per_gpu=2", "inference.data_parallel=2",
      "inference.replica_servers=true", "inference.gpu_memory_utilization=0.45"], "inference.extra_args"),  # no KV size
    (["inference.gpus_per_node=1", "inference.servers_per_gpu=2", "inference.multi_node=data_parallel",
      "inference.nodes=2", "inference.extra_args=[--kv-cache-memory-bytes=8000000000]"], "inference.servers_per_gpu"),
    (["inference.servers_per_gpu=0"], "inference.servers_per_gpu"),
    (["inference.nodes=2", "inference.data_parallel=2", "inference.multi_node=data_parallel",
      "inference.replica_servers=true"], "inference.replica_servers"),
    (["inference.gpus_per_node=2", "inference.data_parallel=2", "inference.replica_servers=true",
      "inference.port=65535"], "inference.port"),
    (["inference.gpus_per_node=0", "inference.data_parallel=2"], "inference.data_parallel"),  # CPU: one server
    (["inference.gpus_per_node=3", "inference.tensor_parallel=2"], "inference.tensor_parallel"),
    (["inference.gpus_per_node=0", "inference.data_parallel=0", "inference.replica_servers=true"], "inference.data_parallel"),
])
def test_replica_servers_refuse_what_cannot_run(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        gpu_config(tmp_path, *overrides)


def test_vllm_data_parallel_joins_the_nodes_behind_the_first_ones_endpoint(tmp_path):
    """inference.multi_node=data_parallel: node 0 serves the API and engines 0-1 of 4; node 1 runs
    engines 2-3 headless, joined to node 0 at DATA_PARALLEL_ADDRESS:DATA_PARALLEL_RPC_PORT."""
    cfg = gpu_config(tmp_path, "inference.nodes=2", "inference.gpus_per_node=2", "inference.data_parallel=4",
                     "inference.multi_node=data_parallel", "slurm.fabric_isolated=true")
    wiring = {"DATA_PARALLEL_ADDRESS": "10.0.0.5", "DATA_PARALLEL_RPC_PORT": "20042"}
    head, other = (vllm_args(cfg, wiring | {"PRL_NODE_RANK": rank}) for rank in ("0", "1"))
    joined = ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
              "--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "20042"]
    assert " ".join(joined) in " ".join(head) and "--headless" not in head
    assert " ".join([*joined, "--headless", "--data-parallel-start-rank", "2"]) in " ".join(other)
    # multi_node=servers: each node its own server of its replicas, nothing read from DATA_PARALLEL_*.
    servers = vllm_args(gpu_config(tmp_path, "inference.nodes=2", "inference.gpus_per_node=2",
                                   "inference.data_parallel=4"), {})
    assert " ".join(["--data-parallel-size", "2"]) in " ".join(servers) and "--headless" not in servers
    with pytest.raises(ConfigError, match="inference.multi_node: data_parallel joins several inference nodes"):
        gpu_config(tmp_path, "inference.multi_node=data_parallel")  # one node: nothing to join


def test_expert_parallelism_puts_vllms_switch_on_every_server_of_several_ranks(tmp_path):
    """inference.expert_parallel: --enable-expert-parallel on each server, whatever makes its ranks (a node's
    engines, tensor parallelism, replica servers of 2 GPUs, one server over two nodes: its headless node too);
    never on the teacher's server (one GPU), nor without the key."""
    ep, flag = "inference.expert_parallel=true", "--enable-expert-parallel"
    wiring = {"DATA_PARALLEL_ADDRESS": "10.0.0.5", "DATA_PARALLEL_RPC_PORT": "20042"}
    layouts = {
        ("inference.gpus_per_node=2",): 2,  # one server, two data-parallel engines
        ("inference.gpus_per_node=2", "inference.tensor_parallel=2"): 2,
        ("inference.gpus_per_node=4", "inference.tensor_parallel=2", "inference.replica_servers=true"): 2,
        ("inference.nodes=2", "inference.gpus_per_node=1", "inference.multi_node=data_parallel",
         "slurm.fabric_isolated=true"): 2,
        ("inference.nodes=2", "inference.gpus_per_node=4"): 4,  # a server per node, 4 engines each
    }
    for overrides, ranks in layouts.items():
        cfg = gpu_config(tmp_path, *overrides, ep)
        assert cfg.inference.engine_ranks() == ranks, overrides
        second = {REPLICA_ENV: "1/2"} if cfg.inference.replica_servers else {}  # the node's other server
        for environ in ({"PRL_NODE_RANK": "0"}, {"PRL_NODE_RANK": "1", **second}):
            assert vllm_args(cfg, wiring | environ).count(flag) == 1, (overrides, environ)
        assert flag not in vllm_args(gpu_config(tmp_path, *overrides), wiring)
    from prl.inference.teacher import teacher_config
    distill = gpu_config(tmp_path, "inference.gpus_per_node=2", ep, "inference.gpu_memory_utilization=0.6",
                         "teacher.model=/models/t", "trainer.loss.teacher_kl_coef=1",
                         "orchestrator.filter_zero_advantage=false")
    assert flag in vllm_args(distill) and flag not in vllm_args(teacher_config(distill))


@pytest.mark.parametrize("overrides, said", [
    (["inference.gpus_per_node=1"], "each server runs on one GPU (inference.tensor_parallel 1, one engine a server)"),
    (["inference.gpus_per_node=2", "inference.replica_servers=true"],
     "(inference.tensor_parallel 1, a server per replica)"),
    (["inference.gpus_per_node=2", "inference.servers_per_gpu=2", "inference.gpu_memory_utilization=0.8",
      "inference.extra_args=[--kv-cache-memory-bytes=1000000000]"], "a server per replica"),
    (["inference.nodes=2", "inference.gpus_per_node=1"], "one engine a server"),  # a server per node of 1 GPU
    (["inference.gpus_per_node=0"], "needs GPUs: vLLM 0.32's CPU build cannot run"),
    (["inference.gpus_per_node=0", "inference.nodes=2", "inference.multi_node=data_parallel",
      "slurm.fabric_isolated=true"], "needs GPUs"),
    (["inference.gpus_per_node=2", "inference.extra_args=[--enable-expert-parallel]"],
     "(--enable-expert-parallel): drop it"),
    (["inference.gpus_per_node=2", "inference.extra_args=[--max-num-seqs, 8, --enable_expert_parallel]"],
     "(--enable_expert_parallel)"),
    (["inference.gpus_per_node=2", "inference.extra_args=[--no-enable-expert-parallel]"], "gives vLLM's switch too"),
    (["inference.gpus_per_node=2", "inference.extra_args=[-ep]"], "(-ep)"),
])
def test_expert_parallelism_refuses_what_has_nothing_to_spread_or_says_it_twice(tmp_path, overrides, said):
    with pytest.raises(ConfigError) as e:
        gpu_config(tmp_path, *overrides, "inference.expert_parallel=true")
    assert str(e.value).startswith("inference.expert_parallel: ") and said in str(e.value) and "\n" not in str(e.value)
    gpu_config(tmp_path, *overrides)  # the same layout without the key loads


def test_a_tool_call_parser_turns_on_vllms_tool_choice(tmp_path):
    args = vllm_args(gpu_config(tmp_path, "inference.tool_call_parser=hermes"))
    assert args[args.index("--tool-call-parser") - 1 : args.index("--tool-call-parser") + 2] == [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert "--enable-auto-tool-choice" not in vllm_args(gpu_config(tmp_path))


def test_a_v1_environment_turns_on_the_generate_route_and_token_id_logprobs(tmp_path):
    """verifiers v1's TrainClient samples from /inference/v1/generate (--enable-scale-out) and reads each
    logprob's token as "token_id:N" (--return-tokens-as-token-ids): a v1 training or eval environment."""
    flags = ["--enable-scale-out", "--return-tokens-as-token-ids"]
    for env in ("orchestrator.environment.api=v1", "orchestrator.eval.environments=[{id: e, api: v1}]"):
        args = vllm_args(gpu_config(tmp_path, env))
        assert args[args.index(flags[0]) : args.index(flags[0]) + 2] == flags, env
    assert not set(flags) & set(vllm_args(gpu_config(tmp_path)))


def test_a_generate_request_that_names_no_output_mode_asks_for_openai_shaped_logprobs():
    body = json.dumps({"model": "m", "token_ids": [1, 2], "sampling_params": {"logprobs": 1}}).encode()
    assert json.loads(default_output_mode(body)) == {**json.loads(body), "output_mode": "text"}
    named = json.dumps({"token_ids": [1], "output_mode": "tokens"}).encode()
    assert default_output_mode(named) == named
    for odd in (b"not json", b"[1]", b""):  # vLLM answers these with its own 400
        assert default_output_mode(odd) == odd


def test_a_rewritten_body_arrives_whole_with_its_length_and_then_the_clients_disconnect():
    """vLLM cancels a generation when the client leaves: after the new body, receive is the client's."""
    messages = [{"type": "http.request", "body": b'{"token_ids": ', "more_body": True},
                {"type": "http.request", "body": b"[1]}"}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop(0)

    async def rewrite() -> tuple[dict, list[dict]]:
        scope = {"type": "http", "path": SCALE_OUT_GENERATE,
                 "headers": [(b"Content-Length", b"16"), (b"authorization", b"Bearer k")]}
        scope, replayed = await with_body(scope, receive, default_output_mode)
        return scope, [await replayed(), await replayed()]

    scope, (first, second) = asyncio.run(rewrite())
    assert json.loads(first["body"]) == {"token_ids": [1], "output_mode": "text"} and not first["more_body"]
    assert dict(scope["headers"]) == {b"authorization": b"Bearer k", b"content-length": str(len(first["body"])).encode()}
    assert second == {"type": "http.disconnect"}


def test_a_data_parallel_cpu_server_runs_one_api_server_unless_told_otherwise(tmp_path):
    """vLLM starts an API-server process per engine when data-parallel; on CPU prl asks for one (each
    more is a spawned interpreter importing vLLM), the headless node has none to ask for, GPU servers
    keep vLLM's default, and inference.extra_args (last in argv) still wins."""
    wiring = {"DATA_PARALLEL_ADDRESS": "10.0.0.5", "DATA_PARALLEL_RPC_PORT": "20042"}
    joined = ["inference.nodes=2", "inference.data_parallel=2", "inference.multi_node=data_parallel",
              "slurm.fabric_isolated=true"]
    count = lambda args: [args[i + 1] for i, a in enumerate(args) if a == "--api-server-count"]
    cpu = gpu_config(tmp_path, "inference.gpus_per_node=0", *joined)
    assert count(vllm_args(cpu, wiring | {"PRL_NODE_RANK": "0"})) == ["1"]
    assert count(vllm_args(cpu, wiring | {"PRL_NODE_RANK": "1"})) == []
    assert count(vllm_args(gpu_config(tmp_path, "inference.gpus_per_node=0"), {})) == []
    assert count(vllm_args(gpu_config(tmp_path, "inference.gpus_per_node=1", *joined), wiring)) == []
    told = gpu_config(tmp_path, "inference.gpus_per_node=0", *joined, "inference.extra_args=[--api-server-count,2]")
    assert count(vllm_args(told, wiring)) == ["1", "2"]  # argparse: the last one wins


def test_api_key_travels_by_environment_only(tmp_path):
    cfg = gpu_config(tmp_path, "inference.api_key_env=MY_KEY", "inference.env.VLLM_X=1", "env.A=2")
    environ = {"MY_KEY": API_KEY}
    export_environment(cfg, environ)
    root = environ.pop("PRL_WEIGHTS_ROOT")  # what /update_weights may load: the run's weights/
    assert root == os.path.realpath("/tmp/r/weights")  # run.output_dir /tmp, run.name r
    assert environ.pop("PRL_STAGING_WORKERS") == str(cfg.inference.gpus_per_node)  # each GPU's worker stages
    assert environ == {"MY_KEY": API_KEY, "VLLM_API_KEY": API_KEY, "VLLM_X": "1", "A": "2",
                       "VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75"}
    assert not any(API_KEY in arg for arg in vllm_args(cfg))
    with pytest.raises(SystemExit, match="MY_KEY"):
        export_environment(cfg, {})


def test_a_taken_port_is_refused_before_vllm_binds_it():
    import socket

    with socket.socket() as held:  # bound as vLLM binds with several API servers: the kernel would share it
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"inference.port: \*:{port} is taken"):
            refuse_taken_port("", port)
    refuse_taken_port("", port)


def test_quiet_shutdown_drops_only_the_engine_dead_record_after_shutdown():
    import logging

    class EngineDeadError(Exception):
        pass

    def record(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("vllm", logging.ERROR, __file__, 1, msg, None, info)

    quiet = _QuietShutdown()
    dead = EngineDeadError("EngineCore encountered an issue")
    assert quiet.filter(record("AsyncLLM output_handler failed.", dead))  # a real crash while serving
    assert quiet.filter(record("[shutdown] API server: shutdown triggered"))
    assert not quiet.filter(record("AsyncLLM output_handler failed.", dead))
    assert quiet.filter(record("AsyncLLM output_handler failed.", ValueError("other")))


def test_tiny_model_is_reproducible_and_built_once(tiny_model, tmp_path):
    import hashlib
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_model.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "m")], check=True)
    digest = lambda d: {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}
    assert digest(tmp_path / "m") == digest(tiny_model)
    again = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "m")], capture_output=True, text=True)
    assert "up to date" in again.stdout
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.txt").write_text("not ours")
    refused = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "foreign")], capture_output=True)
    assert refused.returncode == 1 and (tmp_path / "foreign" / "keep.txt").exists()


def test_vllm_on_cpu_runs_its_model_in_the_engine_process_and_compiles_nothing(tmp_path):
    """inference.gpus_per_node=0: the in-process executor on vLLM's own thread count (the cores but
    one, over the node's replicas), and with enforce_eager no torch.compile; what env sets wins; GPU
    servers get none of it."""
    cores = len(os.sched_getaffinity(0)) - 1
    cfg = gpu_config(tmp_path, "inference.gpus_per_node=0", "inference.enforce_eager=true")
    assert cpu_engine_environment(cfg) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(max(1, cores)),
                                           "VLLM_WORKER_MULTIPROC_METHOD": "fork", "TORCHDYNAMO_DISABLE": "1"}
    assert "TORCHDYNAMO_DISABLE" not in cpu_engine_environment(gpu_config(tmp_path, "inference.gpus_per_node=0"))
    environ = {"K": API_KEY}
    export_environment(gpu_config(tmp_path, "inference.gpus_per_node=0", "inference.env.OMP_NUM_THREADS=7",
                                  "inference.api_key_env=K"), environ)
    assert environ["OMP_NUM_THREADS"] == "7" and environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    environ = {"K": API_KEY}
    export_environment(gpu_config(tmp_path, "inference.api_key_env=K"), environ)
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE"} & environ.keys()


def test_a_gpu_servers_engine_starts_by_fork_unless_env_says_otherwise(tmp_path):
    """`vllm serve` would spawn the engine (a fresh interpreter importing vLLM again: on an H200 its
    first line came 11 s after the configuration against 4 s forked); prl's GPU servers fork it, and
    a method set in env, inference.env or the job's environment wins."""
    environ = {"K": API_KEY}
    export_environment(gpu_config(tmp_path, "inference.api_key_env=K"), environ)
    assert environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    for where, environ in (("inference.env.VLLM_WORKER_MULTIPROC_METHOD=spawn", {"K": API_KEY}),
                           ("env.VLLM_WORKER_MULTIPROC_METHOD=spawn", {"K": API_KEY}),
                           ("run.name=x", {"K": API_KEY, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})):
        export_environment(gpu_config(tmp_path, "inference.api_key_env=K", where), environ)
        assert environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn", where


def test_a_package_without_bytecode_where_python_may_write_none_is_named(tmp_path, monkeypatch):
    """The server warns where vLLM would be compiled from source at every start (a container image
    with PYTHONDONTWRITEBYTECODE and no .pyc files); not where bytecode was installed, where Python
    may write it, or where the package is not there at all."""
    package = tmp_path / "site" / "pkgx"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert uncompiled_source("pkgx", True) == str(package / "__init__.py")
    assert uncompiled_source("pkgx", False) is None
    assert uncompiled_source("pkgx_absent", True) is None
    py_compile.compile(str(package / "__init__.py"), doraise=True)  # what pip does at install
    assert uncompiled_source("pkgx", True) is None
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))  # PYTHONPYCACHEPREFIX: looks there only
    assert uncompiled_source("pkgx", True) == str(package / "__init__.py")


def test_gpu_replica_servers_each_get_one_torch_thread_unless_env_says_otherwise(tmp_path):
    """inference.replica_servers on GPUs: one torch thread per server, as vLLM's own multi-process
    executor gives each engine (three with a thread per core each contended on a 64-core node);
    a single server keeps vLLM's choice, and what env sets wins."""
    servers = ("inference.gpus_per_node=3", "inference.data_parallel=3", "inference.replica_servers=true",
               "inference.api_key_env=K")
    environ = {"K": API_KEY}
    export_environment(gpu_config(tmp_path, *servers), environ)
    assert environ["OMP_NUM_THREADS"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in environ
    environ = {"K": API_KEY}
    export_environment(gpu_config(tmp_path, *servers, "inference.env.OMP_NUM_THREADS=4"), environ)
    assert environ["OMP_NUM_THREADS"] == "4"
    environ = {"K": API_KEY, "OMP_NUM_THREADS": "8"}  # set by the job's environment (a site's prolog)
    export_environment(gpu_config(tmp_path, *servers), environ)
    assert environ["OMP_NUM_THREADS"] == "8"
    environ = {"K": API_KEY}
    export_environment(gpu_config(tmp_path, "inference.gpus_per_node=3", "inference.data_parallel=3",
                                  "inference.api_key_env=K"), environ)
    assert "OMP_NUM_THREADS" not in environ
