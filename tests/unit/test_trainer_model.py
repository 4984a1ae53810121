"""The policy forward: alignment with the HF logits, and packed samples that do not see each other."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prl.trainer.export import _tied_names
from prl.trainer.attention import _VARLEN, VARLEN, attn_implementation, register_varlen
from prl.trainer.model import PolicyModel
from prl.trainer.samples import sample_bounds


@pytest.fixture(scope="module")
def causal_lm():
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True,
        use_cache=False, attn_implementation=attn_implementation(torch.device("cpu")),
    )
    return Qwen2ForCausalLM(config).eval()


def test_cpu_uses_sdpa():
    for kernel in ("auto", "fa4", "torch"):  # trainer.attention is for GPUs; CPU runs never need a kernel package
        assert attn_implementation(torch.device("cpu"), kernel) == "sdpa"


def test_fa4_says_why_it_cannot_run_without_its_package(monkeypatch):
    import importlib.util

    from prl.trainer import attention

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("flash_attn") else real(name, *a))
    assert attention._fa4_ready(torch.device("cpu")) == "the flash-attn-4 package is not installed"
    assert not attention._flash_attn_2()


@pytest.mark.parametrize("interface, why", [
    ("def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=False,"
     " return_lse=False): pass\ndef _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False,"
     " cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None): pass\n", None),
    ("def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=False):"
     " pass\ndef _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, cu_seqlens_q=None,"
     " cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None): pass\n",
     "this flash-attn-4's flash_attn.cute.interface.flash_attn_varlen_func lacks return_lse"),
    ("def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=False,"
     " return_lse=False): pass\n", "this flash-attn-4's flash_attn.cute.interface._flash_attn_bwd lacks itself"),
    ("import a_cuda_library_that_is_not_there\n",
     "flash_attn.cute does not import: ModuleNotFoundError: No module named 'a_cuda_library_that_is_not_there'"),
])
def test_fa4_checks_the_functions_it_calls_in_the_installed_version(tmp_path, monkeypatch, interface, why):
    """prl::fa4_varlen calls the package's varlen function and its private backward: a flash-attn-4
    whose signatures differ (here: made-up versions of the package) is refused with what it lacks.
    Its kernel cache is turned on, before the import reads it, where the run names one (the private
    compile cache; unnamed, FA4 would use /tmp/USER/..., a path another user can create first)."""
    import os
    import sys

    from prl.trainer import attention

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text(interface)
    monkeypatch.syspath_prepend(str(tmp_path))
    ours = lambda: [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]  # noqa: E731
    for name in ours():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    try:
        assert attention._fa4_api_missing() == why
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    finally:  # the made-up package leaves with the test (monkeypatch then puts back a real one)
        for name in ours():
            del sys.modules[name]


def test_logprobs_are_the_hf_logits_shifted_by_one(causal_lm):
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20)[None]
    with torch.no_grad():
        logprobs, entropy = PolicyModel(causal_lm, temperature=0.5, chunk_size=6)(ids, pos)
        logits = causal_lm(input_ids=ids, position_ids=pos).logits.float() / 0.5
    ref = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    assert logprobs.shape == entropy.shape == (1, 20)
    assert logprobs[0, 0] == 0
    torch.testing.assert_close(logprobs[0, 1:], ref, rtol=1e-5, atol=1e-5)


def test_packed_forward_equals_separate_forwards(causal_lm):
    """With attention_mask=None and restarting position_ids, transformers (SDPA) builds a
    block-causal mask: each packed sample's logprobs are those of the sample run alone."""
    gen = torch.Generator().manual_seed(2)
    samples = [torch.randint(0, 512, (n,), generator=gen) for n in (7, 12, 5)]
    model = PolicyModel(causal_lm, chunk_size=8)
    packed_ids = torch.cat(samples)[None]
    packed_pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        packed, _ = model(packed_ids, packed_pos)
        separate = [model(s[None], torch.arange(len(s))[None])[0] for s in samples]
        # Control: one long sequence (positions 0..T-1) lets later samples attend to earlier ones.
        unpacked, _ = model(packed_ids, torch.arange(packed_ids.shape[1])[None])

    start = 0
    for s, alone in zip(samples, separate):
        # Position `start` (a sample's first token) is predicted from the previous sample: never a loss token.
        torch.testing.assert_close(packed[0, start + 1 : start + len(s)], alone[0, 1:], rtol=1e-5, atol=1e-5)
        start += len(s)
    assert not torch.allclose(unpacked[0, 8:19], separate[1][0, 1:], atol=1e-3)


