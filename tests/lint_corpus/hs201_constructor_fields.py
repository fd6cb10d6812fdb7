"""HS201: what a constructor is given by keyword says what the objects it builds hold, not what
an unrelated object's attribute of the same name holds (lmdeploy's ascend op backend)."""
import torch


def build_metadata(step_context, meta_cls):
    q_seqlens = step_context.q_seqlens
    # a move to wherever the context's q_seqlens lives (the device): the host tensor given as
    # `q_seqlens=` below is a field of the metadata, not of the context
    q_start_loc = step_context.q_start_loc.to(dtype=q_seqlens.dtype, device=q_seqlens.device)
    layers = len(step_context.kv_caches)
    dtype = step_context.model_config.dtype
    policy = step_context.kv_quant_policy, step_context.block_offsets
    q_seqlens_cpu = torch.tensor([1, 2, 3])
    start_loc = torch.zeros(3, device="cuda")
    return meta_cls(layers, dtype, policy, q_start_loc=start_loc, q_seqlens=q_seqlens_cpu), q_start_loc


def read_metadata(meta):
    # an object whose uses are all fields of the constructor: what it was given
    return meta.q_start_loc.tolist(), meta.q_seqlens.tolist()  # expect: HS201
