"""The weight broadcast's parts that need no second process (prl.run.broadcast): the buffer's layout
and buckets, the pieces each tensor is hashed in, signed store values, the sender's choice of what
to offer, and the update request a worker takes. The handshake and transfer between processes:
tests/integration/test_broadcast.py.

    pytest tests/unit/test_broadcast_layout.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from broadcast_helpers import CPU, KEY, version_state

from prl.inference.reload import BadWeights, broadcast_version, weights_dir
from prl.run import broadcast as bc, broadcast_store as bs
from prl.trainer.broadcast_sender import Sender


@pytest.fixture
def access(tmp_path) -> bc.Access:
    return bc.Access(KEY, tmp_path / "weights_store")


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


def reference_digest(tensor: torch.Tensor) -> bytes:
    """The tensor digest as specified, on one thread from the raw bytes: SHA-256 over its length (8
    bytes, little-endian) and the SHA-256 of each HASH_PIECE_BYTES piece, in order."""
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    outer = hashlib.sha256(len(data).to_bytes(8, "little"))
    for start in range(0, max(len(data), 1), bc.HASH_PIECE_BYTES):
        outer.update(hashlib.sha256(data[start:start + bc.HASH_PIECE_BYTES]).digest())
    return outer.digest()


def test_a_tensor_hashes_in_pieces_alike_on_both_ends_and_every_piece_counts(monkeypatch):
    """Pieces of 64 bytes: the sender's per-tensor digests, a worker's per-bucket ones (2 KiB buckets,
    the MLP weight alone in its own) and the digest as specified agree; a byte changed in any piece,
    the last included, changes the tensor's digest, as does its length."""
    monkeypatch.setattr(bc, "HASH_PIECE_BYTES", 64)
    state = version_state(2)
    entries, total = bc.layout(bc.manifest_of(state))
    buffer = torch.zeros(total, dtype=torch.uint8)
    for name, view in bc.views(buffer, entries):
        view.copy_(state[name])
    with bc.hash_pool() as pool:
        sent, received = bc.Hashes(pool), bc.Hashes(pool)
        for entry in entries:
            sent.add(state[entry.name])
        for start, end, members in bc.buckets(entries, limit=2048):
            received.add_bucket(buffer[start:end].clone(), members, start).result()
        assert sent.digests() == received.digests() == [reference_digest(state[e.name]) for e in entries]
    weight = state["layers.0.mlp.weight"]
    assert len(bc.pieces(weight)) == -(-weight.numel() * 2 // 64)
    for index in (0, 64 * 7 + 5, weight.numel() * 2 - 1):
        changed = weight.clone()
        changed.view(-1).view(torch.uint8)[index] ^= 1
        assert reference_digest(changed) != reference_digest(weight), index
    assert reference_digest(weight.view(-1)[:-1]) != reference_digest(weight)


def test_versions_past_the_last_a_batch_asks_for_go_by_file_only(access, tmp_path, process_group):
    """A run of 5 steps at async_level 2 asks for versions 1 and 2 (batches 3 and 4); the trainer's
    versions 3-5 are written as files but not offered, so they hold no pinned buffer."""
    from prl.run.batch import last_policy_version, policy_version
    from prl.run.rundir import RunDir, is_complete
    from prl.trainer.export import BackgroundWriter, save_weights

    assert last_policy_version(5, 2) == max(policy_version(b, 2) for b in range(5)) == 2
    assert last_policy_version(5, 0) == 4 and last_policy_version(2, 3) == 0
    sender = Sender(access, "127.0.0.1", world=2, backend="gloo", device=CPU, slots=4, timeout_s=60,
                    last_version=last_policy_version(5, 2))
    source, rd, writer, model = tmp_path / "model", RunDir(tmp_path / "run"), BackgroundWriter(), torch.nn.Linear(3, 2)
    source.mkdir()
    (source / "config.json").write_text("{}")
    try:
        for version in range(1, 6):
            save_weights(model, torch.float32, source, rd, version, keep=8, writer=writer, sender=sender)
        writer.wait()
        assert sorted(sender.held) == [1, 2]
        assert [v for v in range(1, 6) if sender.store.check([sender._name(bc.HAVE, v)])] == [1, 2]
        assert all(is_complete(rd.weights_dir(v)) for v in range(1, 6))
    finally:
        sender.close()


def test_a_version_not_offered_gathers_into_a_spare_allocated_slot(access, tmp_path, process_group, monkeypatch):
    """Past the last version a batch asks for, the export gathers into a sender slot no held version
    uses whose buffer exists (on GPU: pinned already), not into the writer's buffer, pinned on the spot
    (7.5 s at 7B, h200x4-2026-11-28); held versions stay held. Without such a slot: the writer's."""
    from prl.run.rundir import RunDir
    from prl.trainer import export

    sender = Sender(access, "127.0.0.1", world=2, backend="gloo", device=CPU, slots=3, timeout_s=60, last_version=2)
    source, rd, writer = tmp_path / "model", RunDir(tmp_path / "run"), export.BackgroundWriter()
    model = torch.nn.Linear(3, 2)
    source.mkdir()
    (source / "config.json").write_text("{}")
    gathered_into = []
    gather = export.gather_state_dict
    monkeypatch.setattr(export, "gather_state_dict",
                        lambda *a, staging=None, **k: (gathered_into.append(staging), gather(*a, **k))[1])
    try:
        save_weights = export.save_weights
        for version in (1, 2):  # offered: each in a slot, whose buffer the GPU's views would allocate
            save_weights(model, torch.float32, source, rd, version, keep=8, writer=writer, sender=sender)
            gathered_into[-1].buffer = torch.empty(64, dtype=torch.uint8)
        assert sorted(sender.held) == [1, 2] and sender.spare() is None  # slot 3 has no buffer yet
        save_weights(model, torch.float32, source, rd, 3, keep=8, writer=writer, sender=sender)
        assert gathered_into[-1] is writer.staging
        sender.slots[2].buffer = torch.empty(64, dtype=torch.uint8)
        for version in (4, 5):
            save_weights(model, torch.float32, source, rd, version, keep=8, writer=writer, sender=sender)
            assert gathered_into[-1] is sender.slots[2]
        writer.wait()
        assert sorted(sender.held) == [1, 2]
    finally:
        sender.close()


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


def test_signed_values_survive_only_unchanged_and_under_their_own_name():
    store_ = dist.HashStore()
    bs.put_signed(store_, KEY, "plan", {"world": 2})
    assert bs.get_signed(store_, KEY, "plan") == {"world": 2}
    with pytest.raises(bc.Forged, match="not signed"):
        bs.get_signed(store_, bc.run_key("another run's secret, 43 characters long...."), "plan")
    store_.set("manifest", store_.get("plan"))  # moved under another name
    with pytest.raises(bc.Forged, match="not signed"):
        bs.get_signed(store_, KEY, "manifest")
    store_.set("plan", b"not json")
    with pytest.raises(bc.Forged, match="not the trainer's"):
        bs.get_signed(store_, KEY, "plan")


def test_a_rank_handed_out_twice_is_refused_by_its_second_taker_and_control_names_need_the_key():
    """Deleting the store's `rank` counter makes add() hand a rank out again: the second taker finds
    member/R claimed and stops at once (not in the group's forming, 600 s later). A control key's name
    carries the run key's MAC over the nonce, kind, version and value: another key names another one."""
    store_ = dist.HashStore()
    bs.claim_rank(store_, 1)
    with pytest.raises(bc.Forged, match="rank 1 was handed out twice"):
        bs.claim_rank(store_, 1)
    bs.claim_rank(store_, 2)
    name = bs.control(KEY, "nonce", bc.GO, 3, "1")
    assert name.startswith("go/3/1/") and name != bs.control(KEY, "other nonce", bc.GO, 3, "1")
    assert name != bs.control(bc.run_key("another run's secret, 43 characters long...."), "nonce", bc.GO, 3, "1")
    assert name != bs.control(KEY, "nonce", bc.GO, 3, "0")
