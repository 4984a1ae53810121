"""The weight broadcast's handshake and transfer (prl.run.broadcast), with real torch.distributed (gloo):
trainer rank 0's Sender in this process, the orchestrator's Coordinator beside it, and a receiving
"worker" in a process of its own, as in a run. The layout, hashes and signatures alone:
tests/unit/test_broadcast_layout.py; the whole loop with vLLM: tests/integration/test_e2e_local.py.

    pytest tests/integration/test_broadcast.py
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from broadcast_helpers import CPU, KEY, version_state
from helpers import DELETER
from loguru import logger

from prl.orchestrator import broadcast_coordinator
from prl.orchestrator.broadcast_coordinator import Coordinator
from prl.run import broadcast as bc, broadcast_store as bs
from prl.run.ports import free_port
from prl.trainer import broadcast_sender
from prl.trainer.broadcast_sender import Sender

RECEIVER = """
import os, sys, torch
from pathlib import Path
from prl.run import broadcast as bc, broadcast_store as bs
key, record, out, versions = bytes.fromhex(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
receiver = bc.join(bc.Access(key, record), torch.device("cpu"), timeout_s=60)
for version in map(int, versions):  # joined once, as a vLLM worker: each version as the trainer sends it
    if len(versions) > 1:
        sys.stdin.readline()  # as a server's update request: once the orchestrator was told go
    hashes = bc.Hashes(receiver.pool)
    torch.save({name: t.clone() for name, t in receiver.receive(hashes)}, out if len(versions) == 1 else f"{out}.{version}")
    tag = receiver.read_tag()
    print(receiver.backend, len(receiver.plan), receiver.matches(version, hashes, tag),
          receiver.matches(version + 1, hashes, tag), flush=True)
# Not the interpreter's exit: with the gloo group still alive, its teardown aborted the process now and
# then ("terminate called without an active exception", 1 run in about 40 on the 2-core VM). What
# this process stands for is a vLLM worker's receipt; the worker's own end is vLLM's shutdown.
os._exit(0)
"""


STRANGER = """
import datetime, json, sys, torch, torch.distributed as dist
from prl.run import broadcast as bc, broadcast_store as bs
# Knows the port (a scan finds it), not the secret. The store lists its keys to anyone.
raw = bs.store("127.0.0.1", int(sys.argv[1]), host_it=False, timeout_s=30)
keys = raw.list_keys()
prefix = next(k for k in keys if k.endswith("/" + bc.PLAN)).removesuffix(bc.PLAN)
print("outside the prefix:", [k for k in keys if not k.startswith(prefix)], flush=True)
print("keys:", " ".join(sorted(k.removeprefix(prefix) for k in keys if k.startswith(prefix))), flush=True)
store = dist.PrefixStore(prefix.rstrip("/"), raw)
plan = json.loads(json.loads(store.get(bc.PLAN))["value"])
rank = store.add(bc.RANK, 1)  # a worker's place
group = bc.new_group(store, rank, plan["world"], plan["backend"], 10)
try:
    bc.authenticate(group, b"guessed key", plan["nonce"], rank, plan["world"], torch.device("cpu"))
except bc.Forged as e:
    print("stranger:", e, flush=True)
bucket = torch.zeros(64, dtype=torch.uint8)
try:
    bc.broadcast(group, bucket)
    print("received", bucket.tolist(), flush=True)
except Exception as e:
    print("received nothing:", type(e).__name__, flush=True)
"""


def receive_in_child(access: bc.Access, out: Path, version: int | str, key: bytes = KEY) -> subprocess.Popen:
    """A worker's receipt of `version` ("V,W,...": each in turn, into out.V), in a process of its own;
    prints `backend buckets tag-matches tag-matches-as-version+1` per version."""
    return subprocess.Popen([sys.executable, "-c", RECEIVER, key.hex(), str(access.record), str(out), str(version)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def access(tmp_path) -> bc.Access:
    return bc.Access(KEY, tmp_path / "weights_store")


@pytest.fixture
def sender(access):
    sender = Sender(access, "127.0.0.1", world=2, backend="gloo", device=CPU, slots=3, timeout_s=60, bucket_bytes=2048)
    yield sender
    sender.close()


def test_the_version_asked_for_reaches_the_worker_exactly_and_older_ones_are_dropped(sender, access, tmp_path):
    # The store listens on a port the system picked, recorded where the run's processes look.
    assert access.address() == ("127.0.0.1", sender.raw_store.port)
    for version in (1, 2):
        sender.stage(version, sender.staging(), version_state(version))
    coordinator = Coordinator(access)
    assert asyncio.run(coordinator.offer(2, tmp_path / "no-file"))
    child = receive_in_child(access, tmp_path / "got.pt", version=2)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out
    # Three buckets of at most 2 KiB (the large tensor alone); the tag matches version 2 and would not
    # let the same bytes pass as version 3.
    assert out.split()[-4:] == ["gloo", "3", "True", "False"], out
    got, want = torch.load(tmp_path / "got.pt"), version_state(2)
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    # Version 1 was never asked for before a newer one: dropped, and anyone waiting is told so.
    assert coordinator.store.check([coordinator._name(bc.GO, 1, "0")])
    assert not coordinator.store.check([coordinator._name(bc.HAVE, 1)])
    deadline = time.monotonic() + 10
    while sender.held and time.monotonic() < deadline:  # sent: its host memory is free again
        time.sleep(0.01)
    assert sender.held == {} and sender.failed is None


def test_a_full_sender_drops_its_oldest_version_unsent_and_the_orchestrator_takes_the_file(sender, access, tmp_path):
    for version in (1, 2, 3):
        sender.stage(version, sender.staging(), version_state(version))
    sender.staging()  # a fourth export needs a slot: version 1 goes
    assert sorted(sender.held) == [2, 3]
    coordinator = Coordinator(access)
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "COMPLETE").touch()
    # Not held any more, its file complete: the file, at once, and the broadcast stays usable.
    assert not asyncio.run(coordinator.offer(1, tmp_path / "step_1"))
    assert not coordinator.broken


def test_a_version_staged_while_the_orchestrator_looks_goes_by_broadcast(sender, access, tmp_path, monkeypatch):
    """The trainer stages version 4 and writes its file between two of the orchestrator's looks (this
    process descheduled in between: seen once in CI, tests/cluster/test_slurm_rl.py). The file is complete by
    the time it looks at the store, so the store holds the version: broadcast, not the file."""
    from prl.orchestrator import broadcast_coordinator as coordination

    coordinator = Coordinator(access)
    done = tmp_path / "step_4"
    looks = []

    def complete_at_once(path: Path) -> bool:
        if not looks:  # the first look: meanwhile the trainer stages the version, then writes it
            sender.stage(4, sender.staging(), version_state(4))
            done.mkdir()
            (done / "COMPLETE").touch()
        looks.append(path)
        return done.joinpath("COMPLETE").exists()

    monkeypatch.setattr(coordination, "is_complete", complete_at_once)
    assert asyncio.run(coordinator.offer(4, done)), "a held version went by file"
    child = receive_in_child(access, tmp_path / "got.pt", version=4)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.split()[-2:] == ["True", "False"], out


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

    # No store recorded yet, then one recorded where nobody listens: the file decides, once complete.
    assert asyncio.run(offer(Coordinator(bc.Access(KEY, tmp_path / "weights_store")))) == (False, True)
    shutil.rmtree(done)
    bc.Access(KEY, tmp_path / "weights_store").publish("127.0.0.1", free_port())
    assert asyncio.run(offer(Coordinator(bc.Access(KEY, tmp_path / "weights_store")))) == (False, True)
    shutil.rmtree(done)
    assert asyncio.run(offer(Coordinator(None))) == (False, False)  # off: no wait at all


def test_a_stranger_who_takes_a_workers_rank_gets_no_weights_and_the_run_takes_the_file(sender, access, tmp_path):
    """Another user who found the store's port: it lists the keys, takes the worker's rank and joins
    the group, but cannot prove the run's secret. The trainer gives the broadcast up before any weight
    travels and offers no later version; the real worker, finding its rank taken, says so and fails
    the servers' update, after which the orchestrator takes the file (prl.orchestrator.policy)."""
    sender.stage(1, sender.staging(), version_state(1))
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(sender.raw_store.port)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3)  # has taken the rank
    coordinator = Coordinator(access)
    assert asyncio.run(coordinator.offer(1, tmp_path / "no-file"))  # go: the servers are asked to receive
    out, _ = stranger.communicate(timeout=120)
    # Every key of the handshake under the run's prefix, none under a plain name; listing finds them.
    keys = set(re.search(r"keys: (.*)", out).group(1).split())
    assert "outside the prefix: []" in out and {"manifest", "plan"} <= keys, out
    # The control keys' names carry their signature: a stranger can list them, not make one up.
    assert any(re.fullmatch(r"have/1/1/[0-9a-f]{32}", k) for k in keys), out
    assert "received nothing" in out and "received [" not in out, out
    assert isinstance(sender.failed, bc.Forged) and "rank(s) [1] of 2" in str(sender.failed)
    worker = receive_in_child(access, tmp_path / "got.pt", version=1)
    out, _ = worker.communicate(timeout=120)
    assert worker.returncode != 0 and "took a rank" in out, out
    sender.stage(2, sender.staging(), version_state(2))
    assert not coordinator.store.check([coordinator._name(bc.HAVE, 2)])  # nothing offered by broadcast any more


