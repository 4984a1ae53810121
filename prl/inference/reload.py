"""POST /update_weights {"path": DIR}: load a trainer checkpoint (HF safetensors) into the running server.

    curl -X POST http://HOST:PORT/update_weights -H 'Content-Type: application/json' \\
         -d '{"path": "/abs/RUN/weights/step_3"}'
    # 200 {"status": "ok", "path": ..., "seconds": 0.2, "source": "file"}      400/401/500 {"error": "..."}
    #     "source": "staged" when every worker loaded it from its staged copy (below)
    # {"version": 3, "path": ...}: version 3 by broadcast from the trainer instead (prl.run.broadcast)
    # "in_flight": true (either form): running requests are kept, not waited for (below)
    # {"path": ..., "stage": true}: read it into host memory now, beside generation, for the update
    #     of the same path that follows (prl.inference.readahead); 200 {"status": "staging" | "not staged: why"}

Served from vLLM's own server by prl's middleware (`prl.inference.routes`).

One update: check the directory against the served checkpoint (names, shapes, truncation) so that
most bad paths never touch the engine -> pause (running requests finish on the old weights, new ones
queue) -> `prl_reload_weights` (worker.py) on every worker -> reset the prefix cache -> resume.

In flight (`orchestrator.continuous`): the pause freezes running requests where they are instead of
draining them; after the reload every one of them is preempted (its KV cache, computed by the old
weights, dropped with the prefix cache) and recomputed under the new weights when generation
resumes, so each token drawn after the update comes from the new version over its own context.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from loguru import logger
from starlette.requests import Request
from starlette.responses import JSONResponse

from prl.run import lora
from prl.run.rundir import step_of

ROUTE = "/update_weights"
WEIGHTS_ROOT_ENV = "PRL_WEIGHTS_ROOT"
"""The directory whose contents this server may load (links resolved), set by server.export_environment:
inference.weights_root, else the run's weights/."""


class BadWeights(ValueError):
    """The request or the directory it names cannot be loaded; the engine was not touched."""


