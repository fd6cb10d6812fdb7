"""HS201: iterating a tensor gives items of its kind (a device tensor's rows are device tensors,
judged strictly as the tensor is, in loops and comprehensions and through ``enumerate`` and
``zip``, also of a name bound once to a ``zip(...)`` and iterated later); a rebound loop
variable loses its earlier kind; host guards (``x.is_cpu``, ``x.device.type == "cpu"``) make a
read in the host branch no sync, and the other branch a device read."""
import torch


def rows(n):
    t = torch.ones(4, n, device="cuda")
    for row in t:
        if row.sum():  # expect: HS201
            pass
    vals = [float(v) for v in t[0]]  # expect: HS201
    out = {i: float(v) for i, v in enumerate(t[1])}  # expect: HS201
    for a, (b, c) in zip(t, enumerate(t)):
        if c.any():  # expect: HS201
            pass
    return vals, out, a, b


def rebound(n, host_items):
    x = torch.zeros(n, device="cuda")
    for x in host_items:
        if x:  # a host item now: not the device tensor bound before
            pass
    for name, item in (("x", x), ("n", n)):
        print(f"{name}")  # a string of a written-out pair, not a tensor
    host = torch.arange(n)
    return [float(v) for v in host], item


def guarded(x, y):
    if x.is_cpu:
        a = x.tolist()  # on the host here: no sync
    else:
        a = x.tolist()  # expect: HS201
    if y.device.type != "cpu":
        b = y.item()  # expect: HS201
    else:
        b = y.item()  # on the host here: no sync
    return a, b


def host_guard_after_raise(out_cpu):
    out_cpu = out_cpu.cuda()
    if out_cpu.device.type != "cpu":
        raise ValueError("must be on the CPU")
    return out_cpu.tolist()  # the guard holds after the raise: no sync


def zipped_later(names, n):
    lens = torch.arange(n, device="cuda")
    host = torch.arange(n)
    iterator = zip(names, lens, host)
    for i, (name, length, h) in enumerate(iterator):  # the zip bound above, iterated here
        if length > 0:  # expect: HS201
            print(i, name)
        if h > 0 or name:  # host items and names: no sync
            pass
