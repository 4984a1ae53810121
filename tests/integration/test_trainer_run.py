"""The trainer end to end under torchrun (gloo, CPU): versions, checkpoints, preemption, exact resume.

Each launch is a real `torchrun ... jobs/trainer.py RUN/config.yaml` on the tiny model
(tools/make_tiny_model.py) with batch files written the way the orchestrator writes them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from prl.run import rewind
from prl.run.batch import Batch, read_data_order, write_batch
from prl.config import (
    CheckpointConfig, Config, EnvironmentConfig, LoraConfig, ModelConfig, OrchestratorConfig, RunConfig, TrainerConfig,
    WandbConfig, WatchdogConfig, to_yaml,
)
from prl.run.packing import pack_batch
from prl.run.protocol import EXIT_STALLED, RANK_EXIT_PREEMPTED as PREEMPTED_EXIT_CODE, STALLED, STOP_REQUEST
from prl.run.rundir import RunDir
from prl.trainer.samples import synthetic_batch

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-qwen2"
    subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--out", str(out)], check=True)
    return out


def global_batch(step: int, world_size: int) -> Batch:
    """The same 4 micro-batches per step whatever the world size (split evenly over the ranks), with
    a data order as the orchestrator's batches carry one (the trainer keeps it in its checkpoints)."""
    batch = synthetic_batch(step, world_size=2, micro_batches_per_rank=2, samples_per_micro_batch=3,
                            seq_len=64, vocab_size=768, seed=7)
    flat = [mb for mbs in batch.micro_batches for mb in mbs]
    per_rank = len(flat) // world_size
    batch.micro_batches = [flat[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
    batch.metrics = {"reward_mean": 0.1 * step}
    batch.data_order = data_order(step + 1)
    return batch


def data_order(step: int) -> dict:
    """The data order before batch `step`, as prl.orchestrator.resume.data_order_at shapes it."""
    return {"step": step, "samples_seen": 8 * step, "data_position": [2 * step], "fingerprint": {"seed": 3}}


def make_run(root: Path, model: Path, world_size: int, steps: range, watchdog: WatchdogConfig | None = None,
             lora: LoraConfig | None = None, **trainer) -> Path:
    cfg = Config(
        run=RunConfig(name="run", output_dir=str(root), max_steps=STEPS, seed=3, wandb=WandbConfig(mode="disabled")),
        model=ModelConfig(name=str(model), dtype="float32"),
        trainer=TrainerConfig(nodes=world_size, gpus_per_node=0, lr=1e-3, warmup_steps=2,
                              checkpoint=CheckpointConfig(interval=2, keep_last=2), lora=lora or LoraConfig(),
                              **trainer),
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="prl.envs.toy"), batch_size=8,
                                        rollouts_per_example=4),
        watchdog=watchdog or WatchdogConfig(),
    )
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    write_batches(run, world_size, steps)
    return run


def write_batches(run: Path, world_size: int, steps: range) -> None:
    for step in steps:
        write_batch(RunDir(run), global_batch(step, world_size))


def start(run: Path, nproc: int, attempt: int, env: dict[str, str] | None = None,
          torchrun_args: tuple[str, ...] = (), preexec_fn=None) -> subprocess.Popen:
    env = os.environ | {"PRL_RUN_DIR": str(run), "PRL_LOG_DIR": str(run / f"logs/attempt_{attempt}"),
                        "OMP_NUM_THREADS": "1"} | (env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *torchrun_args, str(REPO / "jobs/trainer.py"), str(run / "config.yaml")]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec_fn)


def wait_for(proc: subprocess.Popen, path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)


