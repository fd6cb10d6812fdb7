"""HS201 / HS101: a host read built only on the way to an exception (a ``raise``'s message, an
``assert``'s message) waits once, as the program fails, so it is no finding; the test that
decides to raise still is. A ``copy_`` of a host copy just made of a device tensor
(``dev.cpu()``) into a destination not known to be on the device stages a device-to-host
transfer, not an upload of pageable memory; into a known device tensor it is no HS101 either
(eleventh round: the blocking read drained the queue, the HS201 is the finding)."""
import torch


def check(mask, embeds):
    n = mask.to("cuda").sum()
    if n != embeds.size(0):  # expect: HS201
        raise ValueError(f"mask wants {n} embeddings, got {embeds.size(0)}")
    assert n > 0, f"no tokens: {n.item()}"  # expect: HS201
    return n


def scatter(meta, offload, rank, src):
    if offload:
        out = torch.empty(meta, device="cpu")
    else:
        out = torch.empty(meta, device=f"cuda:{rank}")
    dev = torch.empty_like(out, device="cuda")
    # out is the CPU buffer on the offload path: a staged device-to-host copy, only the read
    out.copy_(dev.cpu(), non_blocking=True)  # expect: HS201
    dst = torch.empty(meta, device="cuda")
    dst.copy_(dev.cpu(), non_blocking=True)  # expect: HS201
    out.copy_(src.cpu(), non_blocking=True)  # src's place unknown: not a device-to-host copy
    return out, dst
