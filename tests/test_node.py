"""A node's declared device size, and how a trial's move to another node is told."""

import pytest

from orchestrator.contract import Move, describe_moves
from orchestrator.trial.node import CAPACITY_LABEL, NodeInfo, left_its_node, restart_reason

MiB = 2**20


def test_a_node_declares_its_emulated_capacity_with_a_label():
    assert NodeInfo("id", "node-c", {CAPACITY_LABEL: "2MiB"}).capacity(4 * MiB) == 2 * MiB
    assert NodeInfo("id", "head", {"ray.io/node-id": "id"}).capacity(4 * MiB) == 4 * MiB  # memory.capacity
    with pytest.raises(ValueError, match=f"node node-c: label {CAPACITY_LABEL}='lots'"):
        NodeInfo("id", "node-c", {CAPACITY_LABEL: "lots"}).capacity(None)


def test_a_move_says_where_from_where_to_and_why():
    move = Move("node-b", "node-c", 2, "node node-b lost", "256 x 1 -> 178 x 2 (budget 4.0 MiB -> 2.0 MiB)")
    assert Move.from_dict(move.to_dict()) == move
    assert describe_moves([move, Move("node-c", "head", 4, "its worker died on node node-c")]) == (
        "moved node-b->node-c after epoch 2: node node-b lost; re-planned 256 x 1 -> 178 x 2 (budget 4.0 MiB -> 2.0 MiB); "
        "moved node-c->head after epoch 4: its worker died on node node-c"
    )
    # Epochs count from 1, as in the tables: a move from a checkpoint inside the first epoch.
    assert Move("node-b", "head", 0, "node node-b lost").describe() == "moved node-b->head in epoch 1: node node-b lost"


def test_why_a_trial_left_its_node():
    assert restart_reason("node_died", "id", "node-b") == "node node-b lost"
    assert restart_reason("worker_died", "id", "node-b") == "its worker died on node node-b"
    assert restart_reason(None, "id", "node-b") == "restarted on another node"  # e.g. a resumed sweep


def test_a_trial_resumed_on_a_restarted_node_of_the_same_name_did_not_move():
    here = NodeInfo("new-id", "node-b", {})
    assert not left_its_node({"node_id": "old-id", "node_name": "node-b"}, here)  # --resume, a requeued job
    assert left_its_node({"node_id": "old-id", "node_name": "node-a"}, here)
    assert left_its_node({"node_id": "old-id"}, here)  # a checkpoint with no name: ids decide
    assert not left_its_node({"node_id": "new-id"}, here)
