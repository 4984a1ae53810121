"""Stand-in for a component that only checks the wiring (`run.mode=probe`): run it on a cluster
before a long run, and the tests run it on the test cluster.

    python jobs/probe.py inference|trainer|orchestrator|envserver RUN/config.yaml

Each probe writes what it saw to `$PRL_LOG_DIR/probe/<component>-<host>-<rank>.json` and exercises
the connections its real counterpart needs:
- inference serves HTTP on inference.port (answering its hostname) until it is terminated (with
  inference.replica_servers, on each replica's port);
- trainer (under torchrun) all-reduces across every rank with gloo; USR1 makes it exit 42, the
  trainer's "checkpointed, requeue me" status;
- orchestrator fetches every URL in PRL_INFERENCE_URLS;
- envserver (a run with an entry's server_workers) runs until it is terminated, on the orchestrator's node.
PRL_PROBE_EXIT=N makes a probe exit with status N after recording; PRL_PROBE_HOLD=S keeps the
trainer probe of the first attempt (attempt_0) running S seconds, to test signals and requeues; it
writes its pid to `probe/trainer-ready-<rank>` once its USR1 handler is in place.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request

from prl.run.attempt import Attempt
from prl.run.files import write_atomic
from prl.run.protocol import COMPILE_CACHES, PREEMPTED, STOP_REQUEST

WIRING_PREFIXES = ("PRL_", "MASTER_", "DATA_PARALLEL_", "SLURM_JOB_NODELIST", "SLURM_PROCID", "SLURM_RESTART_COUNT")
TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES")


def record(component: str, extra: dict) -> None:
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    seen = {k: v for k, v in os.environ.items()
            if k.startswith(WIRING_PREFIXES) or k in TORCH_VARS or k in COMPILE_CACHES}
    data = {"component": component, "hostname": socket.gethostname(), "pid": os.getpid(), "env": seen, **extra}
    out = Attempt.current().probe_dir / f"{component}-{socket.gethostname()}-{rank}.json"
    write_atomic(out, json.dumps(data, indent=1, sort_keys=True))
    print(json.dumps(data, sort_keys=True), flush=True)


def serve(ports: list[int]) -> None:
    """Every port the node's servers would take (one, or one per replica: inference.replica_servers)."""
    host = socket.gethostname().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(host)

    servers = [http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler) for port in ports]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    record("inference", {"port": ports[0], "ports": ports})
    servers[0].serve_forever()


def fetch_all(urls: list[str], timeout_s: float = 60) -> dict[str, str]:
    """GET each server (it may still be starting); the inference URLs end in /v1."""
    answers, deadline = {}, time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                answers[url] = urllib.request.urlopen(url, timeout=5).read().decode()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise SystemExit(f"probe: cannot reach {url}: {e}")
                time.sleep(0.5)
    return answers


def trainer_probe() -> dict:
    import torch
    import torch.distributed as dist

    got_usr1 = []
    signal.signal(signal.SIGUSR1, lambda *_: got_usr1.append(time.time()))
    stop_file = Attempt.current().marker(STOP_REQUEST)  # the script's checkpoint request
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    result = {"allreduce_sum": t.item(), "world_size": dist.get_world_size()}
    first_attempt = os.environ.get("PRL_ATTEMPT") == "0"
    hold_until = time.monotonic() + (float(os.environ.get("PRL_PROBE_HOLD", "0")) if first_attempt else 0)
    ready = Attempt.current().probe_dir / f"trainer-ready-{dist.get_rank()}"
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.write_text(str(os.getpid()))
    while time.monotonic() < hold_until and not got_usr1 and not stop_file.exists():
        time.sleep(0.2)
    if stop_file.exists():
        got_usr1.append(time.time())
    dist_rank = dist.get_rank()
    dist.destroy_process_group()
    if got_usr1 and dist_rank == 0:  # the trainer's contract: rank 0 marks the checkpoint done
        Attempt.current().write(PREEMPTED, "probe: stop requested\n")
    return result | {"usr1": bool(got_usr1)}



def main() -> int:
    component = sys.argv[1]
    if component == "inference" and "PRL_PROBE_EXIT" not in os.environ:
        from prl.config import load_config

        serve(load_config(sys.argv[2]).inference.ports)
    extra = {}
    if component == "trainer":
        extra = trainer_probe()
    elif component == "orchestrator":
        extra = {"answers": fetch_all(os.environ["PRL_INFERENCE_URLS"].split(","))}
    record(component, extra)
    if component == "envserver" and "PRL_PROBE_EXIT" not in os.environ:
        signal.pause()  # a server: it runs until the supervisor ends it
    if extra.get("usr1"):
        return 42
    return int(os.environ.get("PRL_PROBE_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
