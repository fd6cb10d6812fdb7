"""HS201: the tensors a torch.distributed collective reads and writes are device tensors (NCCL
takes device tensors only): ``all_reduce``'s tensor, ``all_gather``'s output list, a
``broadcast``'s tensor, with the module imported under any alias; not on a CPU (gloo) group,
and not a tensor known to be on the host."""
import torch
import torch.distributed as dist
from torch.distributed import all_gather_into_tensor


def sync_error(length, device, world):
    dist.broadcast(length, src=0)
    if int(length.item()) == 0:  # expect: HS201
        return None
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    failing = [i for i, v in enumerate(lengths) if v.item() > 0]  # expect: HS201
    first = lengths[0].item()  # expect: HS201
    return failing, first


def gathered(x, out):
    all_gather_into_tensor(out, x)
    return out.tolist()  # expect: HS201


def mean(values, world):
    packed = torch.stack(values)
    if world > 1:
        dist.all_reduce(packed)
    return float(packed.sum().item())  # expect: HS201


def cpu_group(flags, group_cpu):
    dist.all_reduce(flags, group=group_cpu)
    return flags.tolist()  # a CPU (gloo) group: not known to be a device tensor


def host_tensor(n):
    counts = torch.zeros(n, dtype=torch.int64)
    dist.all_reduce(counts)
    return counts.tolist()  # made on the host: a gloo collective, no device read
