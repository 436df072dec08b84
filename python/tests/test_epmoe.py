"""The Python module against DeepSeek's published example, the C++ CLI, SGLang's file format and
bad input. Run by ctest (python_test) with PYTHONPATH=build/python."""

import json
import os
import subprocess
import tempfile

import numpy as np
import pytest

import epmoe

try:
    import torch
except ImportError:  # torch is optional for the module; its tests are skipped without it
    torch = None

TEST_DATA = os.environ.get("EPMOE_TEST_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data"))
REFERENCE = os.path.join(TEST_DATA, "deepseek_eplb_reference_example.json")
EPMOE_BINARY = os.environ.get("EPMOE_BINARY", os.path.join(os.path.dirname(__file__), "..", "..", "build", "epmoe"))


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE, encoding="utf-8") as f:
        return json.load(f)


def _args(ref):
    return ref["num_replicas"], ref["num_groups"], ref["num_nodes"], ref["num_gpus"]


def _check_outputs(phy2log, log2phy, logcnt, ref):
    phy2log, log2phy, logcnt = (np.asarray(x) for x in (phy2log, log2phy, logcnt))
    assert phy2log.tolist() == ref["expected_phy2log"]
    layers, experts = np.asarray(ref["weight"]).shape
    assert logcnt.shape == (layers, experts)
    assert log2phy.shape == (layers, experts, logcnt.max())
    for layer in range(layers):
        for expert in range(experts):
            slots = [s for s in log2phy[layer, expert] if s >= 0]
            assert len(slots) == logcnt[layer, expert]
            assert all(phy2log[layer, s] == expert for s in slots)


def test_deepseek_example_from_lists(reference):
    _check_outputs(*epmoe.rebalance_experts(reference["weight"], *_args(reference)), reference)


def test_deepseek_example_from_numpy(reference):
    for dtype in (np.float64, np.float32, np.int64, np.int32):
        outputs = epmoe.rebalance_experts(np.array(reference["weight"], dtype=dtype), *_args(reference))
        assert all(isinstance(x, np.ndarray) and x.dtype == np.int64 for x in outputs)
        _check_outputs(*outputs, reference)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_deepseek_example_from_torch(reference):
    for dtype in (torch.float32, torch.float64, torch.int64):
        outputs = epmoe.rebalance_experts(torch.tensor(reference["weight"], dtype=dtype), *_args(reference))
        assert all(isinstance(x, torch.Tensor) and x.dtype == torch.int64 for x in outputs)
        _check_outputs(*outputs, reference)


def test_vllm_policy_class(reference):
    from epmoe.vllm_policy import EpmoeEplbPolicy

    phy2log, _, _ = EpmoeEplbPolicy.rebalance_experts(np.array(reference["weight"]), *_args(reference))
    assert phy2log.tolist() == reference["expected_phy2log"]


# "cost" is left out: the CLI prices a 1024 x 1024 bf16 expert, compute_placement the default
# CostModel (unit-sized experts), so their cost placements differ by design.
@pytest.mark.parametrize("policy", ["deepseek", "deepseek-guarded", "per-step", "min-move"])
def test_random_loads_match_the_cli(policy):
    rng = np.random.default_rng(7)
    weight = rng.gamma(0.7, 50.0, size=(3, 4, 32))  # floats, 3 steps, layers totalling differently
    with tempfile.TemporaryDirectory() as tmp:
        load = os.path.join(tmp, "load.npy")
        np.save(load, weight)
        out = os.path.join(tmp, "placement.json")
        subprocess.run(
            [EPMOE_BINARY, "balance", "--load", load, "--ranks", "8", "--nodes", "2", "--groups", "4",
             "--redundant", "8", "--policy", policy, "--out", out],
            check=True, capture_output=True)
        from_cli = epmoe.Placement.read(out)
        assert np.array_equal(epmoe.read_load_matrix(load), weight)
    placement = epmoe.compute_placement(weight, num_ranks=8, num_redundant=8, num_nodes=2, num_groups=4,
                                        policy=policy)
    assert placement == from_cli
    assert np.array_equal(placement.phy2log, from_cli.phy2log)


def test_scores_and_placement_round_trip():
    weight = np.array([[10.0, 1, 1, 1], [1, 1, 1, 10]])
    trivial = epmoe.Placement(np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]), num_experts=4, num_ranks=2)
    placed = epmoe.compute_placement(weight, num_ranks=2, num_redundant=2)
    before, after = epmoe.score(trivial, weight), epmoe.score(placed, weight)
    # Trivial (rank 0 holds experts 0 1 2, rank 1 experts 3 0 1): layer 0 ranks carry 5+0.5+1 and
    # 1+5+0.5 (balanced), layer 1 0.5+0.5+1 and 10+0.5+0.5 (mean 6.5, max 11).
    assert before["balancedness"] == pytest.approx((1 + 6.5 / 11) / 2)
    assert after["balancedness"] > before["balancedness"]
    assert epmoe.Placement.from_json(placed.to_json()) == placed
    assert placed.moved_copies(placed) == 0


