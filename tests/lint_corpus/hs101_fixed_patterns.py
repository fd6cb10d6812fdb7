"""True negatives: the fixed pattern (pinned source) and copies that are not host->device."""
import torch
import torch as th


def build_tables_pinned(num_reqs, chunk, device):
    starts = torch.empty(num_reqs, dtype=torch.int32, pin_memory=True)
    torch.arange(num_reqs, dtype=torch.int32, out=starts)
    starts.mul_(chunk)
    lens = torch.zeros(num_reqs, dtype=torch.int32, pin_memory=True)
    return starts.to(device, non_blocking=True), lens.to(device, non_blocking=True)


def pin_once(arr, device):
    host = torch.from_numpy(arr).pin_memory()
    a = host.to(device, non_blocking=True)
    b = (torch.arange(8) * 2).pin_memory().cuda(non_blocking=True)
    return a, b


def staged_through_pinned(arr, device, n):
    staging = torch.empty(n, dtype=torch.int32, pin_memory=True)
    staging.copy_(torch.from_numpy(arr))
    a = staging.to(device, non_blocking=True)
    b = th.empty(n, dtype=th.int32, pin_memory=True).copy_(torch.from_numpy(arr))
    c = b.to(device, non_blocking=True)
    d = torch.zeros(n, pin_memory=True).copy_(a).to(device, non_blocking=True)
    return a, c, d


def slices_and_views_of_pinned(n, device, pin):
    buf = torch.empty(4 * n, dtype=torch.int32, pin_memory=pin)
    head = buf[:n]
    a = head.to(device, non_blocking=True)
    b = buf[n:2 * n].view(2, -1).to(device, non_blocking=True)
    c = buf.narrow(0, 0, n).to(device, non_blocking=True)
    parts = buf.split(n)
    d = parts[1].to(device, non_blocking=True)
    first, second = buf.chunk(2)
    e = second.to(device, non_blocking=True)
    return a, b, c, d, e


class Ring:
    """Pinned buffer attribute assigned in __init__, used in other methods."""

    def __init__(self, n, device):
        self.device = device
        self.host = torch.empty(n, dtype=torch.int32, pin_memory=True)
        self.slots = [torch.empty(n, dtype=torch.int32, pin_memory=True) for _ in range(4)]
        self.dev = torch.empty(n, dtype=torch.int32, device=device)

    def upload(self, n, i):
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        x = self.slots[i][:n].to(self.device, non_blocking=True)
        for slot in self.slots:
            slot.to(self.device, non_blocking=True)
        return x

    def grow(self, n):
        pinned = torch.empty(2 * n, dtype=torch.int32, pin_memory=True)
        self.other = pinned


def other_object_attribute(ring: Ring, n, device):
    # `other` is assigned a pinned tensor somewhere in this module
    return ring.other[:n].to(device, non_blocking=True)


def not_host_to_device(x, n):
    dev = torch.empty(n, device="cuda")
    on_dev = dev * 2
    a = on_dev.to("cuda:1", non_blocking=True)  # device -> device
    back = dev.to("cpu", non_blocking=True)  # device -> host (pinned output)
    host = torch.zeros(n)
    host.copy_(dev, non_blocking=True)  # destination is host memory: not H2D
    unknown = x.foo
    unknown.copy_(x.bar, non_blocking=True)  # neither end placed: HS103 needs a device dst
    blocking = torch.arange(n).to("cuda")  # blocking copies are not HS101
    return a, back, blocking


def comprehension_of_pinned(chunks, device):
    pinned = [c.pin_memory() for c in chunks]
    return [p.to(device, non_blocking=True) for p in pinned]
