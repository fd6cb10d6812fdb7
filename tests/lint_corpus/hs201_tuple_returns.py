"""HS201: the tuple a function of this module (or a method of ``self``) returns, written out in
every return, gives each item of ``a, b, c = f(...)`` the kind, strict kind included, of its
position: a device tensor made in the callee is one in a condition of the caller, and a host
item beside it stays a host value."""
import torch


class Pipeline:
    def _timesteps(self, steps, device):
        host = torch.tensor(steps, dtype=torch.long)
        dev = host.to(device)
        if not steps:
            return None
        return dev, len(steps), host

    def __call__(self, steps, boundary, device):
        ts, n, host = self._timesteps(steps, device)
        for t in ts:
            if t >= boundary:  # expect: HS201
                break
        for h in host:
            if h >= boundary:  # a host tensor: no sync
                break
        if n > 1:  # an int in the callee: no sync
            return host.tolist()
        return ts


def split(x):
    lens = torch.zeros(4, device="cuda")
    if x is None:
        return lens, [0]
    return lens, x


def use(x):
    lens, rest = split(x)
    if rest:  # a host list on one path, a parameter on the other: no known kind
        pass
    while lens.any():  # expect: HS201
        lens = lens[1:]
