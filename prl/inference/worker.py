"""Code that runs inside every vLLM worker process, mixed into vLLM's worker class by `server.py` with
`--worker-extension-cls prl.inference.worker.WorkerExtension`; `reload.py` calls it through
`collective_rpc("prl_reload_weights", ...)`.

    python jobs/inference.py RUN/config.yaml      # the server that loads it

It wraps vLLM's own `reload_weights` (which knows how each backend lays weights out; calling
`model.load_weights` directly breaks on CPU, where linear weights are repacked after loading).
"""

from __future__ import annotations

from typing import Any

from prl.inference import compat

# vLLM imports this module in the worker before it compiles the model (it resolves
# --worker-extension-cls first), whether the engine was forked, spawned or runs in the API server's
# process. Importing it imports vLLM: only the worker does.
compat.keep_key_out_of_compile_cache()


class WorkerExtension:
    """Methods added to vLLM's worker; `self` is the worker (reload_weights, model_runner, model_config)."""

    prl_weights_path: str | None = None
    """The last directory loaded completely; None until the first update (then: the served model)."""
    prl_base_path: str | None = None
    """The model the server started from, which adapter versions (trainer.lora) are folded into."""

    def prl_reload_weights(self: Any, weights_path: str) -> str:
        """Load an HF safetensors directory in place of the current weights, or restore the last good ones.

        The fallback lives here, not in the API server, because the workers are the one place that
        knows what they hold: vLLM may run several API-server processes that each see only their
        own requests. A load that fails midway leaves layers half-replaced (vLLM first moves them to
        the meta device), so the previous weights are loaded again before the error is raised.
        Returns "staged" if it loaded the copy staged for this path (prl_stage_weights), else "file".
        """
        # Read before loading: reload_weights points model_config.model at the new directory.
        self.prl_base_path = self.prl_base_path or self.model_config.model
        previous = self.prl_weights_path or self.model_config.model
        staged = self.prl_take_staged(weights_path)
        try:
            _load(self, weights_path, staged)
        except Exception as e:
            _load(self, previous)  # raising from here means the weights are broken: the error says so
            raise RuntimeError(f"loading {weights_path} failed ({e}); restored {previous}") from e
        self.prl_weights_path = weights_path
        return "file" if staged is None else "staged"

    prl_staged: Any = None
    """prl.inference.readahead.Staged: the version read into host memory for the next update, if any."""
    prl_stage_buffers: dict | None = None
    """Host buffers of earlier staged versions, reused (file name -> buffer)."""

    def prl_stage_weights(self: Any, weights_path: str) -> str:
        """Start reading a full version into host memory for the update that will load it; returns at
        once (this runs in the engine's loop) with "staging" or why not."""
        from pathlib import Path

        from prl.inference import readahead
        from prl.run import lora

        if lora.is_adapter_version(Path(weights_path)):
            return "not staged: an adapter version (folded into the base weights as it loads)"
        if self.prl_staged is not None and not self.prl_staged.done:
            return f"not staged: still reading {self.prl_staged.path}"
        self.prl_staged = None  # an earlier one never loaded: its buffers are reused
        self.prl_stage_buffers = {} if self.prl_stage_buffers is None else self.prl_stage_buffers
        files = readahead.files_of(Path(weights_path))
        # Buffers that already hold a version of this size need no more memory (and are not counted
        # in MemAvailable any more).
        if not readahead.fits(files, self.prl_stage_buffers):
            import torch

            size = readahead.host_bytes(files, pinned=torch.cuda.is_available())
            if why := readahead.why_not(size, readahead.workers_on_node(self), readahead.mem_available()):
                return f"not staged: {why}"
        self.prl_staged = readahead.Staged(weights_path, self.prl_stage_buffers)
        return "staging"

    def prl_take_staged(self: Any, weights_path: str) -> list | None:
        """The staged tensors of `weights_path` (waiting for their read to end), or None: load the file."""
        staged = self.prl_staged
        if staged is None or staged.path != weights_path:
            return None
        self.prl_staged = None
        tensors, why = staged.take()
        if tensors is None:
            print(f"staged copy of {weights_path} not used: {why}; loading the file", flush=True)
        return tensors

    prl_receiver: Any = None
    """prl.run.broadcast.Receiver once this worker has joined the weight broadcast."""

    def prl_receive_weights(self: Any, version: int, weights_path: str) -> None:
        """Receive `version` by broadcast from trainer rank 0 and load it; `weights_path` is where the
        same version lands on disk: what a later failed file load restores, and what this loads
        instead when the version's tag does not match what arrived (before it serves a request)."""
        import torch

        from prl.run import broadcast as bc, lora
        from prl.run.attempt import Attempt

        if self.prl_receiver is None:
            if (attempt := Attempt.current()) is None:
                raise RuntimeError("this server is not part of a run's launch ($PRL_LOG_DIR unset): "
                                   "it cannot receive broadcast weights")
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            self.prl_receiver = bc.join(bc.Access.of(attempt), device)
        receiver = self.prl_receiver
        hashes = bc.Hashes(receiver.pool)
        self.prl_base_path = self.prl_base_path or self.model_config.model
        if receiver.plan and lora.is_adapter(receiver.plan[0][2][0].name):
            # An adapter version: all of it first (megabytes), then the base with it folded in.
            adapters = {name: tensor.clone() for name, tensor in receiver.receive(hashes)}
            self.reload_weights(weights_iterator=folded(self.prl_base_path, adapters, broadcast_scale()))
        else:
            self.reload_weights(weights_iterator=receiver.receive(hashes))
        if not receiver.verify(version, hashes):
            print(f"weight broadcast: version {version} does not match its tag (not what the trainer sent); "
                  f"loading {weights_path} instead", flush=True)
            wait_complete(weights_path)
            _load(self, weights_path)
            self.prl_weights_path = weights_path
            return
        repack(self)
        self.prl_weights_path = weights_path


