"""On-policy distillation's pieces without vLLM or torchrun (docs/distillation.md): the `teacher`
section's checks, the teacher's server config and place beside the policy's, its middleware's refusal
of weight updates, the orchestrator's scoring over prl's authenticated HTTP path (a stand-in model
behind the real middleware), the batch field and its checks, the vocabulary check at submit. The
loss term: tests/unit/test_trainer_loss.py; the whole loop: the fork test of tests/integration/test_e2e_local.py.

    pytest tests/unit/test_distill.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from helpers import fake_run

from prl.config import ConfigError, load_config
from prl.control import vocab
from prl.control.checks import check_teacher
from prl.control.status import status_lines
from prl.control.submit import resolve
from prl.inference.replicas import log_rank, ports, server_envs
from prl.inference.routes import PrlRoutes
from prl.inference.server import vllm_args
from prl.inference.teacher import teacher_config
from prl.orchestrator.distill import Teacher, teacher_urls, token_logprobs
from prl.run.batch import Batch, read_batch, write_batch
from prl.run.packing import Sample, pack_batch
from prl.run.ports import free_port
from prl.run.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y 'with' $pecial;chars"


def config(tmp_path: Path, *overrides: str):
    (tmp_path / "c.yaml").write_text(
        "run: {name: r, output_dir: /tmp}\nmodel: {name: /models/student, max_model_len: 64}\n"
        "teacher: {model: /models/teacher, port: 9100}\ntrainer: {loss: {teacher_kl_coef: 0.5}}\ninference: {gpus_per_node: 0}\n"
        "orchestrator: {environment: {id: e}, filter_zero_advantage: false}\n")
    return load_config(tmp_path / "c.yaml", list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.loss.teacher_kl_coef=0"], "trainer.loss.teacher_kl_coef: must be > 0 with a `teacher` section"),
    (["trainer.loss.teacher_kl_coef=-1"], "trainer.loss.teacher_kl_coef: must be >= 0"),
    (["trainer.loss.reward_weight=-0.5"], "trainer.loss.reward_weight: must be >= 0"),
    (["orchestrator.filter_zero_advantage=true"], "orchestrator.filter_zero_advantage: must be false with a teacher"),
    (["teacher.port=8000"], r"teacher.port: 8000 is a policy server's port \(\[8000\]\)"),
    (["teacher.port=0"], "teacher.port: must be a TCP port"),
    (["teacher.model=''"], "teacher.model: must be set"),
    (["teacher.placement=own_nodes"], "teacher.placement: must be one of inference_nodes"),
    (["teacher.max_concurrent=0"], "teacher.max_concurrent: must be > 0"),
    (["inference.gpus_per_node=1", "inference.gpu_memory_utilization=0.8"], r"teacher.gpu_memory_utilization: 0.3 \+ .* > 1"),
    (["teacher=null"], "trainer.loss.teacher_kl_coef: needs a `teacher` section"),
    (["teacher=null", "trainer.loss.teacher_kl_coef=0", "trainer.loss.reward_weight=0"],
     "trainer.loss.reward_weight: 0 leaves nothing to train on"),
])
def test_a_teacher_config_that_cannot_run_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *overrides)


def test_the_teacher_server_is_the_inference_program_on_the_teachers_model_port_and_gpu_share(tmp_path):
    cfg = config(tmp_path, "inference.gpus_per_node=4", "inference.tensor_parallel=2", "inference.port=9000",
                 "inference.tool_call_parser=hermes", "teacher.extra_args=[--max-num-seqs,8]",
                 "inference.gpu_memory_utilization=0.6")
    args = vllm_args(teacher_config(cfg))
    value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    assert value("--model") == "/models/teacher" and value("--port") == "9100"
    assert value("--max-model-len") == "65"  # a whole sample as its prompt, plus the one token vLLM samples
    assert value("--tensor-parallel-size") == "1" and value("--gpu-memory-utilization") == "0.3"
    assert "--data-parallel-size" not in args and "--tool-call-parser" not in args and args[-2:] == ["--max-num-seqs", "8"]
    # One component: the policy's server (replica 0 of 1), then the teacher's, on the node's first GPU.
    envs = server_envs(cfg, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "PRL_NODE_RANK": "1"})
    assert [e.get("PRL_TEACHER") for e in envs] == [None, "1"] and ports(cfg) == [9000, 9100]
    assert envs[1]["CUDA_VISIBLE_DEVICES"] == "4" and envs[0]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert log_rank(envs[1]) == "teacher_1" and log_rank(envs[0]) == 1
    replicas = config(tmp_path, "inference.gpus_per_node=2", "inference.replica_servers=true",
                      "inference.gpu_memory_utilization=0.7")
    assert [e["PRL_INFERENCE_REPLICA"] for e in server_envs(replicas, {})] == ["0/2", "1/2", "0/1"]
    assert teacher_urls(["http://a:8000/v1", "http://a:8001/v1", "http://b:8000/v1"], 9100) == [
        "http://a:9100/v1", "http://b:9100/v1"]


class StandInTeacher:
    """vLLM's /v1/completions as the teacher answers it with prompt_logprobs 0: per prompt token
    (the first None) {str(id): {logprob, rank, decoded_token}}; logprob -(id / 10) here."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["path"] != "/v1/completions":  # /health
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.bodies.append(request)
        entries = [None] + [{str(t): {"logprob": -t / 10, "rank": 1, "decoded_token": "x"}} for t in request["prompt"][1:]]
        answer = json.dumps({"choices": [{"text": "y", "prompt_logprobs": entries}]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


async def serve(app, port: int):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task


def test_the_orchestrator_scores_each_sample_through_the_teachers_authenticated_middleware(tmp_path, monkeypatch):
    monkeypatch.setenv("PRL_TEACHER", "1")
    port = free_port()
    cfg = config(tmp_path, f"teacher.port={port}", "teacher.max_concurrent=2")
    samples = [Sample([5, 6, 7, 8], [False, False, True, True], [0.0, 0.0, -1.0, -1.0], 1.0),
               Sample([9, 3, 2], [False, True, True], [0.0, -2.0, -2.0], -1.0)]

    async def main():
        app = StandInTeacher()
        middleware = PrlRoutes(app)
        middleware.keys = [KEY]
        server, task = await serve(middleware, port)
        teacher = Teacher(cfg, [f"http://127.0.0.1:{free_port()}/v1"], KEY)
        try:
            await teacher.wait_ready(timeout_s=10)
            metrics = await teacher.score(samples)
            async with httpx.AsyncClient() as http:  # the teacher's weights stay what teacher.model names
                refused = await http.post(f"http://127.0.0.1:{port}/update_weights", json={"path": "/x"},
                                          headers={"Authorization": f"Bearer {KEY}"})
                unauthenticated = await http.post(f"http://127.0.0.1:{port}/v1/completions", json={})
        finally:
            await teacher.close()
            server.should_exit = True
            await task
        return app, metrics, refused, unauthenticated

    app, metrics, refused, unauthenticated = asyncio.run(main())
    assert [s.teacher_logprobs for s in samples] == [[0.0, 0.0, -0.7, -0.8], [0.0, -0.3, -0.2]]
    assert [b["prompt"] for b in app.bodies] == [[5, 6, 7, 8], [9, 3, 2]]
    assert all(b["prompt_logprobs"] == 0 and b["max_tokens"] == 1 and b["model"] == "/models/teacher" for b in app.bodies)
    assert metrics["teacher_tokens"] == 4.0 and metrics["teacher_s"] > 0
    assert refused.status_code == 403 and "no weight updates" in refused.text
    assert unauthenticated.status_code == 401


def test_an_answer_without_the_samples_tokens_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs for 2 tokens, the sample has 3"):
        token_logprobs({"choices": [{"prompt_logprobs": [None, {}]}]}, [1, 2, 3], [False, True, True])
    with pytest.raises(ValueError, match="no logprob for token 3"):
        token_logprobs({"choices": [{"prompt_logprobs": [None, {"3": {"logprob": -1}}, {"4": {"logprob": -1}}]}]},
                       [1, 3, 3], [False, True, True])
    # A token the teacher rules out (-inf; JSON's -Infinity) stays a finite number in the batch.
    assert token_logprobs({"choices": [{"prompt_logprobs": [None, {"2": {"logprob": float("-inf")}}]}]},
                          [1, 2], [False, True]) == [0.0, -1e4]


def batch_of(samples: list[Sample], step: int = 0) -> Batch:
    return Batch(step=step, policy_version=0, micro_batches=pack_batch(samples, 2, 1), metrics={})


def test_the_teacher_logprobs_travel_in_every_micro_batch_and_the_reader_checks_them(tmp_path):
    rd = RunDir(tmp_path)
    scored = [Sample([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 1.0, [0.0, -0.5, -0.25])]
    write_batch(rd, batch_of(scored))  # 1 sample over 2 ranks: rank 1 gets the empty micro-batch, with the key too
    got = read_batch(rd, 0, world_size=2, teacher=True)
    assert torch.equal(got.micro_batches[0][0]["teacher_logprobs"], torch.tensor([[0.0, -0.5, -0.25]]))
    assert torch.equal(got.micro_batches[1][0]["teacher_logprobs"], torch.tensor([[0.0]]))
    with pytest.raises(ValueError, match="a micro-batch with teacher_logprobs, but the run has no teacher section"):
        read_batch(rd, 0, world_size=2, teacher=False)
    write_batch(rd, batch_of([dataclasses.replace(scored[0], teacher_logprobs=None)]))
    with pytest.raises(ValueError, match="a micro-batch without teacher_logprobs, but the run has a teacher"):
        read_batch(rd, 0, world_size=2, teacher=True)
    with pytest.raises(ValueError, match="mixes samples with and without"):
        pack_batch([*scored, dataclasses.replace(scored[0], teacher_logprobs=None)], 1, 2)


def model_dir(path: Path, vocab_table: dict[str, int], added: list[dict]) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab_table}, "added_tokens": added}))
    return path