def read_safetensors_header(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a .safetensors header; raises BadWeights if unreadable or truncated."""
    if not file.is_file():  # a FIFO or a device would block the reader, or never end
        raise BadWeights(f"{file}: not a regular file")
    try:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        data_end = max((info["data_offsets"][1] for info in header.values()), default=0)
        shapes = {name: list(info["shape"]) for name, info in header.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise BadWeights(f"{file}: not a readable safetensors file ({e})") from None
    # A trainer still writing (or killed mid-write) leaves a short file with a complete header.
    if file.stat().st_size < 8 + size + data_end:
        raise BadWeights(f"{file}: truncated ({file.stat().st_size} bytes, header needs {8 + size + data_end})")
    return shapes


def checkpoint_shapes(directory: Path) -> dict[str, list[int]]:
    """Tensor name -> shape over every *.safetensors file in `directory`."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise BadWeights(f"{directory}: holds no *.safetensors file")
    return {name: shape for file in files for name, shape in read_safetensors_header(file).items()}


def check_compatible(new: dict[str, list[int]], served: dict[str, list[int]]) -> None:
    """Every tensor of the served checkpoint must be present with its shape; extras must be known names.

    vLLM skips tensors it does not know only for some names (tied lm_head) and crashes mid-load on
    others, and silently keeps old values for missing ones: a trainer saving `_orig_mod.`/`module.`
    prefixed names would otherwise look like a successful update.
    """
    problems = []
    if missing := sorted(served.keys() - new.keys()):
        problems.append(f"missing {missing[:5]}")
    if unknown := sorted(new.keys() - served.keys() - {"lm_head.weight"}):
        problems.append(f"unexpected {unknown[:5]}")
    problems += [f"{k} has shape {new[k]}, served {served[k]}" for k in sorted(served.keys() & new.keys())
                 if new[k] != served[k]][:5]
    if problems:
        raise BadWeights("checkpoint does not match the served model: " + "; ".join(problems))


def check_adapter(new: dict[str, list[int]], served: dict[str, list[int]]) -> None:
    """An adapter version (trainer.lora): every matrix is peft's LoRA A or B of a served weight, in
    pairs whose product has that weight's shape."""
    try:
        fits = lora.pairs(new)
    except ValueError as e:
        raise BadWeights(f"not an adapter version: {e}") from None
    problems = [f"{name}: no such weight in the served model" for name in sorted(fits) if name not in served][:5]
    problems += [f"{name}: A {a} and B {b} do not fit its shape {served[name]}" for name, (a, b) in sorted(fits.items())
                 if name in served and (a[1] != served[name][1] or b[0] != served[name][0] or a[0] != b[1])][:5]
    if problems:
        raise BadWeights("adapters do not match the served model: " + "; ".join(problems))


def weights_dir(body: Any, exists: bool = True) -> Path:
    """The request's directory, absolute and (if `exists`) existing; raises BadWeights otherwise."""
    path = body.get("path") if isinstance(body, dict) else None
    if not isinstance(path, str) or not path:
        raise BadWeights('body must be a JSON object {"path": "<absolute directory>"}')
    directory = Path(path)
    if not directory.is_absolute():
        raise BadWeights(f"path must be absolute (the server reads it on its own node): {path}")
    if exists and not directory.is_dir():
        raise BadWeights(f"{path}: no such directory")
    return directory


def check_loadable(directory: Path, served_path: str, environ: dict | os._Environ = os.environ) -> None:
    """BadWeights unless `directory`, links resolved, is inside this server's weights root
    ($PRL_WEIGHTS_ROOT) or is the served model's own directory. Checked before anything is read,
    and saying nothing of what is there: a caller learns nothing about paths outside."""
    real = Path(os.path.realpath(directory))
    root = environ.get(WEIGHTS_ROOT_ENV)
    if (root and Path(root) in real.parents) or real == Path(os.path.realpath(served_path)):
        return
    raise BadWeights(f"{directory}: not in this server's weights directory ({root or 'none set'}) "
                     "nor the model it serves")


def flag(body: Any, key: str) -> bool:
    """A boolean field of the body, false when absent."""
    value = body.get(key, False) if isinstance(body, dict) else False
    if not isinstance(value, bool):
        raise BadWeights(f"{key} must be true or false, got {value!r}")
    return value


def broadcast_version(body: Any) -> int | None:
    """The version of a broadcast update ({"version": V, "path": ...}); None for a file update."""
    version = body.get("version") if isinstance(body, dict) else None
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise BadWeights(f"version must be a non-negative integer, got {version!r}")
    return version


class WeightSwapper:
    """Applies updates one at a time (per API-server process; vLLM serialises the reloads themselves)."""

    def __init__(self, engine: Any, served_path: str) -> None:
        self.engine = engine
        self.served_path = served_path
        self.lock = asyncio.Lock()
        self._served_shapes: dict[str, list[int]] | None = None
        self.version: int | None = None
        """The newest version received by broadcast (or loaded from weights/step_N); None: the served model."""

    def served_shapes(self) -> dict[str, list[int]] | None:
        """Shapes of the checkpoint the server started from; None when it is a hub id, not a directory."""
        if self._served_shapes is None and Path(self.served_path).is_dir():
            self._served_shapes = checkpoint_shapes(Path(self.served_path))
        return self._served_shapes

    async def update(self, directory: Path, in_flight: bool = False) -> tuple[float, str]:
        """Swap to `directory`; returns (seconds taken, "staged" if every worker loaded it from its
        staged copy else "file"). BadWeights: engine untouched; RuntimeError: the
        load failed in the workers, which restored the previous weights (the message says which).
        `in_flight`: keep running requests (module docstring) instead of letting them finish first."""
        # `directory` passed check_loadable in `handle`, the only caller. Off the event loop: a slow
        # or stuck filesystem must not stall every other request.
        new = await asyncio.to_thread(checkpoint_shapes, directory)
        if (served := await asyncio.to_thread(self.served_shapes)) is not None:
            (check_adapter if lora.is_adapter_version(directory) else check_compatible)(new, served)
        seconds, sources = await self._swap("prl_reload_weights", {"weights_path": str(directory)}, in_flight)
        self.version = step_of(directory)
        return seconds, "staged" if set(sources) == {"staged"} else "file"

    async def stage(self, directory: Path) -> str:
        """Have every worker start reading `directory` (prl.inference.readahead); the engine goes on
        generating. Returns the workers' answer ("staging", else why not). BadWeights as `update`."""
        new = await asyncio.to_thread(checkpoint_shapes, directory)
        if (served := await asyncio.to_thread(self.served_shapes)) is not None:
            (check_adapter if lora.is_adapter_version(directory) else check_compatible)(new, served)
        answers = await self.engine.collective_rpc("prl_stage_weights", kwargs={"weights_path": str(directory)})
        return "; ".join(sorted(set(map(str, answers))))

    async def receive(self, version: int, directory: Path, in_flight: bool = False) -> float:
        """Swap to `version`, broadcast by the trainer (prl.run.broadcast); `directory` is where its file
        copy lands. RuntimeError: the broadcast failed and the weights are mixed: the caller loads
        the file next, before anything is generated."""
        if self.version is not None and version <= self.version:
            # A version the run cannot want (the trainer only ever sends newer ones): refused before the
            # engine pauses, rather than have the workers wait for it.
            raise BadWeights(f"version {version} is not newer than the version served ({self.version})")
        kwargs = {"version": version, "weights_path": str(directory)}
        seconds, _ = await self._swap("prl_receive_weights", kwargs, in_flight)
        self.version = version
        return seconds

    async def _swap(self, method: str, kwargs: dict, in_flight: bool) -> tuple[float, list]:
        """(seconds, what each worker's `method` returned)."""
        async with self.lock:
            start = time.perf_counter()
            # "wait": running requests finish on the old weights, new ones queue until resume.
            # "keep": running requests stop where they are and go on after the resume.
            await self.engine.pause_generation(mode="keep" if in_flight else "wait", clear_cache=False)
            try:
                answers = await self.engine.collective_rpc(method, kwargs=kwargs)
            except Exception as e:
                logger.error(f"{method} {kwargs} failed: {e}")
                raise RuntimeError(str(e)) from e
            finally:
                # After the swap: cached prefixes hold KV computed by the old weights; kept running
                # requests hold some too, so they are preempted and recomputed.
                if not await self.engine.reset_prefix_cache(reset_running_requests=in_flight):
                    logger.error("prefix cache reset failed after a weight update")
                await self.engine.resume_generation()
            return time.perf_counter() - start, list(answers or [])


async def handle(request: Request, swapper: WeightSwapper) -> JSONResponse:
    """The route itself: status codes and log lines for one POST /update_weights."""
    if request.method != "POST":
        return JSONResponse({"error": "use POST"}, status_code=405)
    try:
        body = await request.json()
        version, keep, stage = broadcast_version(body), flag(body, "in_flight"), flag(body, "stage")
        directory = weights_dir(body, exists=False)
        check_loadable(directory, swapper.served_path)  # before anything about the path is looked at
        # A broadcast version's file is still being written (that is the point): only the name counts.
        weights_dir(body, exists=version is None)
        if stage:
            if version is not None or keep:
                raise BadWeights("stage reads a complete file: not with version or in_flight")
            status = await swapper.stage(directory)
            logger.info(f"stage {directory}: {status}")
            return JSONResponse({"status": status, "path": str(directory)})
        if version is None:
            seconds, source = await swapper.update(directory, keep)
        else:
            seconds, source = await swapper.receive(version, directory, keep), "broadcast"
    except json.JSONDecodeError:
        return JSONResponse({"error": "body is not JSON"}, status_code=400)
    except BadWeights as e:
        logger.warning(f"update_weights refused: {e}")
        return JSONResponse({"error": str(e)}, status_code=400)
    except Exception as e:
        return JSONResponse({"error": str(e)}, status_code=500)
    how = f"version {version} by broadcast" if version is not None else f"from {directory}"
    how += ", running requests kept" if keep else ""
    how += " (its staged copy)" if source == "staged" else ""
    logger.info(f"weights updated {how} in {seconds:.2f}s")
    return JSONResponse({"status": "ok", "path": str(directory), "seconds": seconds, "source": source})
