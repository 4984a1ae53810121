"""What the GPU trainer's compiled step recompiles, found on a CPU: torch's varlen attention op given a
CPU kernel (per-sample SDPA, gradients by hand), so the decoder blocks take the GPU's attention path,
compiled with dynamic=True; the compiled loss kernels with the GPU's chunking; the prewarm; then steps
of varied micro-batches as first_step_bench.py draws them, with Dynamo's counters per step.

    TORCH_LOGS=recompiles,graph_breaks python benchmarks/recompile_probe.py --steps 6
    TORCH_LOGS=recompiles python benchmarks/recompile_probe.py --steps 12 --micro-batch-tokens 2048

Dynamo's guards are the GPU's (found this way: the prewarm's gradient layout, prl 6628591; a
1-row loss chunk, 34016f2). What only a GPU shows is not seen here: Triton kernels built for a new
integer specialization, the allocator. Needs torch.nn.attention.varlen (torch 2.10 or later).
"""
import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import varlen as V  # noqa: E402


def segments(cu):
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


def attend(q, k, v, cu, scale, gqa):
    outs = []
    for a, b in segments(cu):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@V._varlen_attn.register_kernel("cpu")
def _fwd(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
         enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    out = attend(query, key, value, cu_seq_q, scale, enable_gqa)
    return out, torch.zeros(query.size(1), query.size(0)), torch.zeros(2, dtype=torch.uint64)


@V._varlen_attn_backward.register_kernel("cpu")
def _bwd(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state, scale=None,
         window_size=None):
    # By hand: this kernel runs below autograd. [T, H, D] per sample; K/V heads repeated for GQA.
    groups = query.size(1) // key.size(1)
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    scale = scale if scale is not None else query.size(-1) ** -0.5
    for a, b in segments(cu_seq_q):
        q = query[a:b].transpose(0, 1)                                   # [H, t, D]
        k = key[a:b].transpose(0, 1).repeat_interleave(groups, 0)
        v = value[a:b].transpose(0, 1).repeat_interleave(groups, 0)
        do = grad_out[a:b].transpose(0, 1)
        s = q @ k.transpose(1, 2) * scale
        t = b - a
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        pr = s.softmax(-1)
        dv_ = pr.transpose(1, 2) @ do
        dp = do @ v.transpose(1, 2)
        ds = pr * (dp - (dp * pr).sum(-1, keepdim=True))
        dq[a:b] = (ds @ k * scale).transpose(0, 1)
        dk_ = ds.transpose(1, 2) @ q * scale
        dk[a:b] = dk_.unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
        dv[a:b] = dv_.unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
    return dq, dk, dv



def take_the_gpu_path() -> None:
    """The varlen attention for the blocks (attn_implementation's choice on CUDA); every micro-batch's
    tensors fresh, as the copies to a GPU make them (on CPU .to() would pass the batch's views on,
    whose bases Dynamo guards on)."""
    import prl.trainer.model as model
    import prl.trainer.prewarm as prewarm
    import prl.trainer.samples as samples
    import prl.trainer.train as train

    model.attn_implementation = lambda device: model.register_varlen(model._torch_varlen_attn(), device)
    to_device = samples.to_device

    def fresh(mb, device):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in to_device(mb, device).items()}

    samples.to_device = prewarm.to_device = train.to_device = fresh


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch-tokens", type=int)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stop-tokens", type=int, default=30)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256, help="the loss's chunk rows (4 x 1024 on GPU)")
    p.add_argument("--model", type=Path, default=HERE.parent / ".cache" / "tiny-qwen2")
    args = p.parse_args()
    args.micro_batch = 8
    take_the_gpu_path()
    import torch.distributed as dist
    from first_step_bench import compiled_so_far, varied_batch

    from prl.config import LossConfig, ModelConfig, TrainerConfig
    from prl.trainer.loss import build_loss
    from prl.trainer.model import build_model
    from prl.trainer.prewarm import micro_batch_lengths, prewarm
    from prl.trainer.train import accumulate, build_optimizer, train_step

    cpu = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainerConfig(gpus_per_node=0, lr=1e-6, compile=True, micro_batch_size=8,
                        micro_batch_tokens=args.micro_batch_tokens)
    model = build_model(ModelConfig(name=str(args.model), dtype="float32", max_model_len=args.max_len), cfg, 1.0, cpu)
    print("attention:", model.causal_lm.config._attn_implementation)
    model.compiled_loss, model.chunk_size = True, args.chunk  # as parallelize sets them on CUDA
    optimizer, scheduler = build_optimizer(model, cfg, cpu)
    vocab, loss_fn = model.causal_lm.config.vocab_size, build_loss(LossConfig())
    seconds = prewarm(model, accumulate, cpu, vocab, micro_batch_lengths(args.max_len, 8, args.micro_batch_tokens),
                      False, loss_fn)
    print(f"prewarm {seconds:.1f}s, compiled so far {compiled_so_far()}", flush=True)
    for step in range(args.steps):
        micro_batches = varied_batch(step, args, vocab).micro_batches[0]
        before, start = compiled_so_far(), time.perf_counter()
        train_step(model, optimizer, scheduler, micro_batches, cfg, cpu, loss_fn)
        new = {k: v - before[k] for k, v in compiled_so_far().items()}
        tokens = [mb["input_ids"].shape[1] for mb in micro_batches]
        print(f"step {step}: {time.perf_counter() - start:.2f}s, tokens {tokens}, "
              f"samples {[mb['num_samples'] for mb in micro_batches]}, compiled {new}", flush=True)


if __name__ == "__main__":
    main()
