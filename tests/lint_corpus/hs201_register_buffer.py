"""HS201: a buffer registered on the device is an attribute of the module (read in another
method); a host buffer moves with ``module.to(device)``, so it is not known to be pageable; a
device looked up with a None default (``kwargs.get("device", None)``) is not known either."""
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, n, **kwargs):
        super().__init__()
        self.register_buffer("slots", torch.arange(n, device="cuda"))
        self.register_buffer("scale", torch.ones((), device=kwargs.get("device", None)))
        self.register_buffer("table", torch.zeros(n), persistent=False)

    def forward(self, x):
        if self.slots.any():  # expect: HS201
            pass
        n = self.slots.sum().item()  # expect: HS201
        s = self.scale.item()  # the CPU without a device keyword: not known to be on the device
        t = self.table.to(x.device, non_blocking=True)  # moved by module.to(): not known
        return n, s, t