def test_submit_refuses_a_teacher_whose_tokenizer_gives_other_ids(tmp_path, capsys):
    table = {"a": 0, "b": 1, "ab": 2}
    student = model_dir(tmp_path / "student", table, [{"id": 3, "content": "<|im_end|>"}])
    same = model_dir(tmp_path / "same", table, [{"id": 3, "content": "<|im_end|>"}])
    other = model_dir(tmp_path / "other", table | {"ab": 3}, [{"id": 2, "content": "<|im_end|>"}])
    cfg = config(tmp_path, f"model.name={student}", f"teacher.model={same}")
    check_teacher(cfg, {})
    with pytest.raises(ConfigError, match=r"^teacher.model: its tokenizer gives 2 token\(s\) other ids .* '<\|im_end\|>', 'ab'"):
        check_teacher(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, model=str(other))), {})
    with pytest.raises(ConfigError, match="^teacher.model: no such model directory"):
        check_teacher(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, model=str(tmp_path / "x"))), {})
    # A hub id not in the cache cannot be compared here: said in one line, not refused.
    assert vocab.mismatch(str(student), "org/teacher", tmp_path / "hub") is None
    assert "its vocabulary was not compared" in capsys.readouterr().out
    # The shipped tiny model against itself, as configs/distill_toy.yaml's chain compares a run's weights with it.
    tiny = ROOT / ".cache/tiny-qwen2"
    if tiny.is_dir():
        assert vocab.token_ids(tiny) and vocab.mismatch(str(tiny), str(tiny), tmp_path) is None