def test_a_manifest_rewritten_in_the_store_is_put_back_or_else_refused_by_the_worker(sender, access, tmp_path):
    """A stranger rewrites what the store says the version's tensors are: the trainer puts its own
    back within a tick, saying so. Rewritten where nobody puts it back (the trainer's keeper stopped),
    the worker finds it unsigned and leaves; the trainer's broadcast fails and the run goes on with files."""
    sender.stage(1, sender.staging(), version_state(1))
    raw = bs.store(*access.address(), host_it=False, timeout_s=10)
    manifest = next(k for k in raw.list_keys() if k.endswith("/" + bc.MANIFEST))
    original = raw.get(manifest)
    forged = [["embed.weight", [1 << 20], "uint8"]]
    raw.set(manifest, json.dumps({"value": json.dumps(forged), "mac": "00" * 32}))
    deadline = time.monotonic() + 5
    while raw.get(manifest) != original and time.monotonic() < deadline:
        time.sleep(0.01)
    assert raw.get(manifest) == original
    sender.keeper.close()
    raw.set(manifest, json.dumps({"value": json.dumps(forged), "mac": "00" * 32}))
    worker = receive_in_child(access, tmp_path / "got.pt", version=1)
    coordinator = Coordinator(access)
    assert asyncio.run(coordinator.offer(1, tmp_path / "no-file"))
    out, _ = worker.communicate(timeout=120)
    assert worker.returncode != 0 and "'manifest' is not signed with the run's secret" in out, out
    deadline = time.monotonic() + 60
    while sender.failed is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sender.failed is not None





