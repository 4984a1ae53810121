"""The inference component: vLLM's OpenAI-compatible server per node, plus POST /update_weights.

    python jobs/inference.py RUN/config.yaml

`server` maps the config to `vllm serve` flags and runs it; `weights` is the weight-update route
and `worker` its half inside the vLLM workers.
Importing this package does not import vLLM (only `server.serve` does).
"""
