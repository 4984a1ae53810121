# Run on the GPU machine from the repository root (ad hoc, kept as run): the orchestrator's
# generate_step against the server rl_bench's diagnosis had started on port 50309.
import asyncio, json, sys, time
sys.path.insert(0, "benchmarks")
from rl_bench_engine import *
from prl.config import load_config
cfg = load_config("/tmp/rlb1/diagnose.yaml")
env, groups = step0_inputs(cfg.orchestrator.batch_size, cfg.orchestrator.environment.id)
url = "http://127.0.0.1:50309"
for route in sys.argv[1:]:
    t = time.time()
    print(route, json.dumps(asyncio.run(orchestrator_path(cfg, url, env, groups, route))), round(time.time() - t, 1), flush=True)
