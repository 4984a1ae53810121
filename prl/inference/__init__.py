"""The inference component: vLLM's OpenAI-compatible server per node, plus prl's routes.

    python jobs/inference.py RUN/config.yaml

Importing this package does not import vLLM (only `server.serve` does).

    server.py         maps the config to `vllm serve` flags and runs the server
    replicas.py       a node's replicas as independent servers (`inference.replica_servers`), and the teacher's
    teacher.py        the teacher's server (the `teacher` section): the config it serves
    routes.py         prl's routes inside vLLM's server (a middleware): weight updates, /prl/generate
    reload.py         POST /update_weights: a policy version (file, staged copy or broadcast) into the server
    readahead.py      staging: a version read into host memory while the engine generates
    worker.py         what runs inside every vLLM worker process (the weight load's half there)
    generate.py       POST /prl/generate: token ids in, sampled ids and their logprobs out
    toolcalls.py      the tool calls in a completion, found by the server's own tool-call parser
    compat.py         the vLLM API differences between the two versions prl runs under
    standalone.py     `jobs/inference.py` as a child process on this machine (tests, benchmarks)
"""
