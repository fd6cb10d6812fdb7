"""HS101: ``torch.from_numpy`` of a NumPy array bound in the function from a call (a fresh
array, even with a ``*_np`` name) is pageable memory, but not a view of a pinned tensor
(``pinned.numpy()``, also when stored on an object); a device object tested with
``device.type == "cpu"`` is the CPU in that branch and an accelerator in the other."""
import numpy as np
import torch


class Reader:
    def __init__(self, n, client):
        self.client = client
        self.pinned = torch.zeros(n, pin_memory=True)
        self.view = self.pinned.numpy()

    def read(self, name, device):
        hidden_np = self.client.read(name)
        a = torch.from_numpy(hidden_np).to(device, non_blocking=True)  # expect: HS101
        staged = torch.from_numpy(self.view[:4]).to(device, non_blocking=True)  # pinned view
        view_np = self.pinned.numpy()
        b = torch.from_numpy(view_np).to(device, non_blocking=True)  # pinned view
        return a, staged, b


def metadata(lens_cpu, *, device):
    ptr_cpu = torch.full((64,), -1, dtype=torch.int32)
    if device.type == "cpu":
        ptr = ptr_cpu
    else:
        ptr = ptr_cpu.to(device)
    ptr_cpu[:4].copy_(lens_cpu[:4])
    if device.type != "cpu":
        ptr.copy_(ptr_cpu, non_blocking=True)  # expect: HS101
    host = np.arange(8)
    return ptr, torch.from_numpy(host)