def test_submit_makes_a_teacher_directory_named_from_here_absolute(tmp_path, monkeypatch):
    """The job runs in the run directory: a relative teacher.model (configs/distill_toy.yaml's
    outputs/toy-rl/weights/step_20) is resolved where `prl submit` ran, as model.name is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs/weights").mkdir(parents=True)
    assert resolve(config(tmp_path, "teacher.model=outputs/weights")).teacher.model == str(tmp_path / "outputs/weights")
    assert resolve(config(tmp_path, "teacher.model=org/teacher")).teacher.model == "org/teacher"  # a hub id stays


def test_prl_eval_serves_the_policy_alone(tmp_path):
    """jobs/eval.py's server reads the run's config without its teacher: no teacher server beside it."""
    spec = importlib.util.spec_from_file_location("eval_job", ROOT / "jobs/eval.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    serving = job.serving_config(config(tmp_path), "/runs/r/weights/step_4")
    assert serving.teacher is None and serving.trainer.loss.teacher_kl_coef == 0
    assert [e.get("PRL_TEACHER") for e in server_envs(serving, {})] == [None]


SERVER = """import os, pathlib, sys, time
pathlib.Path(sys.argv[1], "teacher" if os.environ.get("PRL_TEACHER") else "policy").write_text(str(os.getpid()))
time.sleep(120)
"""
NODE = """import sys
from prl.config import load_config
from prl.inference import replicas
replicas.JOB = sys.argv[2]
sys.exit(replicas.run([sys.argv[3]], load_config(sys.argv[1])))
"""


def test_a_teacher_server_killed_9_ends_the_nodes_servers_with_its_status(tmp_path):
    """The node's servers are one component (prl.inference.replicas): the teacher's server killed with
    SIGKILL, the policy's is stopped and the component exits 137, which prl.run.node records as the
    inference component's failure. The servers are stand-ins that only sleep (the real ones: vLLM);
    the processes, the signals and the exit status are real."""
    config(tmp_path)  # writes c.yaml
    (tmp_path / "server.py").write_text(SERVER)
    node = subprocess.Popen([sys.executable, "-c", NODE, str(tmp_path / "c.yaml"), str(tmp_path / "server.py"), str(tmp_path)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not all((tmp_path / name).exists() for name in ("teacher", "policy")) and time.monotonic() < deadline:
        time.sleep(0.1)
    teacher, policy = (int((tmp_path / name).read_text()) for name in ("teacher", "policy"))
    os.kill(teacher, signal.SIGKILL)
    assert node.wait(timeout=60) == 137
    with pytest.raises(ProcessLookupError):
        os.kill(policy, 0)  # stopped and reaped by the node's process


def test_status_shows_the_teacher_kl_of_a_distillation_run(tmp_path):
    rd = fake_run(tmp_path, steps=3, attempts=1)
    path = rd.logs / "attempt_0/trainer/metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r | {"train/teacher_kl": kl}) + "\n" for r, kl in zip(records, (9.0, 4.5, 0.25))))
    line = next(x for x in status_lines(rd) if x.startswith("teacher KL:"))
    assert line.endswith("first 9.000 last 0.250"), line
    assert not any(x.startswith("teacher KL:") for x in status_lines(fake_run(tmp_path, name="plain")))
