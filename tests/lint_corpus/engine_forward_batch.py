"""Engine-style: build one forward batch from scheduler lists (host) into device tensors."""
from dataclasses import dataclass

import torch


def pin_available(device) -> bool:
    return torch.cuda.is_available()


@dataclass
class ForwardInputs:
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    positions: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None


class BatchBuilder:
    def __init__(self, device: torch.device):
        self.device = device

    def from_lists(self, seq_lens: list[int], prefix: list[int], extend: list[int],
                   block_offsets: list[int] | None):
        device = self.device
        pin = pin_available(device)
        out = ForwardInputs(
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, pin_memory=pin).to(
                device, non_blocking=True),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        )
        out.extend_lens = torch.tensor(extend, dtype=torch.int32, pin_memory=pin).to(
            device, non_blocking=True)
        out.prefix_lens = torch.tensor(prefix, dtype=torch.int32).to(  # expect: HS101
            device, non_blocking=True)
        if block_offsets is not None:
            pos = [p for off in block_offsets for p in range(off, off + 4)]
            out.positions = torch.tensor(pos).to(device, non_blocking=True)  # expect: HS101
        return out

    def rope_positions(self, out: ForwardInputs, images: list, prefix: list[int],
                       extend: list[int]):
        parts = [None] * len(images)
        for i, image in enumerate(images):
            if image is None:
                part = torch.arange(prefix[i], prefix[i] + extend[i]).expand(3, -1)
            else:
                part = image.rope_table[:, prefix[i]: prefix[i] + extend[i]]
            parts[i] = part
        out.rope_positions = torch.cat(parts, dim=1).to(  # expect: HS101
            device=self.device, dtype=torch.int64, non_blocking=True)

    def pad_for_graph(self, out: ForwardInputs, rows: int):
        out.prefix_lens = out.seq_lens - 1
        out.extend_lens = torch.ones_like(out.seq_lens)
        prefix_list = out.prefix_lens.cpu().tolist()  # expect: HS201
        extend_list = out.extend_lens.tolist()  # expect: HS201
        host_total = int(out.seq_lens_cpu.sum())  # host mirror: no sync
        return prefix_list, extend_list, host_total

    def from_scheduler(self, batch, device: torch.device):
        # an attribute of an object built in another module: the lint cannot place it
        return batch.logprob_token_ids.to(device, non_blocking=True)  # missed: HS101
