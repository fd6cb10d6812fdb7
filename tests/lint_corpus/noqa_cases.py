"""Suppression: every flagged line here carries a noqa comment."""
import torch


def pageable_on_purpose(arr, device):
    host = torch.from_numpy(arr)
    a = host.to(device, non_blocking=True)  # noqa: HS101 - pageable baseline for benchmarks
    b = host.cuda(non_blocking=True)  # noqa
    c = torch.arange(4, device="cuda").item()  # noqa: HS201,HS101
    d = host.to(device, non_blocking=True)  # noqa:HS1
    return a, b, c, d


def pin_each_step(steps, device):
    for s in steps:
        torch.from_numpy(s).pin_memory()  # noqa: HS102
