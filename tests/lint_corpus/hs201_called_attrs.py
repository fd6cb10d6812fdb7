"""HS201: an attribute the module calls (``self.encoder(x)``) is a module or another callable,
not a tensor, so moving it back to the host (``self.encoder = self.encoder.to("cpu")``) reads
nothing; a tensor attribute moved to the device is still read by ``.to("cpu")``."""
import torch
from torch import nn


class Stage(nn.Module):
    def __init__(self, encoder: nn.Module, device: str = "cuda"):
        super().__init__()
        self.encoder = encoder
        self.device = device
        self.cache = torch.zeros(8, device="cuda")

    def forward(self, x):
        self.encoder = self.encoder.to(self.device)
        out = self.encoder(x)
        self.encoder = self.encoder.to("cpu")  # a module moved: no host read
        host = self.cache.to("cpu")  # expect: HS201
        return out, host
