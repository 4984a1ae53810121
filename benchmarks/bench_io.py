"""Helpers of trainer_bench.py: one profiled step, and weight-export / checkpoint timings.

    python benchmarks/trainer_bench.py --model-preset qwen2-1.5b ... --profile-out prof.txt --io-dir /tmp/io
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from prl.run.rundir import RunDir
from prl.trainer.ckpt import checkpoint_dir, load_checkpoint, save_checkpoint
from prl.trainer.export import (Adapter, BackgroundWriter, gather_state_dict, save_weights, weights_dir, write_adapter,
                               write_weights)

KINDS = (  # (kind, name fragments), first match wins; names lower-cased
    ("nccl", ("nccl",)),
    ("fsdp copies (gather in/out, gradient split)", ("chunk_cat", "split_with_sizes_copy", "all_gather_copy_in")),
    ("optimizer + clip (fused AdamW, foreach ops)", ("adam", "multi_tensor_apply")),
    # the LM head's kernels by the ops Inductor names them after: the logprob/entropy kernel (amax, then exp
    # and gather) and its gradient (arange == target, exp); before 2026-12-03 a logsumexp
    ("lm-head softmax kernels (compiled)", ("log_softmax", "logsumexp", "amax_div_exp_gather", "arange_eq_exp")),
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
    ("compiled (triton)", ("triton",)),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
)


def kind(name: str) -> str:
    lower = name.lower()
    return next((k for k, fragments in KINDS if any(f in lower for f in fragments)), "other (eager elementwise/reduction)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PHASES = "prl::"
"""Ranges profile_step labels (the LM head's forward and backward, the optimizer step); FSDP labels its own
(FSDP::...). Their device time spans the kernels launched inside them."""


@contextlib.contextmanager
def labelled_phases():
    """The LM head's chunked logprobs (forward, backward) and train.py's optimizer step (clip, AdamW,
    zero) inside record_function ranges, for this profile only (the classes and the module attribute
    are looked up at call time; put back after)."""
    import prl.trainer.train as train
    from prl.trainer.loss import _ChunkedLogprobs

    def label(name, fn):
        def wrapped(*args, **kwargs):
            with record_function(PHASES + name):
                return fn(*args, **kwargs)
        return wrapped

    saved = (_ChunkedLogprobs.forward, _ChunkedLogprobs.backward, train.optimizer_step)
    _ChunkedLogprobs.forward = staticmethod(label("lm_head forward", saved[0]))
    _ChunkedLogprobs.backward = staticmethod(label("lm_head backward", saved[1]))
    train.optimizer_step = label("optimizer step (clip, AdamW, zero)", saved[2])
    try:
        yield
    finally:
        _ChunkedLogprobs.forward, _ChunkedLogprobs.backward = (staticmethod(f) for f in saved[:2])
        train.optimizer_step = saved[2]


def busy_ms(kernels) -> tuple[float, list[tuple[float, float]]]:
    """Time with at least one kernel running (the union of their intervals, any stream), and the five
    longest gaps as (start into the step, length) in ms: where the GPU waited for the host."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    if not spans:
        return 0.0, []
    busy, gaps, (start, end), origin = 0.0, [], spans[0], spans[0][0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(((end - origin) / 1e3, (s - end) / 1e3))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy / 1e3, sorted(gaps, key=lambda g: -g[1])[:5]


def step_timeline(step_fn, micro_batches: list, device: torch.device) -> str:
    """One more step without the profiler, marked where each micro-batch starts (train.accumulate), where
    the optimizer step starts and ends, and at the end: for each mark the host's ms since the step began
    and the GPU's (a CUDA event queued there), and the GPU's lag behind the host. A lag near 0 means the
    GPU had run dry and waited for the host at that point; the step's host-bound stretches are between
    such marks. On a CPU the host's marks alone."""
    import prl.trainer.train as train

    marks: list[tuple[str, float, torch.cuda.Event | None]] = []
    cuda = device.type == "cuda"

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True) if cuda else None
        if event is not None:
            event.record()
        marks.append((name, time.perf_counter(), event))

    def marked(name, fn):
        def wrapped(*args, **kwargs):
            mark(name + " (enter)")
            out = fn(*args, **kwargs)
            mark(name + " (return)")
            return out
        return wrapped

    saved = (train.accumulate, train.optimizer_step)
    train.accumulate = marked("micro-batch", saved[0])
    train.optimizer_step = marked("optimizer step", saved[1])
    try:
        _sync(device)
        mark("step start")
        step_fn(micro_batches)
        mark("step end")
        _sync(device)
    finally:
        train.accumulate, train.optimizer_step = saved
    _, host0, event0 = marks[0]
    lines = ["step timeline, no profiler: mark, host ms, GPU ms (since the step start), GPU lag ms"]
    for name, host, event in marks:
        host_ms = (host - host0) * 1e3
        if event is None:
            lines.append(f"  {name:28s} {host_ms:9.1f}")
            continue
        gpu_ms = event0.elapsed_time(event)
        lines.append(f"  {name:28s} {host_ms:9.1f} {gpu_ms:9.1f} {gpu_ms - host_ms:9.1f}")
    return "\n".join(lines)


def profile_step(step_fn, micro_batches: list, device: torch.device, out: str) -> None:
    """One more step under torch.profiler: wall time, the GPU's busy time and its longest idle gaps, the
    device time of the labelled phases (LM head, optimizer, FSDP's), by kernel kind, top kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with labelled_phases(), profile(activities=activities) as prof:
        step_fn(micro_batches)
        _sync(device)
    wall_ms = (time.perf_counter() - start) * 1e3
    want = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    # User annotations (Optimizer.step#..., FSDP::..., nccl:...) span kernels already counted.
    events = [e for e in prof.key_averages() if e.device_type == want and not getattr(e, "is_user_annotation", False)]
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    times = sorted(((getattr(e, attr) / 1e3, e.count, e.key) for e in events), reverse=True)
    total = sum(t for t, _, _ in times)
    by_kind: dict[str, float] = {}
    for t, _, name in times:
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + t
    lines = [f"one step, {len(micro_batches)} micro-batches, rank {dist.get_rank()}: wall {wall_ms:.1f} ms (profiler on), "
             f"kernel time {total:.1f} ms ({total / wall_ms:.0%} of wall; streams may overlap)"]
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == want and not getattr(e, "is_user_annotation", False)]
        busy, gaps = busy_ms(kernels)
        lines += [f"GPU busy {busy:.1f} ms of the first to last kernel; idle gaps (at ms, for ms): "
                  + ", ".join(f"{at:.1f}: {gap:.2f}" for at, gap in gaps)]
        phases: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == want and e.name.startswith((PHASES, "FSDP::")):
                phases.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
        lines += ["", "labelled phases (device time from their first kernel to their last, ms; x count):"]
        lines += [f"  {sum(t):9.1f} ms x{len(t):<4d} {name}" for name, t in sorted(phases.items(), key=lambda kv: -sum(kv[1]))]
    lines += ["", "time by kind:"]
    lines += [f"  {k:38s} {t:9.1f} ms {t / total:6.1%}" for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines += ["", f"top kernels ({attr}):"]
    lines += [f"  {t:9.2f} ms {t / total:6.1%} x{count:<5d} {kind(name)[:10]:10s} {name[:200]}" for t, count, name in times[:100]]
    if device.type == "cuda":  # where the host's time goes: a step whose GPU waits on it is host-bound
        host = sorted(((e.self_cpu_time_total / 1e3, e.count, e.key) for e in prof.key_averages()
                       if e.device_type == DeviceType.CPU), reverse=True)
        lines += ["", "host: top operators and annotated regions by self CPU time (ms, profiler on):"]
        lines += [f"  {t:9.2f} ms x{count:<5d} {name[:160]}" for t, count, name in host[:30]]
    if dist.get_rank() == 0:
        Path(out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:30]))


def _timed(fn, device) -> float:
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - start


def _size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def time_io(model, optimizer, scheduler, config, io_dir: str, adapter: Adapter | None = None) -> str:
    """Weight export (gather + safetensors write, and the blocking part with the background writer)
    and DCP checkpoint save/load, each timed once, on this model as trained (`adapter`: versions
    and checkpoints of a LoRA model, trainer.lora)."""
    device = next(model.parameters()).device
    root = Path(io_dir)
    run = RunDir(root / "run")
    source = root / "source"
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        source.mkdir(parents=True)
        config.to_json_file(source / "config.json")
    dist.barrier()
    holder = {}
    gather_s = _timed(lambda: holder.update(state=gather_state_dict(model, torch.bfloat16, adapter=adapter)), device)
    write = (lambda state: write_adapter(state, adapter, run, 1)) if adapter else (lambda state: write_weights(state, source, run, 1))
    write_s = _timed(lambda: dist.get_rank() == 0 and write(holder.pop("state")), device)
    writer = BackgroundWriter()

    def export(step: int) -> float:  # what the training loop waits for; the write runs on
        return _timed(lambda: save_weights(model, torch.bfloat16, source, run, step, keep=4, writer=writer, adapter=adapter),
                      device)

    first_s = export(2)  # also allocates the pinned staging buffer
    writer.wait()  # in training the next step's compute covers the write
    blocking_s = export(3)
    drain_s = _timed(writer.wait, device)
    weights_gb = _size_gb(weights_dir(run, 3)) if dist.get_rank() == 0 else 0.0
    save_s = _timed(lambda: save_checkpoint(run, 2, model=model, optimizer=optimizer, scheduler=scheduler, keep_last=2), device)
    ckpt_gb = _size_gb(checkpoint_dir(run, 2)) if dist.get_rank() == 0 else 0.0
    load_s = _timed(lambda: load_checkpoint(run, 2, model, optimizer, scheduler), device)
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    what = "adapters" if adapter else "weights"
    return (f"{what} export ({weights_gb:.3f} GB bf16 safetensors): gather {gather_s:.2f} s + write {write_s:.2f} s; "
            f"with the background writer and pinned staging the step blocks {blocking_s:.2f} s ({first_s:.2f} s the first time; "
            f"the write drains in {drain_s:.2f} s more). "
            f"DCP checkpoint ({ckpt_gb:.2f} GB, {'adapters' if adapter else 'model'} + AdamW, {dist.get_world_size()} rank(s)): save {save_s:.2f} s, load {load_s:.2f} s")