def wait_complete(weights_path: str, timeout_s: float = 600.0) -> None:
    """Until the trainer's file of a version is complete (it writes it beside the broadcast)."""
    import time
    from pathlib import Path

    from prl.run.rundir import is_complete

    deadline = time.monotonic() + timeout_s
    while not is_complete(Path(weights_path)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{weights_path} is not complete after {timeout_s:.0f}s")
        time.sleep(0.2)


def _load(worker: Any, weights_path: str, staged: list | None = None) -> None:
    """Load a full version in place (from `staged`, its tensors read ahead into host memory, where
    given), or an adapter version (adapter_config.json beside its matrices) folded into the base
    model's weights."""
    from pathlib import Path

    from prl.run import lora

    if lora.is_adapter_version(Path(weights_path)):
        from safetensors.torch import load_file

        adapters = load_file(Path(weights_path) / lora.ADAPTER_FILE)
        base = worker.prl_base_path or worker.model_config.model
        worker.reload_weights(weights_iterator=folded(base, adapters, lora.scale_of(Path(weights_path))))
    elif staged is not None:
        worker.reload_weights(weights_iterator=iter(staged))
    else:
        worker.reload_weights(weights_path=weights_path)
    repack(worker)


def repack(worker: Any) -> None:
    """After any reload, by file or by broadcast: what vLLM's CPU backend does not repack by itself."""
    if getattr(worker.model_config.hf_text_config, "tie_word_embeddings", False):
        repack_tied_lm_head(worker.model_runner.get_model())
    repack_cpu_experts(worker.model_runner.get_model())


def repack_cpu_experts(model: Any) -> None:
    """Prepack an MoE's reloaded experts into the CPU backend's grouped-gemm layout again.

    vLLM's unquantized MoE method runs its experts' `process_weights_after_loading` (on CPU: pad and
    prepack w13/w2) only on the first load: on a weight update it skips it (`is_weight_update` in
    unquantized_fused_moe_method.py), so the CPU kernel reads the freshly loaded, unpacked weights as if
    packed, and generates garbage (tests/integration/test_moe.py). GPU backends' kernels read the
    loaded layout directly; on them this is not called."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)


def repack_tied_lm_head(model: Any) -> None:
    """Rebuild the CPU backend's packed copy of a tied LM head from the (already updated) embedding.

    vLLM's CPU backend multiplies with a packed copy of each weight (`layer.cpu_linear`, built in
    `process_weights_after_loading`). `reload_weights` repacks every layer it loads a tensor for, but
    a tied head has no tensor of its own in the checkpoint: it keeps the packed *old* embedding, and
    generation runs the new model with the old output head. GPU backends read the shared tensor
    directly and have no `cpu_linear`, so this does nothing there.
    """
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "cpu_linear"):
        return
    head.quant_method.process_weights_after_loading(head)


def broadcast_scale() -> float:
    import os

    from prl.run.protocol import LORA_SCALE_ENV

    if LORA_SCALE_ENV not in os.environ:
        raise RuntimeError(f"an adapter version came by broadcast, but ${LORA_SCALE_ENV} is unset (not a LoRA run's server)")
    return float(os.environ[LORA_SCALE_ENV])


def base_weights(model: str):
    """(HF name, tensor) of every weight of the served base model, read file by file (safetensors,
    memory-mapped: the node's page cache holds them for the next version, shared by its workers)."""
    from pathlib import Path

    from safetensors import safe_open

    directory = Path(model)
    if not directory.is_dir():  # a hub id: the snapshot vLLM itself loaded
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(model, local_files_only=True))
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def folded(base: str, adapters: dict, scale: float):
    """The base model's weights with an adapter version folded in (prl.run.lora), on this worker's GPU
    if it has one."""
    import torch

    from prl.run import lora

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return lora.merged_weights(base_weights(base), adapters, scale, device)
