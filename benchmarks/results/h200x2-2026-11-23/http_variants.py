# Run on the GPU machine from the repository root (ad hoc, kept as run; the second call had the list
# edited to the flat_logprobs variant and "logprobs 0, detok False").
import asyncio, json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from rl_bench_engine import http_batch, step0_inputs, prompt_ids, SEED_KEY
from prl.config import load_config
from prl.inference.local import start_server
cfg = load_config("/tmp/rlb1/diagnose.yaml"); M = cfg.model.name
env, groups = step0_inputs(256)
ids = prompt_ids(M, groups); items = [i for g in groups for i in g]
srv = start_server(Path("/tmp/rlb1/diagnose.yaml"), output=Path("/tmp/e_server.out")); srv.wait_healthy(timeout_s=300)
def gen(**sp): return [{"token_ids": p, "sampling_params": {"temperature": 1.0, "max_tokens": 1024, "ignore_eos": True, "seed": it[SEED_KEY], **sp}} for p, it in zip(ids, items)]
try:
    for name, path, bodies in [("generate no logprobs, detok False", "/inference/v1/generate", gen(detokenize=False)),
                               ("generate logprobs 0, detok False", "/inference/v1/generate", gen(logprobs=0, detokenize=False)),
                               ("generate logprobs 0, detok True", "/inference/v1/generate", gen(logprobs=0)),
                               ("generate no logprobs, detok True", "/inference/v1/generate", gen())]:
        r = asyncio.run(http_batch(srv.url, path, bodies)); print(name, json.dumps(r), flush=True)
finally:
    srv.stop()
