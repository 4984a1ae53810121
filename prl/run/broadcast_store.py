"""The weight broadcast's store (prl.run.broadcast): where it listens, and what it holds, signed.

A torch TCPStore hosted by trainer rank 0. torch's own listener takes every interface of the node;
this one listens on the address the run's processes reach it at and nowhere else: loopback in
local mode, the trainer node's address for MASTER_ADDR under SLURM (prl.run.ports.listen).

The store takes any client that reaches it, lists its keys to it and lets it set or delete any of
them, so nothing the run reads from it is taken on trust (issue 53):
- every key lies under a prefix derived from the run's secret (`scoped`);
- the plan and the manifest are signed with the run's key (`put_signed` / `get_signed`);
- the control keys have/V, want/V and go/V carry in their names the run key's MAC over the store's
  nonce (a fresh one per store: a key copied from an earlier attempt's store does not count) and their
  value (`control`): a key nobody signed is never read;
- the rank each worker takes from the `rank` counter is claimed under member/R (`claim_rank`): a
  counter that was reset hands a rank out twice, which its second taker sees at once;
- each writer keeps its keys in place (`Keeper`): a key deleted or overwritten is put back within
  KEEP_EVERY_S and logged as tampering, so that deleting go/V delays an update by that much, neither
  by the store's timeout nor for the rest of the attempt.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import secrets
import threading

import torch.distributed as dist
from loguru import logger

from prl.run.ports import listen

KEEP_EVERY_S = 0.02
"""How often a Keeper puts back what was deleted or overwritten: about what one deletion of go/V or
have/V delays an update by."""
ABSENT = "\x00absent"
"""compare_set's expected value in `peek`: no value the run writes starts with a NUL."""


class Forged(RuntimeError):
    """What the store or the group said did not carry the run's signature."""


def store(host: str, port: int, host_it: bool, timeout_s: float) -> dist.TCPStore:
    """The handshake store: trainer rank 0 hosts it on `host`'s address alone (port 0: one the
    system picks), everyone else connects (waiting up to timeout_s)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not host_it:
        return dist.TCPStore(host, port, None, False, timeout=timeout)
    sock = listen(host, port)
    return dist.TCPStore(host, sock.getsockname()[1], None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts`, each length-prefixed (no two lists of parts sign the same bytes)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.digest()


def scoped(raw: dist.Store, key: bytes) -> dist.Store:
    """The run's view of the store: its keys under a prefix that only the secret gives."""
    return dist.PrefixStore(mac(key, b"store keys").hex()[:32], raw)


def signed(key: bytes, name: str, value) -> str:
    text = json.dumps(value)
    return json.dumps({"value": text, "mac": mac(key, name.encode(), text.encode()).hex()})


def put_signed(store_: dist.Store, key: bytes, name: str, value) -> None:
    store_.set(name, signed(key, name, value))


def get_signed(store_: dist.Store, key: bytes, name: str):
    """The value `put_signed` stored under `name`; Forged unless the run's key signed it."""
    try:
        record = json.loads(store_.get(name))
        text = record["value"].encode()
        good = hmac.compare_digest(bytes.fromhex(record["mac"]), mac(key, name.encode(), text))
    except (ValueError, KeyError, TypeError) as e:
        raise Forged(f"weight broadcast: the store's {name!r} is not the trainer's ({e})") from None
    if not good:
        raise Forged(f"weight broadcast: the store's {name!r} is not signed with the run's secret")
    return json.loads(text)


def peek(store_: dist.Store, name: str) -> bytes | None:
    """The value under `name` now, None when there is none; never waits. compare_set with an expected
    value no key holds changes nothing and answers the current value (or the expected one when absent)."""
    value = store_.compare_set(name, ABSENT, ABSENT)
    return None if value == ABSENT.encode() else value


def control(key: bytes, nonce: str, kind: str, version: int, value: str = "1") -> str:
    """The name of a control key (have, want, go) for `version` with `value`: the name carries the run
    key's MAC over the store's nonce, kind, version and value, so nobody without the secret can name
    one (its value is not read): a forged key is never looked at, and one cannot be deleted without
    listing the store first. Its presence is the message; a reader that waits for it (TCPStore.wait)
    is told the moment it is set, even if it is deleted right after."""
    tag = mac(key, b"control", nonce.encode(), kind.encode(), str(version).encode(), value.encode()).hex()[:32]
    return f"{kind}/{version}/{value}/{tag}"


def claim_rank(store_: dist.Store, rank: int) -> None:
    """Forged unless this process is the first to take `rank` (member/R is set once, compare_set)."""
    mine = secrets.token_hex(16)
    if store_.compare_set(f"member/{rank}", "", mine) != mine.encode():
        raise Forged(f"weight broadcast: tampering: rank {rank} was handed out twice (the store's rank counter "
                     "was reset by a process that is not the run's)")


class Keeper:
    """The keys one process put in the store, kept there: a thread puts back, every KEEP_EVERY_S, any
    that was deleted or overwritten, and logs it as tampering. The store's connection is shared with
    the owner's threads (TCPStore serializes its requests)."""

    def __init__(self, store_: dist.Store, owner: str):
        self.store, self.owner = store_, owner
        self.keys: dict[str, bytes] = {}
        self.reported: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{owner}-keeper", daemon=True)
        self.thread.start()

    def put(self, name: str, value: str | bytes) -> None:
        value = value.encode() if isinstance(value, str) else value
        with self.lock:
            self.keys[name] = value
            self.store.set(name, value)

    def drop(self, name: str, delete: bool) -> None:
        """Stop keeping `name`; `delete`: remove it from the store too."""
        with self.lock:
            self.keys.pop(name, None)
            if delete:
                self.store.delete_key(name)

    def restore(self) -> list[str]:
        """Put back what is not as this process left it; returns the names put back."""
        changed = []
        with self.lock:  # held throughout: a key the owner drops meanwhile is not put back
            for name, value in self.keys.items():
                if (now := peek(self.store, name)) != value:  # peek: a get would wait for a deleted key
                    self.store.set(name, value)
                    changed.append(name)
                    if name not in self.reported:  # once per key: an attacker's loop would flood the log
                        self.reported.add(name)
                        logger.warning(f"weight broadcast: tampering: the store's {name!r} was "
                                       f"{'deleted' if now is None else 'overwritten'} by a process that is "
                                       f"not the run's; the {self.owner} puts it back (logged once per key)")
        return changed

    def close(self, wait_s: float = 5.0) -> None:
        self.stop.set()
        self.thread.join(timeout=wait_s)

    def _run(self) -> None:
        while not self.stop.wait(KEEP_EVERY_S):
            try:
                self.restore()
            except Exception:  # the store is gone (the trainer exited): nothing left to keep
                return
