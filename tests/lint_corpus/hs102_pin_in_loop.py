"""HS102: a pinned allocation per iteration."""
import torch


def per_step(steps, device):
    out = []
    for s in steps:
        host = torch.from_numpy(s).pin_memory()  # expect: HS102
        out.append(host.to(device, non_blocking=True))
    return out


def while_loop(q, device):
    while q:
        x = q.pop().pin_memory()  # expect: HS102
        x.to(device, non_blocking=True)


def fine(steps, device):
    buf = torch.empty(1024, dtype=torch.int32).pin_memory()  # once, outside the loop
    for s in steps:
        buf[: len(s)].copy_(torch.from_numpy(s))
        buf[: len(s)].to(device, non_blocking=True)

    def helper(x):  # a function defined in a loop body is not itself a loop
        return x.pin_memory()

    return helper
