"""Each rank's shard of a parameter is padded to ceil(dim0 / N) rows, as FSDP2 pads it (cost/fsdp2_rules.py
[Note: Dim-0 padding]; issue 37 item 4): the cost model's bytes of a unit equal FSDP2's own padded shards,
read from ``fully_shard`` under the fake process group. Before, the cost model divided the unpadded bytes by
N (cost/unit_bytes.py) while run's byte count padded (cost/comm_bytes.py)."""

import pytest

from shard_planner.cost import fsdp2_rules
from shard_planner.cost.unit_bytes import unit_bytes_of
from shard_planner.plan.numerics import Numerics
from shard_planner.cost.unit_params import UnitParams
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace import trace_model
from tests.paths import REPO

VIT = str(REPO / "examples" / "vit.py")  # tiny: its cls_token (1, 1, 64) and pos_embed (1, 17, 64) have dim 0 of 1


def test_padding_rule_is_torch_chunks_first_chunk():
    """ceil(dim0 / N) rows per rank: torch.chunk's first chunk, which FSDP2 pads every rank's shard to."""
    import torch

    for dim0 in (1, 5, 7, 8, 17, 50257):
        for n in (2, 3, 4, 8):
            first = torch.chunk(torch.empty(dim0, 3), n, dim=0)[0]
            assert fsdp2_rules.shard_numel(dim0, dim0 * 3, n) == first.numel()
            assert fsdp2_rules.padded_numel(dim0, dim0 * 3, n) == first.numel() * n


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_unit_bytes_are_fsdp2s_padded_shards(fake_world):
    from torch.distributed.fsdp import fully_shard

    trace = trace_model(VIT, dtype="float32")
    model = load_model_file(VIT).build()
    fully_shard(model, mesh=fake_world)  # one unit: the root, every parameter
    fsdp_params = model._get_fsdp_state()._fsdp_param_groups[0].fsdp_params
    shard_bytes = sum(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp in fsdp_params)
    unpadded_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    x = unit_bytes_of(UnitParams.of_modules(trace.modules), True, 8, Numerics("float32", "float32"))
    assert shard_bytes > unpadded_bytes / 8  # the 1-row tensors are whole on every rank
    assert x.sharded == shard_bytes  # rank 0's padded shards
    assert x.sharded_grad == shard_bytes  # its gradient: a view of the padded reduce-scatter output
    assert x.all_gather_output == x.unsharded == x.rs_input == 8 * shard_bytes  # the padded flat buffers
    assert x.unsharded_grads == unpadded_bytes  # autograd's gradients are the parameters' own size
