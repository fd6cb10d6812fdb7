"""Flow: branches merge, early exits, loops, try/except; one identical pattern per branch."""
import torch


def same_pattern_in_both_branches(lens: list[int], device, use_dcp: bool):
    if use_dcp:
        starts = torch.tensor(lens, dtype=torch.int32)
        a = starts.to(device, non_blocking=True)  # expect: HS101
    else:
        starts = torch.tensor(lens, dtype=torch.int32)
        a = starts.to(device, non_blocking=True)  # expect: HS101
    return a


def pinned_on_one_path_only(lens: list[int], device, pin: bool):
    host = torch.tensor(lens)
    if pin:
        host = host.pin_memory()
    return host.to(device, non_blocking=True)  # pinned or not: pinnedness unknown, not HS101


def pageable_on_one_path_unknown_on_other(lens: list[int], device, staged):
    host = staged if staged is not None else torch.tensor(lens)
    if staged is None:
        host = torch.tensor(lens)
    else:
        host = staged
    return host.to(device, non_blocking=True)  # expect: HS101


def early_return_keeps_the_other_path(lens: list[int], device, cached):
    if cached is not None:
        host = cached.pin_memory()
        return host.to(device, non_blocking=True)
    host = torch.tensor(lens)
    return host.to(device, non_blocking=True)  # expect: HS101


def device_on_every_path(x, flag: bool):
    device = torch.device("cuda", 0)
    if flag:
        y = torch.zeros(4, device=device)
    else:
        y = torch.ones(4, device=device)
    z = y.to(device, non_blocking=True)  # device to device: clean
    return z.sum().item()  # expect: HS201


def host_or_device(x_cpu, flag: bool):
    y = x_cpu + 1 if flag else torch.zeros(4, device="cuda")
    return y.sum().item()  # host on one path, device on the other: not reported


def loop_carried(chunks, device):
    staging = torch.empty(1024, dtype=torch.int32, pin_memory=True)
    outs = []
    for c in chunks:
        n = len(c)
        staging[:n].copy_(torch.as_tensor(c, dtype=torch.int32))
        # pinned on the first iteration, pageable on the next: the paths disagree
        outs.append(staging[:n].to(device, non_blocking=True))  # missed: HS101
        staging = torch.tensor(c)
    return outs


def loop_uploads_fresh(chunks, device):
    return [torch.tensor(c).to(device, non_blocking=True) for c in chunks]  # expect: HS101


def try_paths(lens: list[int], device):
    try:
        host = torch.tensor(lens).pin_memory()
    except RuntimeError:
        host = torch.tensor(lens)  # no CUDA: pinning unavailable
    return host.to(device, non_blocking=True)  # pinned or pageable: not HS101


def walrus_and_none(lens: list[int], device, flag: bool):
    host = None
    if flag:
        host = torch.tensor(lens)
    if host is not None and (dev := host.to(device, non_blocking=True)) is not None:  # expect: HS101
        return dev
    return None
