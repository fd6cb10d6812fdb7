"""HS103 (opt-in): non_blocking copies to a device from memory the lint cannot place."""
# lint-select: HS,HS103
import torch


class Uploader:
    def __init__(self, n: int, device: torch.device):
        self.device = device
        self.dev = torch.empty(n, dtype=torch.int32, device=device)

    def upload(self, batch, n: int):
        a = batch.token_ids.to(self.device, non_blocking=True)  # expect: HS103
        self.dev[:n].copy_(batch.slot_ids, non_blocking=True)  # expect: HS103
        b = batch.lengths_cpu.to(self.device, non_blocking=True)  # expect: HS103
        c = torch.tensor([n]).to(self.device, non_blocking=True)  # expect: HS101
        d = self.dev.to(self.device, non_blocking=True)  # device to device: clean
        return a, b, c, d


def two_unknowns(dst, src):
    dst.copy_(src, non_blocking=True)  # neither end known: not even HS103