def test_packed_gradients_equal_separate_gradients(causal_lm):
    gen = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 512, (n,), generator=gen) for n in (9, 6)]
    model = PolicyModel(causal_lm, chunk_size=4)

    def grads(run):
        causal_lm.zero_grad(set_to_none=True)
        run().backward()
        return [p.grad.clone() for p in causal_lm.parameters()]

    def packed_loss():
        pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
        logp, _ = model(torch.cat(samples)[None], pos)
        return (logp * (pos > 0)).sum()  # a sample's first token is predicted across the boundary

    def separate_loss():
        return sum(model(s[None], torch.arange(len(s))[None])[0].sum() for s in samples)

    for a, b in zip(grads(packed_loss), grads(separate_loss)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_tied_lm_head_is_written_once(causal_lm):
    assert _tied_names(causal_lm) == {"lm_head.weight"}


def test_one_token_padding_micro_batch_runs_backward(causal_lm):
    """The orchestrator pads ranks with one-token, no-loss micro-batches: every rank must still
    run forward and backward (FSDP's collectives pair up), with zero gradients."""
    causal_lm.zero_grad(set_to_none=True)
    logprobs, entropy = PolicyModel(causal_lm)(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    assert logprobs.shape == entropy.shape == (1, 1)
    logprobs.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in causal_lm.parameters())


VARLEN_CALLS = []


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature (no enable_gqa flag; grouped K/V heads work), on the CPU:
    causal SDPA per sample."""
    VARLEN_CALLS.append(q.shape)
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = [torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
    return torch.cat([o.transpose(0, 1) for o in out])


def strict_varlen(q, k, v, *args, **kwargs):
    """A kernel that wants one K/V head per query head."""
    if k.shape[1] != q.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")
    return reference_varlen(q, k, v, *args, **kwargs)


@pytest.mark.parametrize("kernel,grouped", [(reference_varlen, True), (strict_varlen, False)])
def test_varlen_path_equals_sdpa_with_host_sample_bounds(causal_lm, kernel, grouped):
    """The packed-attention path of the GPU (PyTorch's varlen kernel, here a CPU stand-in with its
    signature): grouped K/V heads are passed through when the kernel takes them (found by trying),
    expanded otherwise; sample bounds from the host give the logprobs SDPA's block mask gives."""
    saved = dict(_VARLEN)
    try:
        assert register_varlen(kernel, torch.device("cpu")) == VARLEN
        assert _VARLEN["gqa"] is grouped
        gen = torch.Generator().manual_seed(4)
        samples = [torch.randint(0, 512, (n,), generator=gen) for n in (7, 12, 5)]
        ids = torch.cat(samples)[None]
        pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
        cu_seqlens, max_len = sample_bounds(pos)
        assert cu_seqlens.tolist() == [0, 7, 19, 24] and max_len == 12
        model = PolicyModel(causal_lm, chunk_size=8)
        with torch.no_grad():
            sdpa, _ = model(ids, pos)
            causal_lm.config._attn_implementation = VARLEN
            VARLEN_CALLS.clear()
            varlen, _ = model(ids, pos, cu_seqlens, max_len)
            assert len(VARLEN_CALLS) == causal_lm.config.num_hidden_layers
            derived, _ = model(ids, pos)  # bounds from position_ids
    finally:
        causal_lm.config._attn_implementation = "sdpa"
        _VARLEN.clear()
        _VARLEN.update(saved)
    torch.testing.assert_close(varlen, sdpa, rtol=1e-5, atol=1e-5)
    assert torch.equal(derived, varlen)


def test_trainer_deterministic_switches_torch_deterministic_algorithms(monkeypatch):
    """trainer.deterministic: None = on for CPU (exact resume is tested there), off for GPU; an
    explicit value wins, and turning it on also pins cuBLAS's workspace (required on CUDA)."""
    import torch

    from prl.trainer.rank import seed_everything

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        cases = [(None, "cpu", True), (False, "cpu", False), (True, "cuda", True)]
        for setting, device, expected in cases:
            torch.use_deterministic_algorithms(False)
            seed_everything(0, torch.device(device), setting)
            assert torch.are_deterministic_algorithms_enabled() is expected, (setting, device)
        assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        torch.use_deterministic_algorithms(False)
        seed_everything(0, torch.device("cuda"), None)  # the GPU default: off
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_compiled_blocks_under_fsdp_take_the_head_width_as_a_constant(process_group, monkeypatch):
    """Blocks compiled by parallelize (compile_layers, then FSDP2) trace the attention head's width as
    the number it is: dynamo gave the int attributes of modules FSDP manages a guard source that
    dynamic=True reads as a symbol, and every index of the RoPE kernels was then divided by it at run
    time. One graph for every length, the views shaped by the constant."""
    from prl.config import TrainerConfig
    from prl.trainer.model import parallelize

    graphs = []
    real, capture = torch.nn.Module.compile, lambda gm, _: graphs.append(gm) or gm.forward  # one backend: one cache
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: real(self, backend=capture, **kw))
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, use_cache=False,
                         attn_implementation="sdpa")
    model = parallelize(PolicyModel(Qwen2ForCausalLM(config)), TrainerConfig(gpus_per_node=0, compile=True),
                        torch.float32, torch.device("cpu"))
    for length in (100, 70, 33):
        ids = torch.randint(0, 512, (1, length))
        model(ids, torch.arange(length)[None])[0].sum().backward()
    assert len(graphs) == 1
    inputs = [node.name for node in graphs[0].graph.nodes if node.op == "placeholder"]
    assert not [name for name in inputs if "head_dim" in name], inputs
    views = [node.args[1] for node in graphs[0].graph.nodes if node.target == "view"]
    assert views and all(shape[-1] == 32 for shape in views[:3]), views
