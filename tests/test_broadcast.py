"""The weight broadcast's handshake and transfer (prl.run.broadcast), with real torch.distributed (gloo):
trainer rank 0's Sender in this process, the orchestrator's Coordinator beside it, and a receiving
"worker" in a process of its own, as in a run. The whole loop with vLLM: tests/test_e2e_local.py.

    pytest tests/test_broadcast.py
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prl.inference.reload import BadWeights, broadcast_version, weights_dir
from prl.orchestrator.broadcast_coordinator import Coordinator
from prl.run import broadcast as bc
from prl.trainer.broadcast_sender import Sender

CPU = torch.device("cpu")
RECEIVER = """
import sys, torch
from prl.run import broadcast as bc
group, plan, backend = bc.join(("127.0.0.1", int(sys.argv[1])), timeout_s=60)
torch.save({name: t.clone() for name, t in bc.receive(group, plan, torch.device("cpu"))}, sys.argv[2])
print(backend, len(plan))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def version_state(seed: int) -> dict[str, torch.Tensor]:
    """Odd sizes and mixed dtypes: offsets that need aligning, and one tensor larger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(19, generator=g),
        "layers.0.mlp.weight": torch.randn(300, 41, generator=g).to(torch.bfloat16),
        "lm_head.bias": torch.randn(3, generator=g).to(torch.float16),
    }


def test_layout_aligns_every_tensor_and_buckets_cover_each_once_in_order():
    entries, total = bc.layout(bc.manifest_of(version_state(0)))
    assert all(e.offset % bc.ALIGN == 0 for e in entries)
    assert [e.nbytes for e in entries] == [37 * 19 * 2, 19 * 4, 300 * 41 * 2, 3 * 2]
    assert total >= entries[-1].offset + entries[-1].nbytes
    plan = bc.buckets(entries, limit=2048)
    assert [e for _, _, members in plan for e in members] == entries
    assert all(start == members[0].offset and end == members[-1].offset + members[-1].nbytes
               for start, end, members in plan)
    # Embedding and norm share 2 KiB; 24,600 bytes of MLP weight exceed it and travel alone.
    assert [len(m) for _, _, m in plan] == [2, 1, 1] and plan[1][1] - plan[1][0] == 300 * 41 * 2
    assert [len(m) for _, _, m in bc.buckets(entries, limit=1 << 20)] == [4]


def test_views_put_each_tensor_back_bit_for_bit():
    state = version_state(1)
    entries, total = bc.layout(bc.manifest_of(state))
    buffer = torch.zeros(total, dtype=torch.uint8)
    for name, view in bc.views(buffer, entries):
        view.copy_(state[name])
    back = dict(bc.views(buffer, entries))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())


def receive_in_child(port: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def sender():
    port = free_port()
    sender = Sender(("127.0.0.1", port), world=2, backend="gloo", device=CPU, slots=3, timeout_s=60, bucket_bytes=2048)
    sender.port = port
    yield sender
    sender.close()


def test_the_version_asked_for_reaches_the_worker_exactly_and_older_ones_are_dropped(sender, tmp_path):
    for version in (1, 2):
        sender.stage(version, sender.staging(), version_state(version))
    coordinator = Coordinator(("127.0.0.1", sender.port))
    assert asyncio.run(coordinator.offer(2, tmp_path / "no-file"))
    child = receive_in_child(sender.port, tmp_path / "got.pt")
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out
    assert out.split()[-2:] == ["gloo", "3"]  # three buckets of at most 2 KiB (the large tensor alone)
    got, want = torch.load(tmp_path / "got.pt"), version_state(2)
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    # Version 1 was never asked for before a newer one: dropped, and anyone waiting is told so.
    assert coordinator.store.get(bc.go_key(1)) == b"0" and not coordinator.store.check([bc.have_key(1)])
    deadline = time.monotonic() + 10
    while sender.held and time.monotonic() < deadline:  # sent: its host memory is free again
        time.sleep(0.01)
    assert sender.held == {} and sender.failed is None


def test_a_full_sender_drops_its_oldest_version_unsent_and_the_orchestrator_takes_the_file(sender, tmp_path):
    for version in (1, 2, 3):
        sender.stage(version, sender.staging(), version_state(version))
    sender.staging()  # a fourth export needs a slot: version 1 goes
    assert sorted(sender.held) == [2, 3]
    coordinator = Coordinator(("127.0.0.1", sender.port))
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "COMPLETE").touch()
    # Not held any more, its file complete: the file, at once, and the broadcast stays usable.
    assert not asyncio.run(coordinator.offer(1, tmp_path / "step_1"))
    assert not coordinator.broken


def test_without_a_store_the_orchestrator_waits_for_the_file(tmp_path):
    done = tmp_path / "step_4"

    async def trainer():  # finishes writing meanwhile
        await asyncio.sleep(0.2)
        done.mkdir()
        (done / "COMPLETE").touch()

    async def offer(coordinator: Coordinator) -> tuple[bool, bool]:
        """(what offer says, whether the file was complete by then)"""
        task = asyncio.create_task(trainer())
        result = await coordinator.offer(4, done)
        written = (done / "COMPLETE").exists()
        await task
        return result, written

    # Nobody listens on the port: connecting fails, the file decides, once it is complete.
    assert asyncio.run(offer(Coordinator(("127.0.0.1", free_port())))) == (False, True)
    shutil.rmtree(done)
    assert asyncio.run(offer(Coordinator(None))) == (False, False)  # off: no wait at all


@pytest.mark.parametrize("body, problem", [
    ({"version": -1, "path": "/x"}, "non-negative"),
    ({"version": "3", "path": "/x"}, "non-negative"),
    ({"version": True, "path": "/x"}, "non-negative"),
    ({"version": 3}, "body must be"),
    ({"version": 3, "path": "relative/dir"}, "absolute"),
])
def test_a_malformed_broadcast_update_is_refused_before_the_engine(body, problem):
    with pytest.raises(BadWeights, match=problem):
        weights_dir(body, exists=broadcast_version(body) is None)


def test_a_broadcast_update_names_a_file_that_need_not_exist_yet():
    body = {"version": 3, "path": "/nowhere/weights/step_3"}
    assert broadcast_version(body) == 3 and weights_dir(body, exists=False) == Path("/nowhere/weights/step_3")
    assert broadcast_version({"path": "/x"}) is None
