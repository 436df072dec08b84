"""An EPLB policy class for vLLM that places experts with epmoe.

vLLM (``vllm/distributed/eplb/policy/``) picks its policy by name from a dict of classes whose
class method ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks)`` returns
(physical_to_logical_map, logical_to_physical_map, logical_replica_count) as torch tensors. vLLM has
no plug-in entry point for policies, so registering this class is a line in the serving process:

    from vllm.distributed.eplb import policy as vllm_policy
    from epmoe.vllm_policy import EpmoeEplbPolicy
    vllm_policy.EPLB_POLICIES["epmoe"] = EpmoeEplbPolicy   # then eplb_config.policy = "epmoe"

``EpmoeEplbPolicy.policy`` chooses epmoe's policy ("deepseek" gives DeepSeek's placement;
subclass and set "deepseek-guarded" for at most one copy of an expert per rank).
"""

import epmoe

try:  # the base class when vLLM is installed; a plain class otherwise (for use and tests without it)
    from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy as _Base
except ImportError:  # pragma: no cover - depends on the environment
    _Base = object


class EpmoeEplbPolicy(_Base):
    policy = "deepseek"

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, *unused_args, **unused_kwargs):
        """vLLM's signature; extra arguments of newer vLLM versions (the old placement) are ignored."""
        return epmoe.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, policy=cls.policy)
