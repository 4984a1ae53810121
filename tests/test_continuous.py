"""orchestrator.continuous's pure parts: which finished groups a batch takes, and the feeding order.
(Against real vLLM: tests/test_orchestrator_vllm.py::test_continuous_mode_loads_versions_while_requests_run.)"""

from __future__ import annotations

from collections import deque

from prl.orchestrator.continuous import Finished, interleaved, take_fresh
from prl.orchestrator.data import EnvGroups


def finished(*started: int) -> deque[Finished]:
    return deque(Finished([{"id": i}], s, s) for i, s in enumerate(started))


def test_a_batch_takes_the_first_fresh_groups_per_environment_and_drops_stale_ones():
    queues = [finished(1, 0, 2, 2, 3), finished(2, 1)]
    chosen = [[], []]
    assert take_fresh(queues, [3, 2], chosen, oldest=2) == 3  # env 0's groups from v1 and v0, env 1's from v1
    assert [g.started for g in chosen[0]] == [2, 2, 3] and [g.started for g in chosen[1]] == [2]
    assert not queues[0] and not queues[1]  # env 1 still lacks one: the batch waits for it
    queues[1].extend(finished(0, 4, 5))
    assert take_fresh(queues, [3, 2], chosen, oldest=2) == 1
    assert [g.started for g in chosen[1]] == [2, 4] and [g.started for g in queues[1]] == [5]  # left for the next


def test_a_step_feeds_its_environments_evenly_mixed():
    parts = [EnvGroups("a", None, [["a"]] * 6, {}), EnvGroups("b", None, [["b"]] * 2, {})]
    order = [i for i, _, _ in interleaved(parts)]
    assert order == [0, 0, 1, 0, 0, 0, 1, 0] and len(order) == 8
    assert [group for _, _, group in interleaved(parts)].count(["b"]) == 2
