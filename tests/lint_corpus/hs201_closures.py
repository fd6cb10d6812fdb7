"""HS201: a closure (a function defined in a function) sees the kinds its enclosing function
established for names and attribute paths; its own parameters shadow them."""
import torch


def update(ctx, n):
    ctx.q_seqlens = torch.zeros(n, dtype=torch.int32, device="cuda")
    lens = torch.arange(n, device="cuda")
    host = torch.arange(n)

    def host_lens():
        return ctx.q_seqlens.cpu()  # expect: HS201

    def total():
        return lens.sum().item()  # expect: HS201

    def shadowed(lens):
        return lens.tolist()  # its own parameter: not the enclosing `lens`

    def host_read():
        return host.tolist()  # a host tensor: no sync

    return host_lens(), total(), shadowed(host), host_read()
