# HS101 through keyword dicts and legacy constructors (the idioms of mini-sglang and older
# engines): a ``**`` dict literal that holds pin_memory=True pins; torch.Tensor(list) does not.
import torch

CPU_KWARGS = {"device": "cpu", "dtype": torch.int32, "pin_memory": True}
PAGE_KW = dict(dtype=torch.int32, device="cpu")


class Builder:
    def __init__(self, device):
        self.device = device
        self.host_kw = dict(dtype=torch.int64, pin_memory=True)

    def pinned(self, ids, lens):
        a = torch.tensor(ids, **CPU_KWARGS).to(self.device, non_blocking=True)
        b = torch.tensor(lens, **self.host_kw).to(self.device, non_blocking=True)
        c = torch.tensor(ids, **{"pin_memory": True}).to(self.device, non_blocking=True)
        return a, b, c

    def pageable(self, ids, lens):
        a = torch.tensor(ids, **PAGE_KW).to(self.device, non_blocking=True)  # expect: HS101
        b = torch.Tensor(lens).to(self.device, non_blocking=True)  # expect: HS101
        c = torch.LongTensor(ids).cuda(non_blocking=True)  # expect: HS101
        return a, b, c