def test_sglang_expert_location_round_trips_through_sglangs_parsing():
    # Layers 1 and 3 of 5 hidden layers are MoE layers; the others are dense.
    weight = np.array([[5.0, 1, 1, 1], [1, 1, 1, 9]])
    placement = epmoe.compute_placement(weight, num_ranks=2, num_redundant=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "expert_location.json")
        epmoe.write_sglang_expert_location(placement, path, layer_ids=[1, 3], num_hidden_layers=5)
        # What SGLang does with --init-expert-location FILE.json: json.loads, then
        # physical_to_logical_map as a (layers, num_physical_experts) tensor, and per layer and
        # logical expert the list of its physical experts in slot order.
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read())
    assert list(data) == ["physical_to_logical_map"]
    table = np.array(data["physical_to_logical_map"])
    assert table.shape == (5, placement.num_slots)
    assert table[1].tolist() == placement.phy2log[0].tolist()
    assert table[3].tolist() == placement.phy2log[1].tolist()
    for dense in (0, 2, 4):
        assert table[dense].tolist() == [s % 4 for s in range(placement.num_slots)]
    for layer in range(5):
        for expert in range(4):
            physical = [s for s in range(table.shape[1]) if table[layer, s] == expert]
            assert physical, "every logical expert needs a physical copy"
    if torch is not None:
        assert torch.tensor(data["physical_to_logical_map"]).shape == (5, 6)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_sglang_recorder_dump_pt():
    logical_count = torch.zeros((3, 4, 8), dtype=torch.int32)  # 3 passes, 4 hidden layers (0 dense), 8 experts
    logical_count[:, 1:, :] = torch.randint(0, 50, (3, 3, 8), generator=torch.Generator().manual_seed(3))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "expert_distribution_recorder_1.pt")
        torch.save({"rank": 0, "logical_count": logical_count}, path)
        counts = epmoe.read_sglang_dump(path)
        with open(os.path.join(tmp, "bad.pt"), "wb") as f:
            torch.save({"something": 1}, f)
        with pytest.raises(ValueError, match="logical_count"):
            epmoe.read_sglang_dump(os.path.join(tmp, "bad.pt"))
    assert counts.shape == (3, 4, 8)
    assert np.array_equal(counts, logical_count.double().numpy())
    placement = epmoe.compute_placement(counts, num_ranks=4, num_redundant=4)
    assert placement.num_layers == 4  # every hidden layer, as SGLang's file needs


def test_trace_write_and_read():
    counts = np.array([[[3, 1, 0, 0], [1, 1, 1, 1]], [[0, 2, 2, 0], [4, 0, 0, 0]]], dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.epmoe")
        epmoe.write_trace(path, counts, top_k=2, rows=np.array([2, 2]), layer_ids=[3, 5])
        trace = epmoe.read_trace(path)
    assert np.array_equal(trace["counts"], counts)
    assert trace["rows"].tolist() == [2, 2]
    assert trace["top_k"] == 2
    assert trace["layer_ids"] == [3, 5]


def test_plan_returns_the_table():
    result = epmoe.plan("deepseek-v3", "b300x8", batches=[64], gpus=[8])
    assert result["costs"] and result["winners"]
    options = {c["option"] for c in result["costs"]}
    assert {"sliced", "whole", "hybrid", "a2a", "dwdp"} <= options
    assert all(c["step_ms"] > 0 for c in result["costs"] if c["applicable"])
    a2a = next(c for c in result["costs"] if c["option"] == "a2a")
    assert a2a["label"] == "a2a low-latency"  # decode's auto mode
    assert a2a["exposed_comm_us"] == a2a["comm_us"] and a2a["inter_node_mb"] == 0  # one node, no overlap


def test_errors_are_python_exceptions_with_the_cpp_message(reference):
    with pytest.raises(ValueError, match="do not split evenly over 7 ranks"):
        epmoe.rebalance_experts(reference["weight"], 16, 4, 1, 7)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        epmoe.rebalance_experts([[1.0, -2.0]], 2, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown policy"):
        epmoe.rebalance_experts(reference["weight"], 16, 4, 2, 8, policy="magic")
    with pytest.raises(ValueError, match="need 2 dimensions"):
        epmoe.rebalance_experts([1.0, 2.0], 2, 1, 1, 1)
    with pytest.raises(FileNotFoundError, match="nonexistent"):
        epmoe.Placement.read("/nonexistent/placement.json")
    with pytest.raises(ValueError, match="layer id 9"):
        epmoe.compute_placement([[1.0, 2.0]], num_ranks=1).to_sglang_json([9], 4)
    with pytest.raises(FileNotFoundError):
        epmoe.plan("no-such-model", "b300x8", batches=[1], gpus=[8])