def test_control_keys_deleted_as_they_appear_delay_an_update_by_ticks_and_the_broadcast_goes_on(
        sender, access, tmp_path):
    """Another Unix user (uid 65534 where the test runs as root) deletes have/V, want/V and go/V as they
    appear (issue 53: go/V deleted so held each update 60-600 s, then turned the broadcast off). Each
    writer puts its key back (the trainer within a tick, the orchestrator while it waits), the
    orchestrator is told of go/V when it is set, and the deletions are logged as tampering: two
    versions in a row go by broadcast, each within seconds, bit for bit."""
    stranger = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    deleter = subprocess.Popen([*stranger, sys.executable, "-c", DELETER, "127.0.0.1", str(sender.raw_store.port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=os.environ | {"PYTHONPATH": str(Path(bc.__file__).parents[2])})
    worker = receive_in_child(access, tmp_path / "got.pt", version="1,2")  # joins once, stays
    logs: list[str] = []
    sink = logger.add(logs.append, level="WARNING", format="{message}")
    coordinator, took = Coordinator(access), []
    try:
        assert deleter.stdout.readline() == "connected\n"
        for version in (1, 2):
            sender.stage(version, sender.staging(), version_state(version))
            start = time.monotonic()
            assert asyncio.run(coordinator.offer(version, tmp_path / "no-file"))
            took.append(time.monotonic() - start)
            worker.stdin.write("receive\n")
            worker.stdin.flush()
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0 and out.splitlines()[-2:] == ["gloo 3 True False"] * 2, out
        assert all(torch.equal(torch.load(f"{tmp_path}/got.pt.{v}")["embed.weight"], version_state(v)["embed.weight"])
                   for v in (1, 2))
        print(f"go after {took[0]:.2f}s and {took[1]:.2f}s under the deleter")
        assert max(took) < 10, took
    finally:
        deleter.kill()
        out, _ = deleter.communicate()
        logger.remove(sink)
    assert "deleted" in out, out  # it did delete (and not fail for want of a permission)
    assert sender.failed is None and not coordinator.broken
    assert any("tampering" in line and "deleted" in line for line in logs), logs


def test_a_stuck_sender_thread_costs_one_wait_then_files_and_the_trainer_logs_where(sender, access, tmp_path,
                                                                                     monkeypatch):
    """The trainer's broadcast thread stuck (here: in its look for want/V): the orchestrator waits for an
    answer once (ANSWER_TIMEOUT_S), then takes files for the rest of the attempt without waiting; the
    trainer's next export logs where the thread is (the CI flake of 2026-12-05 showed only the wait)."""
    release = threading.Event()

    def stuck() -> None:
        release.wait()

    monkeypatch.setattr(broadcast_coordinator, "ANSWER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(broadcast_sender, "STUCK_S", 0.5)
    logs: list[str] = []
    sink = logger.add(logs.append, level="WARNING", format="{message}")
    sender._wanted = stuck  # the thread's next look
    coordinator = Coordinator(access)
    try:
        sender.stage(1, sender.staging(), version_state(1))
        start = time.monotonic()
        assert not asyncio.run(coordinator.offer(1, tmp_path / "no-file"))
        waited, start = time.monotonic() - start, time.monotonic()
        assert 1.0 <= waited < 10 and coordinator.broken, waited
        assert not asyncio.run(coordinator.offer(2, tmp_path / "no-file"))  # no store looked at: at once
        assert time.monotonic() - start < 0.5
        sender.stage(2, sender.staging(), version_state(2))
        sender.stage(3, sender.staging(), version_state(3))
    finally:
        sender._wanted = lambda: None
        release.set()
        logger.remove(sink)
    assert any("files only from now on: no answer to want/1 in 1s" in line for line in logs), logs
    reports = [line for line in logs if "has not looked for a want/V" in line]
    assert len(reports) == 1 and "in stuck" in reports[0] and "trainer-keeper" in reports[0], reports


STORE_HOST = """
import time
from prl.run import broadcast_store as bs
store = bs.store("127.0.0.1", 0, host_it=True, timeout_s=60)
print(store.port, flush=True)
time.sleep(600)
"""
"""A broadcast store in a process of its own, which a test can stop (SIGSTOP) as a wedged server."""


def test_a_store_that_stops_answering_ends_the_broadcast_and_training_goes_on(access, tmp_path, monkeypatch):
    """The store stops answering (its process stopped): each request on the trainer's shared connection
    gives up after CONTROL_TIMEOUT_S (1 s here), the broadcast ends (logged once), and the trainer's offers
    return within a few of those, then at once; not after the group's timeout (600 s in a run). close()
    returns at once. (Trainer rank 0 hosts its store in a run; here the Sender connects to this one.)"""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(Path(bc.__file__).parents[2])})
    port = int(host.stdout.readline())
    real_store = bs.store
    monkeypatch.setattr(bs, "store", lambda address, _, host_it, timeout_s: real_store(
        address, port, host_it=False, timeout_s=timeout_s))
    monkeypatch.setattr(broadcast_sender, "CONTROL_TIMEOUT_S", 1.0)
    logs: list[str] = []
    sink = logger.add(logs.append, level="ERROR", format="{message}")
    sender = Sender(access, "127.0.0.1", world=2, backend="gloo", device=CPU, slots=3, timeout_s=60)
    try:
        sender.stage(1, sender.staging(), version_state(1))
        assert sender.failed is None
        os.kill(host.pid, signal.SIGSTOP)
        took = []
        for version in range(2, 7):  # from the fourth on, staging() drops the oldest: a request that waits
            start = time.monotonic()
            sender.stage(version, sender.staging(), version_state(version))
            took.append(time.monotonic() - start)
        assert sender.failed is not None and max(took) < 5 and took[-1] < 0.5, took
        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 15
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
        logger.remove(sink)
    failures = [line for line in logs if "weight broadcast: the store failed" in line]
    assert len(failures) == 1 and "files only from now on" in failures[0], logs
