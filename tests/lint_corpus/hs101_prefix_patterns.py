"""True positives: the pre-fix pattern (pageable source, non_blocking=True)."""
import numpy as np
import torch


def build_tables(num_reqs, chunk, device):
    starts = torch.arange(num_reqs, dtype=torch.int32) * chunk
    lens = torch.zeros(num_reqs, dtype=torch.int32)
    starts_dev = starts.to(device, non_blocking=True)  # expect: HS101
    lens_dev = lens.to(device, non_blocking=True)  # expect: HS101
    cu = torch.cumsum(lens, 0).to(device, non_blocking=True)  # expect: HS101
    return starts_dev, lens_dev, cu


def from_numpy_tables(arr: np.ndarray):
    host = torch.from_numpy(arr)
    a = host.cuda(non_blocking=True)  # expect: HS101
    b = torch.tensor([1, 2, 3]).to("cuda", non_blocking=True)  # expect: HS101
    c = torch.arange(8).to("cuda:0", torch.int32, True)  # expect: HS101
    return a, b, c


def copy_into_device(arr, n):
    dev = torch.empty(n, dtype=torch.int32, device="cuda")
    dev.copy_(torch.from_numpy(arr), non_blocking=True)  # expect: HS101
    out = torch.zeros(n, device=torch.device("cuda"))
    out[:4].copy_(arr_tensor(arr), non_blocking=True)  # expect: HS101
    return dev, out


def arr_tensor(arr):
    return torch.tensor(arr)  # a fresh host tensor: what callers get is pageable


def copy_into_parameter(dst, arr):
    # the destination is a parameter: not known to be host memory, so the upload counts
    dst.copy_(torch.from_numpy(arr), non_blocking=True)  # expect: HS101


def pinned_then_new_tensor(n, device):
    buf = torch.empty(n, dtype=torch.int64, pin_memory=True)
    doubled = buf * 2  # arithmetic makes a new pageable tensor
    x = doubled.to(device, non_blocking=True)  # expect: HS101
    y = buf.to(torch.int32).to(device, non_blocking=True)  # expect: HS101
    z = buf.view(4, -1).t().to(device, non_blocking=True)  # expect: HS101
    return x, y, z


class Stager:
    def __init__(self, n, device):
        self.device = device
        self.host = torch.zeros(n, dtype=torch.int32)  # pageable
        self.dev = torch.empty(n, dtype=torch.int32, device=device)

    def upload(self, n):
        self.dev[:n].copy_(self.host[:n], non_blocking=True)  # expect: HS101
        return self.host[:n].to(self.device, non_blocking=True)  # expect: HS101


def loop_uploads(chunks, device):
    outs = []
    for c in chunks:
        outs.append(torch.tensor(c).to(device, non_blocking=True))  # expect: HS101
    return outs
