"""HS101: ``setattr(obj, "name", v)`` with the name written out is ``obj.name = v``, and
``getattr(obj, "name", default)`` reads ``obj.name``: a per-request host tensor a runner
attaches to its request state with ``setattr`` and reads back with ``getattr`` is what was
attached (here fresh pageable memory from ``np.frombuffer``). A name that is not written out
says nothing, nor does the truth of ``getattr(obj, "name", None)``, which asks whether the
attribute is there."""
import numpy as np
import torch


class Runner:
    def __init__(self, device):
        self.device = device
        self.requests = {}
        self.embeds = torch.zeros(4096, 1024, device=device)
        self.vae = torch.zeros(8, device=device)

    def add_request(self, req_id, state, payload):
        arr = np.frombuffer(payload.data, dtype=np.float32).reshape(payload.shape)
        self.requests[req_id] = state
        setattr(self.requests[req_id], "prompt_embeds_host", torch.from_numpy(arr))
        setattr(self.requests[req_id], "staged_embeds",
                torch.from_numpy(arr).pin_memory())
        setattr(state, payload.key, torch.from_numpy(arr))  # a name not written out

    def overlay(self, req_ids, start, n):
        for req_id in req_ids:
            state = self.requests[req_id]
            pe = getattr(state, "prompt_embeds_host", None)
            if pe is not None:
                src = pe[start:start + n].to(device=self.device, non_blocking=True)  # expect: HS101
                self.embeds[start:start + n].copy_(src)
            staged = getattr(state, "staged_embeds", None)
            if staged is not None:
                self.embeds[:n].copy_(staged[:n], non_blocking=True)  # pinned
            other = getattr(state, state.key)
            other.to(self.device, non_blocking=True)  # where it lives is not known
        if getattr(self, "vae", None):  # whether the attribute is there, not a device read
            return 8
        return 1
