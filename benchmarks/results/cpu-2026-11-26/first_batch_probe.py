import asyncio, time, sys
from pathlib import Path
import httpx
sys.path.insert(0, "/work/main")
from prl.inference.standalone import start_server
cfg = Path("/tmp/fb/c.yaml")
cfg.write_text("run: {name: fb, output_dir: /tmp/fb/out}\nmodel: {name: /work/main/.cache/tiny-qwen2, dtype: float32, max_model_len: 512}\n"
               "inference: {gpus_per_node: 0, enforce_eager: true, env: {VLLM_CPU_KVCACHE_SPACE: '1'}}\norchestrator: {environment: {id: prl.envs.toy}}\n")
t0 = time.time()
srv = start_server(cfg, output=Path("/tmp/fb/server.out"))
srv.wait_healthy(600)
print(f"healthy after {time.time()-t0:.1f}s", flush=True)
async def batch(n, seed0):
    async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=600) as c:
        bodies = [{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8] * 4, "sampling_params": {"temperature": 1.0, "max_tokens": 16, "seed": seed0 + i}} for i in range(n)]
        t = time.time()
        rs = await asyncio.gather(*[c.post("/prl/generate", json=b) for b in bodies])
        assert all(r.status_code == 200 for r in rs), rs[0].text
        return time.time() - t
try:
    for k in range(4):
        print(f"batch {k}: 64 requests in {asyncio.run(batch(64, 100*k)):.2f}s", flush=True)
    print(f"single: {asyncio.run(batch(1, 999)):.2f}s")
finally:
    srv.stop()
