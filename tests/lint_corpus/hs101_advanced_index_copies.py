"""HS101: indexing a host tensor with a Python list (written out, a comprehension, or a name
bound to a list) or with a written-out boolean comparison gathers into a fresh tensor in
pageable memory, even from a pinned buffer; slices, integers and other tensor indexes (a 0-d
integer tensor selects a view) keep the buffer's memory."""
import torch


class Stager:
    def __init__(self, n):
        self.buf = torch.zeros(n, 8, dtype=torch.int32, pin_memory=True)

    def upload(self, rows, device, i):
        keep = [r for r in rows if r >= 0]
        a = self.buf[keep].to(device, non_blocking=True)  # expect: HS101
        b = self.buf[:, [0, 2]].to(device, non_blocking=True)  # expect: HS101
        c = self.buf[self.buf[:, 0] > 0].to(device, non_blocking=True)  # expect: HS101
        d = self.buf[: len(rows)].to(device, non_blocking=True)  # a view of pinned memory
        e = self.buf[i].to(device, non_blocking=True)  # an integer or 0-d index: a view
        return a, b, c, d, e