def pelt(proc: subprocess.Popen, signals=(signal.SIGUSR1, signal.SIGTERM), interval: float = 0.02) -> None:
    """Signal every worker of `proc`, over and over, until torchrun exits."""
    while proc.poll() is None:
        for pid in worker_pids(proc.pid):
            for sig in signals:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(interval)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def metrics(run: Path, attempt: int) -> list[dict]:
    lines = (run / f"logs/attempt_{attempt}/trainer/metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def trainer_params(run: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    """The model state in checkpoints/step_N, HF names (read back without a process group)."""
    out = tmp / f"ckpt_{step}.pt"
    dcp_to_torch_save(run / f"checkpoints/step_{step}/trainer", out)
    state = torch.load(out, weights_only=False)["model"]
    return {k.removeprefix("causal_lm."): v for k, v in state.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model) -> Path:
    """The reference run. Once its final checkpoint is complete, USR1 and TERM rain on every rank
    until it exits: nothing is left to save, so they must change nothing (exit 0, not a failure)."""
    run = make_run(tmp_path_factory.mktemp("uninterrupted"), tiny_model, 2, range(STEPS))
    proc = start(run, 2, attempt=1)
    wait_for(proc, run / f"checkpoints/step_{STEPS}/COMPLETE")
    pelt(proc)
    rc, out = finish(proc)
    assert rc == 0, out
    return run


@pytest.fixture(scope="module")
def preempted(tmp_path_factory, tiny_model) -> tuple[Path, int, str]:
    """Batches for steps 0 and 1 only. While step 1's periodic checkpoint is under way (slowed
    down here), USR1 to a single rank, then USR1 and TERM to both: the write must finish intact,
    and the ranks stop at the next step boundary."""
    run = make_run(tmp_path_factory.mktemp("preempted"), tiny_model, 2, range(2))
    proc = start(run, 2, attempt=1, env={"PRL_FAULT_CHECKPOINT_DELAY_S": "2"})
    wait_for(proc, run / "checkpoints/step_2/.trainer.tmp")  # the write starts 2 s later
    workers = worker_pids(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGUSR1)  # the other rank learns it from the all-reduced flag
    time.sleep(0.2)
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGUSR1)
    rc, out = finish(proc)
    return run, rc, out


def worker_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(children)


def test_two_ranks_publish_versions_that_transformers_loads(uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = uninterrupted
    # async_level 1: the newest two versions stay, and so does the window (C-2, C] of each kept
    # checkpoint C (2 and 4), which a run resumed from C needs again; each is complete.
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_1", "step_2", "step_3", "step_4"]
    assert all((run / f"weights/step_{n}/COMPLETE").exists() for n in (1, 2, 3, 4))
    model = AutoModelForCausalLM.from_pretrained(run / "weights/step_4", dtype=torch.float32)
    AutoTokenizer.from_pretrained(run / "weights/step_4")
    trained = trainer_params(run, 4, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    steps = metrics(run, 1)
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:
        mbs = [mb for rank in global_batch(m["step"], 2).micro_batches for mb in rank]
        assert m["train/loss_tokens"] == sum(int(mb["loss_mask"].sum()) for mb in mbs)
    assert [m["rollout/reward_mean"] for m in steps] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert steps[0]["train/lr"] == pytest.approx(5e-4) and steps[1]["train/lr"] == pytest.approx(1e-3)


def test_weights_differ_from_the_initial_model(uninterrupted, tiny_model):
    initial = load_file(tiny_model / "model.safetensors")
    trained = load_file(uninterrupted / "weights/step_4/model.safetensors")
    assert trained.keys() == initial.keys()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])


def test_checkpoints_every_interval_and_at_the_end(uninterrupted):
    ckpts = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"]
    for name in ckpts:
        trainer = uninterrupted / "checkpoints" / name / "trainer"
        assert (uninterrupted / "checkpoints" / name / "COMPLETE").exists()
        assert {"rng_rank_0.pt", "rng_rank_1.pt", ".metadata"} <= {p.name for p in trainer.iterdir()}
        # The data order of the last batch consumed, the orchestrator's on resume (prl.run.batch).
        assert read_data_order(RunDir(uninterrupted), int(name.removeprefix("step_"))) == data_order(int(name.removeprefix("step_")))


def test_usr1_to_one_rank_checkpoints_all_and_exits_42(preempted):
    run, rc, out = preempted
    # Every rank returns 42; torchrun itself reports a failed worker as 1, hence the marker file.
    assert rc != 0
    assert out.count(f"exitcode  : {PREEMPTED_EXIT_CODE}") >= 1, out
    assert (run / "logs/attempt_1/preempted").read_text().strip() == "trainer: checkpoints/step_2"
    assert (run / "checkpoints/step_2/COMPLETE").exists()
    assert read_data_order(RunDir(run), 2) == data_order(2)
    for rank in (0, 1):
        assert "stop requested: checkpointing step 2" in (run / f"logs/attempt_1/trainer/rank_{rank}.log").read_text()


def test_resume_after_preemption_equals_the_uninterrupted_run(preempted, uninterrupted):
    """...with the resumed attempt prewarmed (trainer.prewarm, off by default on CPU): the synthetic
    micro-batches (the largest two, then about half as large each, then the one-token filler of a rank
    short of micro-batches) through both ranks' forward and backward change nothing of the steps after
    them."""
    run, _, _ = preempted
    write_batches(run, 2, range(2, STEPS))
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["prewarm"], config["model"]["max_model_len"] = True, 64  # micro-batches of 8 x 64 tokens
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rc, out = finish(start(run, 2, attempt=2))
    assert rc == 0, out
    resumed = metrics(run, 2)
    reference = metrics(uninterrupted, 1)
    assert [m["step"] for m in resumed] == [2, 3]
    for rank in (0, 1):
        log = (run / f"logs/attempt_2/trainer/rank_{rank}.log").read_text()
        assert "synthetic micro-batches of 512, 511, 255, 127, 63, 31, 1 tokens" in log
        assert "prewarmed" not in (uninterrupted / f"logs/attempt_1/trainer/rank_{rank}.log").read_text()
    for got, want in zip(resumed, reference[2:]):
        for key in ("train/loss", "train/entropy", "train/grad_norm", "train/mismatch_kl", "train/lr"):
            assert got[key] == want[key], key  # exact: CPU, fixed seed, restored optimizer/scheduler/RNG
    final, ref = load_file(run / "weights/step_4/model.safetensors"), load_file(uninterrupted / "weights/step_4/model.safetensors")
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_one_rank_matches_two_ranks_on_the_same_global_batch(tmp_path, tiny_model, uninterrupted):
    """The one rank without FSDP (trainer.flat_params: prl.trainer.flat) against FSDP over two: the whole
    loop, its versions and checkpoints, on the flat tensors."""
    run = make_run(tmp_path, tiny_model, 1, range(STEPS), flat_params=True)
    rc, out = finish(start(run, 1, attempt=1))
    assert rc == 0, out
    assert "one rank without FSDP" in (run / "logs/attempt_1/trainer/rank_0.log").read_text()
    for one, two in zip(metrics(run, 1), metrics(uninterrupted, 1), strict=True):
        for key in ("train/loss", "train/entropy", "train/grad_norm", "train/loss_tokens"):
            assert one[key] == pytest.approx(two[key], rel=1e-5, abs=1e-7), key
    one, two = load_file(run / "weights/step_4/model.safetensors"), load_file(uninterrupted / "weights/step_4/model.safetensors")
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def stopped_at_start(tmp_path_factory, tiny_model) -> tuple[Path, int, str]:
    """`stop_requested` exists before the ranks start (a USR1 the batch script got while the ranks
    still ignored it): they checkpoint step 0, before any optimizer step."""
    run = make_run(tmp_path_factory.mktemp("stopped_at_start"), tiny_model, 2, range(STEPS))
    (run / "logs/attempt_1").mkdir(parents=True)
    (run / "logs/attempt_1" / STOP_REQUEST).write_text("USR1 at 2026-01-01T00:00:00\n")
    rc, out = finish(start(run, 2, attempt=1))
    return run, rc, out


def test_stop_request_file_before_start_checkpoints_step_0(stopped_at_start):
    run, rc, out = stopped_at_start
    assert rc != 0 and f"exitcode  : {PREEMPTED_EXIT_CODE}" in out, out
    assert (run / "logs/attempt_1/preempted").read_text().strip() == "trainer: checkpoints/step_0"
    assert (run / "checkpoints/step_0/COMPLETE").exists()
    assert not (run / "weights/step_1").exists()
    assert read_data_order(RunDir(run), 0) is None  # no batch consumed: no data order to keep


def test_resume_from_step_0_equals_the_uninterrupted_run(stopped_at_start, uninterrupted):
    """A step-0 checkpoint restores a fresh optimizer: DCP's get_state_dict would have stepped the
    empty AdamW once (step count 1), and every loss from step 1 on would differ."""
    run, _, _ = stopped_at_start
    rc, out = finish(start(run, 2, attempt=2))
    assert rc == 0, out
    for got, want in zip(metrics(run, 2), metrics(uninterrupted, 1), strict=True):
        for key in ("train/loss", "train/entropy", "train/grad_norm", "train/lr"):
            assert got[key] == want[key], (got["step"], key)
    final, ref = load_file(run / "weights/step_4/model.safetensors"), load_file(uninterrupted / "weights/step_4/model.safetensors")
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_torchrun_started_as_the_batch_script_does_leaves_time_to_save(tmp_path, tiny_model):
    """torchrun SIGKILLs its workers a shutdown timeout (30 s; 1 s here: torch 2.13 reads it from
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, older ones hard-code 30 s) after a SIGTERM reaches it. Started with TERM ignored and not
    among --signals-to-handle, it leaves the ranks alone: SLURM's TERM (sent to every process of
    the step) makes them checkpoint, here a checkpoint that takes 4 s."""
    run = make_run(tmp_path, tiny_model, 1, range(0))
    proc = start(run, 1, attempt=1, env={"PRL_FAULT_CHECKPOINT_DELAY_S": "4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"},
                 torchrun_args=("--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",), preexec_fn=ignore_usr1_and_term)
    rank_log = run / "logs/attempt_1/trainer/rank_0.log"
    deadline = time.monotonic() + 120
    while "starting at step 0" not in (rank_log.read_text() if rank_log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    for pid in [proc.pid, *worker_pids(proc.pid)]:
        os.kill(pid, signal.SIGTERM)
    rc, out = finish(proc)
    assert (run / "checkpoints/step_0/COMPLETE").exists(), out
    assert (run / "logs/attempt_1/preempted").exists(), out


def ignore_usr1_and_term() -> None:
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def test_a_hung_rank_ends_the_run_as_stalled_with_every_stack_in_the_logs(tmp_path, tiny_model):
    watchdog = WatchdogConfig(stall_minutes=0.1, stall_factor=2, ready_timeout_s=600)  # no step for 6 s
    run = make_run(tmp_path, tiny_model, 2, range(STEPS), watchdog)
    rc, out = finish(start(run, 2, attempt=1, env={"PRL_FAULT_HANG_AT_STEP": "2"}))
    assert rc != 0 and f"exitcode  : {EXIT_STALLED}" in out, out
    stalled = (run / "logs/attempt_1" / STALLED).read_text()
    assert stalled.startswith("trainer rank ") and "batch 2" in stalled and len(stalled.splitlines()) == 1, stalled
    assert [m["step"] for m in metrics(run, 1)] == [0, 1]
    for rank in (0, 1):
        log = (run / f"logs/attempt_1/trainer/rank_{rank}.log").read_text()
        assert "stalled: trainer rank" in log and "most recent call first" in log, log
    assert "in fault_hang" in (run / "logs/attempt_1/trainer/rank_0.log").read_text()


def test_a_batch_without_loss_tokens_leaves_the_weights_exactly_as_they_were(tmp_path, tiny_model):
    """Batch 1 as the orchestrator writes it when every group had equal rewards: one padding
    micro-batch per rank. No optimizer step (AdamW would still move the weights through momentum
    and weight decay), version 2 published all the same, checkpoints as usual; resumed from the
    checkpoint after it, the run ends on the same weights."""
    run = make_run(tmp_path, tiny_model, 2, range(STEPS))
    write_batch(RunDir(run), Batch(step=1, policy_version=1, micro_batches=pack_batch([], 2, 8),
                                   metrics={"zero_advantage_group_frac": 1.0}))
    rc, out = finish(start(run, 2, attempt=1))
    assert rc == 0, out
    weights = {n: load_file(run / f"weights/step_{n}/model.safetensors") for n in (1, 2, 3)}
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
    assert not all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # and training goes on
    steps = metrics(run, 1)
    assert [m["step"] for m in steps] == list(range(STEPS)) and (run / "checkpoints/step_2/COMPLETE").exists()
    assert (steps[1]["train/skipped"], steps[1]["train/loss_tokens"], steps[1]["train/grad_norm"]) == (1.0, 0.0, 0.0)
    assert "train/skipped" not in steps[2] and steps[2]["train/lr"] == pytest.approx(1e-3)  # the schedule went on
    log = (run / "logs/attempt_1/trainer/rank_0.log").read_text()
    assert "step 1: batch 1 has no loss tokens" in log and "version 2 published all the same" in log

    final = load_file(run / f"weights/step_{STEPS}/model.safetensors")
    rewind.rewind(RunDir(run), 2)
    write_batches(run, 2, range(2, STEPS))
    rc, out = finish(start(run, 2, attempt=2))
    assert rc == 0, out
    resumed = load_file(run / f"weights/step_{STEPS}/model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 24 MiB tmpfs of its own (root: mount), so that filling it fills nothing else."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: the full-disk test needs `mount -t tmpfs`")
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(path: Path, leave: int) -> Path:
    """Write zeros into `path` until less than `leave` bytes are free on its filesystem."""
    with open(path, "wb") as f:
        while shutil.disk_usage(path.parent).free >= leave:
            f.write(b"\0" * 65536)
            f.flush()
    return path


def test_a_full_disk_during_a_checkpoint_fails_clearly_and_the_resume_uses_the_previous_one(small_filesystem, tiny_model):
    """The filesystem fills while checkpoint 4 is being written: the trainer exits non-zero saying so
    in one line (its log and logs/attempt_N/write_failed: what failed, the room left), checkpoint
    4 is not complete and its unfinished files are gone; with room again, the next launch continues
    from checkpoint 2 and completes, with nothing unfinished left behind."""
    run = make_run(small_filesystem, tiny_model, 1, range(STEPS))
    proc = start(run, 1, attempt=0, env={"PRL_FAULT_CHECKPOINT_DELAY_S": "3@4"})
    wait_for(proc, run / "checkpoints/step_4/.trainer.tmp")
    filler = fill(small_filesystem / "filler", leave=2**20)  # room for a log line, not for a checkpoint (5 MiB)
    rc, out = finish(proc)
    assert rc != 0, out
    line = (run / "logs/attempt_0/write_failed").read_text().strip()
    assert line.startswith("trainer rank 0: ") and "MiB free of 24 MiB on the filesystem of " in line, line
    assert f"cannot write: {line}" in (run / "logs/attempt_0/trainer/rank_0.log").read_text()
    assert (run / "checkpoints/step_2/COMPLETE").exists() and not (run / "checkpoints/step_4").exists()
    assert not rewind.unfinished(RunDir(run))

    filler.unlink()
    rc, out = finish(start(run, 1, attempt=1))
    assert rc == 0, out
    assert [m["step"] for m in metrics(run, 1)] == [2, 3]
    assert (run / "checkpoints/step_4/COMPLETE").exists() and not rewind.unfinished(RunDir(run))


@pytest.mark.slow
def test_each_step_says_how_many_frames_torch_compile_compiled_in_it(tmp_path, tiny_model):
    """trainer.compile without a prewarm (CPU's default): the first step compiles the decoder blocks,
    the later ones, of the same shapes, nothing; the metric `perf/compiled_frames` says so step by step,
    and no step after the first warns of a compile."""
    run = make_run(tmp_path, tiny_model, 1, range(STEPS), compile=True)
    rc, out = finish(start(run, 1, attempt=0), timeout=300)
    assert rc == 0, out
    compiled = [m["perf/compiled_frames"] for m in metrics(run, 0)]
    assert len(compiled) == STEPS and compiled[0] > 0 and compiled[1:] == [0] * (STEPS - 1), compiled
    assert "torch.compile compiled" not in (run / "logs/attempt_0/trainer/rank_0.log").read_text()



def test_expert_parallel_trains_an_moe_as_fsdp_does_and_resumes_exactly(tmp_path, tiny_moe_model):
    """trainer.expert_parallel on two ranks, 4 of the tiny Qwen3-MoE's 8 experts each, tokens by all-to-all:
    the losses, gradient norms, exported versions and checkpoint of the experts sharded by FSDP (the
    same sums in another order); its checkpoint holds every expert whole; rewound to step 2 it repeats
    steps 2-3 bit for bit, and with the key turned off it goes on from the same checkpoint."""
    runs = {}
    for ep in (False, True):
        runs[ep] = make_run(tmp_path / f"ep_{ep}", tiny_moe_model, 2, range(STEPS), expert_parallel=ep)
        rc, out = finish(start(runs[ep], 2, attempt=1))
        assert rc == 0, out
    for rank in (0, 1):
        log = (runs[True] / f"logs/attempt_1/trainer/rank_{rank}.log").read_text()
        assert "expert parallel: 4 of each layer's 8 experts on each of 2 ranks" in log
    for fsdp, ep in zip(metrics(runs[False], 1), metrics(runs[True], 1), strict=True):
        for key in ("train/loss", "train/entropy", "train/grad_norm", "routing/load_max_over_mean"):
            assert ep[key] == pytest.approx(fsdp[key], rel=1e-5, abs=1e-7), key
    final = {ep: load_file(runs[ep] / f"weights/step_{STEPS}/model.safetensors") for ep in runs}
    assert final[True].keys() == final[False].keys()
    for name in final[False]:
        torch.testing.assert_close(final[True][name], final[False][name], rtol=1e-4, atol=1e-5)
    ckpt = {ep: trainer_params(runs[ep], STEPS, tmp_path) for ep in runs}
    expert = next(k for k in ckpt[True] if k.endswith("mlp.experts.gate_up_proj"))
    assert ckpt[True][expert].shape == ckpt[False][expert].shape and ckpt[True][expert].shape[0] == 8
    torch.testing.assert_close(ckpt[True][expert], ckpt[False][expert], rtol=1e-4, atol=1e-5)

    rewind.rewind(RunDir(runs[True]), 2)
    write_batches(runs[True], 2, range(2, STEPS))
    rc, out = finish(start(runs[True], 2, attempt=2))
    assert rc == 0, out
    assert [m["step"] for m in metrics(runs[True], 2)] == [2, 3]
    resumed = load_file(runs[True] / f"weights/step_{STEPS}/model.safetensors")
    assert all(torch.equal(resumed[k], final[True][k]) for k in final[True])

    # The checkpoint is FSDP's layout: a job of the run may turn the key off and go on from it.
    rewind.rewind(RunDir(runs[True]), 2)
    write_batches(runs[True], 2, range(2, STEPS))
    config = yaml.safe_load((runs[True] / "config.yaml").read_text())
    config["trainer"]["expert_parallel"] = False
    (runs[True] / "config.yaml").write_text(yaml.safe_dump(config))
    rc, out = finish(start(runs[True], 2, attempt=3))
    assert rc == 0, out
    switched = load_file(runs[True] / f"weights/step_{STEPS}/model.safetensors")
    for name in final[True]:
        torch.testing.assert_close(switched[name], final[True][name], rtol=1e-4, atol=1e-5)
