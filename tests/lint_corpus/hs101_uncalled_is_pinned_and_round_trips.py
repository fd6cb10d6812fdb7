"""HS101: ``x.is_pinned`` left uncalled is a bound method, always true, so the branch of
``if not x.is_pinned:`` never runs and a pageable ``x`` stays pageable (the called
``x.is_pinned()`` is an unknown test, as before). A ``copy_`` of a host copy just made of a
device tensor (``dev.cpu()``) is no HS101 even into a device buffer: that blocking read (the
HS201) drained the queue, so the copy on has no queued work to wait for."""
import torch


def compact(indices, lens, total):
    idx_cpu = indices.cpu()  # expect: HS201
    flat = idx_cpu.masked_select(lens.cpu() > 0).contiguous()[:total]
    if not flat.is_pinned:  # the method object: always true, the pin never runs
        flat = flat.pin_memory()
    out = torch.empty(flat.numel(), dtype=torch.int32, device=indices.device)
    out.copy_(flat, non_blocking=True)  # expect: HS101
    kept = idx_cpu.masked_select(lens.cpu() > 1).contiguous()
    if not kept.is_pinned():
        kept = kept.pin_memory()
    out.copy_(kept, non_blocking=True)  # pinned or host of unknown pinnedness: not HS101
    return out


def round_trip(meta):
    dev = torch.empty(meta, device="cuda")
    dst = torch.empty(meta, device="cuda")
    dst.copy_(dev.cpu(), non_blocking=True)  # expect: HS201
    return dst
