"""HS201: host reads of CUDA tensors (and host reads that are fine)."""
import torch


def reads(n):
    x = torch.arange(n, device="cuda")
    total = x.sum().item()  # expect: HS201
    lst = x.tolist()  # expect: HS201
    y = (x * 2).cpu()  # expect: HS201
    dev = torch.device("cuda", 0)
    z = torch.zeros(n, device=dev)
    arr = z.numpy()  # expect: HS201
    w = torch.ones(3).cuda()
    first = w[0].item()  # expect: HS201
    v = torch.ones(3).to("cuda")
    vv = v.max().item()  # expect: HS201
    back = v.to("cpu")  # expect: HS201
    pinned_back = v.to("cpu", non_blocking=True)  # async into pinned memory: no wait here
    return total, lst, y, arr, first, vv, back, pinned_back


class Model:
    def __init__(self):
        self.weight = torch.zeros(4, 4, device="cuda")

    def norm(self):
        return self.weight.norm().item()  # expect: HS201


def host_reads_are_fine(n, device):
    x = torch.arange(n)
    a = x.sum().item()
    b = x.tolist()
    c = torch.zeros(n, device=device).cpu()  # the caller's device: not known to be a GPU
    d = torch.zeros(n, device="cpu").numpy()
    return a, b, c, d


class Generator:
    """A callable component held by another object returns tensors computed from its inputs;
    a method of this object guessed from its arguments may return host items."""

    def __init__(self):
        self.ids = torch.zeros(8, dtype=torch.long, device="cuda")

    def step(self, batch):
        ids, logprobs = batch.chooser(self.ids, 4)
        first = ids.tolist()  # expect: HS201
        return first, logprobs.tolist()  # expect: HS201

    def sync(self, n):
        return n, torch.tensor([n]), "mode"

    def own_method_items_unknown(self):
        _, n_cpu, _ = self.sync(self.ids)
        return n_cpu.tolist()

    def merged(self, batch, flag):
        if flag:
            out = self.ids + 1
        else:
            out, _ = batch.chooser(self.ids, 4)
        return out.tolist()  # expect: HS201
