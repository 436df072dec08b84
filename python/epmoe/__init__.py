"""epmoe: expert placement (EPLB), balance scores, routing traces and the planner from Python.

The computation is epmoe's C++ library (the compiled ``_epmoe`` module); this package converts
arguments: lists, NumPy arrays and torch tensors in, NumPy arrays out (torch tensors where the input
was one). Errors are Python exceptions carrying the C++ message: ValueError for bad arguments,
FileNotFoundError, OSError, RuntimeError.
"""

import json

import numpy as np

from ._epmoe import (
    Placement,
    compute_placement,
    plan,
    policies,
    read_load_matrix,
    read_trace,
    score,
    write_trace,
)

__all__ = [
    "Placement",
    "compute_placement",
    "plan",
    "policies",
    "read_load_matrix",
    "read_sglang_dump",
    "read_trace",
    "rebalance_experts",
    "score",
    "write_sglang_expert_location",
    "write_trace",
]


def _is_torch_tensor(value):
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _as_float64(value):
    """A NumPy float64 array from a list, an array or a torch tensor (any device)."""
    if _is_torch_tensor(value):
        return value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, policy="deepseek", current=None):
    """DeepSeek EPLB's ``rebalance_experts``, same arguments and outputs.

    weight: [layers, num_logical_experts] load per expert (any non-negative numbers); num_replicas:
    physical experts per layer (logical experts + redundant copies), a multiple of num_gpus;
    num_groups: expert groups; num_nodes: server nodes; num_gpus: GPUs (ranks), a multiple of
    num_nodes. ``policy`` chooses another of epmoe's policies (``policies()``); ``current`` is the
    Placement in use, for "min-move".

    Returns (phy2log [layers, num_replicas], log2phy [layers, num_logical_experts, max copies],
    logcnt [layers, num_logical_experts]), int64; torch tensors when ``weight`` is one, else NumPy.
    log2phy lists an expert's copies in ascending slot order, -1 padded (DeepSeek's lists them in
    the order its replication made them: the same slots).
    """
    array = _as_float64(weight)
    if array.ndim != 2:
        raise ValueError(f"weight: need 2 dimensions [layers, num_logical_experts], got shape {array.shape}")
    placement = compute_placement(
        array,
        num_ranks=num_gpus,
        num_redundant=num_replicas - array.shape[1],
        num_nodes=num_nodes,
        num_groups=num_groups,
        policy=policy,
        current=current,
    )
    outputs = (placement.phy2log, placement.log2phy, placement.logcnt)
    if _is_torch_tensor(weight):
        import torch

        return tuple(torch.from_numpy(output) for output in outputs)
    return outputs


def read_sglang_dump(path):
    """The ``logical_count`` of an SGLang expert-distribution recorder dump as float64 NumPy.

    ``.pt`` files (``torch.save`` of a dict with "logical_count", as SGLang's recorder writes) are
    read with torch; other files as SGLang's JSON records through epmoe's trace reader. The result
    is [steps, layers, experts]: every hidden layer SGLang counts (dense layers hold zeros).
    """
    if str(path).endswith(".pt"):
        import torch

        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or "logical_count" not in data:
            raise ValueError(f"{path}: not an SGLang recorder dump (a dict with 'logical_count')")
        counts = _as_float64(data["logical_count"])
        if counts.ndim == 2:
            counts = counts[np.newaxis]
        if counts.ndim != 3:
            raise ValueError(f"{path}: logical_count has shape {counts.shape}, need [steps, layers, experts]")
        return counts
    return read_trace(str(path), format="sglang-json")["counts"].astype(np.float64)


def write_sglang_expert_location(placement, path, layer_ids=(), num_hidden_layers=0):
    """Writes the file SGLang's ``--init-expert-location`` reads: {"physical_to_logical_map": ...}.

    One row per hidden layer: row layer_ids[l] is the placement's layer l (default: layer l is
    hidden layer l), the other (dense) layers hold the trivial order as SGLang's own.
    """
    text = placement.to_sglang_json(list(layer_ids), num_hidden_layers)
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)
        out.write("\n")
    return json.loads(text)
