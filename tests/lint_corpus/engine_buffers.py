"""Engine-style: paired host/device buffers, pinned staging, and the lint's known limits."""
import numpy as np
import torch


class PairedBuffer:
    """A host buffer (pinned when possible) and its device twin."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, pin: bool):
        self.cpu = torch.zeros(n, dtype=dtype, pin_memory=pin)
        self.gpu = torch.zeros(n, dtype=dtype, device=device)
        self.np = self.cpu.numpy()

    def upload(self, n: int) -> torch.Tensor:
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class InputPrep:
    def __init__(self, max_tokens: int, max_reqs: int, device: torch.device):
        self.device = device
        self.positions = PairedBuffer(max_tokens, torch.int64, device, pin=True)
        self.seq_lens_cpu = torch.zeros(max_reqs, dtype=torch.int32, pin_memory=True)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.token_ids_np = np.zeros((max_reqs, 1024), dtype=np.int32)
        self.arange_np = np.arange(max_tokens)

    def prepare(self, num_reqs: int, computed: np.ndarray, scheduled: np.ndarray):
        total = int(scheduled.sum())
        req_idx = np.repeat(self.arange_np[:num_reqs], scheduled)
        np.add(computed[req_idx], self.arange_np[:total], out=self.positions.np[:total])
        self.positions.upload(total)
        self.seq_lens_cpu[:num_reqs] = torch.from_numpy(computed + scheduled)
        self.seq_lens[:num_reqs].copy_(self.seq_lens_cpu[:num_reqs], non_blocking=True)
        longest = self.seq_lens_cpu[:num_reqs].max().item()  # host: no sync
        flat = torch.from_numpy(self.token_ids_np[:num_reqs].reshape(-1))
        ids = flat.to(self.device, non_blocking=True)  # expect: HS101
        pinned_view = torch.from_numpy(self.positions.np[:total])  # NumPy view of pinned memory
        pos = pinned_view.to(self.device, non_blocking=True)
        fresh = torch.from_numpy(np.cumsum(scheduled))
        cu = fresh.to(self.device, non_blocking=True)  # expect: HS101
        return longest, ids, cu, pos

    def logits_indices(self, num_reqs: int):
        last = self.seq_lens[:num_reqs] - 1
        return last.tolist()  # expect: HS201

    def stats(self, num_reqs: int):
        # a twin named *_cpu says `seq_lens` lives on the device
        return self.seq_lens[:num_reqs].float().mean().item()  # expect: HS201

    def sampled(self, sampler, logits: torch.Tensor):
        # the result of a call into another module: where it lives is unknown
        tokens = sampler(logits)
        return tokens.tolist()  # missed: HS201

    def debug_dump(self, host_only: bool):
        # on a CPU-only debug path this reads host memory, but the lint sees a device buffer
        buf = torch.zeros(4, dtype=torch.int32, device=self.device)
        return buf.tolist() if host_only else None  # fp: HS201
