"""HS201: builtin min()/max() of device tensors, what they return (one of their arguments: a
device tensor where one is given), and attributes every assignment of a class allocates on the
device (read in a condition in another method)."""
import torch


def clamp_lengths(n, start):
    lens = torch.arange(n, device="cuda")
    first = lens[0]
    hi = max(first, start)  # expect: HS201
    lo = min([first, lens[1]])  # expect: HS201
    best = max(range(n), key=lambda i: lens[i])  # expect: HS201
    host = torch.arange(n)
    fine = max(host[0], start), min(3, n), max([n, start]), max(range(n), key=lambda i: -i)
    return hi, lo, best, fine


class SlotPool:
    def __init__(self, num_slots, table):
        device = table.device
        self.free = torch.arange(num_slots, dtype=torch.int32, device=device)
        self.used = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.host_free = torch.arange(num_slots)
        self.mixed = torch.zeros(num_slots, device=device)
        self.spare = torch.zeros(num_slots, device=device)

    def release(self, idx):
        self.free = torch.cat([self.free, idx])
        self.mixed = torch.zeros(3)

    def allocate(self, n):
        out = self.free[:n]
        self.free = self.free[n:]
        return out

    def check(self):
        assert torch.all(self.free >= 0)  # expect: HS201
        if self.used.any():  # expect: HS201
            pass
        assert torch.all(self.host_free >= 0)  # a host tensor: no wait
        if self.mixed.any():  # on the host after release(): not known to be on the device
            pass
        if self.spare.any():  # another object's `spare` is assigned a host tensor below
            pass


def reassigned_elsewhere(pool):
    pool.spare = torch.zeros(3)


def embedding_range(his_len, emb_start, emb_end):
    seq_len = torch.ones(1, dtype=torch.long, device="cuda")[0]
    start = max(emb_start, his_len) - emb_start
    end = min(emb_end, his_len + seq_len) - emb_start  # expect: HS201
    if 0 <= start < end:  # expect: HS201
        return start, end
    width = max(emb_end, emb_start) - emb_start  # host ints: an int
    if width > 0:
        return None
    return end
