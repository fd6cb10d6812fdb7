"""HS101: ``pin_memory=<a local flag>`` asks for pinning, unless every binding of the flag in
the function is a literal ``False`` / ``None``; a parameter or a flag set otherwise too is
still taken as a request to pin."""
import torch


class Buffers:
    def __init__(self, n: int):
        pin_memory = False
        self.out_cpu = torch.empty(n, device="cpu", pin_memory=pin_memory)
        self.grad_cpu = torch.empty(n, device="cpu", pin_memory=pin_memory)

    def output(self, device):
        return self.out_cpu.to(device=device, non_blocking=True)  # expect: HS101


class Pinned:
    def __init__(self, n: int, pin: bool = True):
        self.a = torch.empty(n, pin_memory=pin)  # a parameter: the caller's choice
        flag = None
        if torch.cuda.is_available():
            flag = True
        self.b = torch.empty(n, pin_memory=flag)  # bound to True too: pinned

    def upload(self, device):
        return (self.a.to(device, non_blocking=True),
                self.b.to(device, non_blocking=True))
