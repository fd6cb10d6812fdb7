"""HS201 forms beyond .item(): truth values and casts of device tensors, device-ness through a
local alias of ``x.device``, results of calls given device tensors, device tensors in f-strings;
and their host (or not-a-tensor) look-alikes, which must stay silent."""
import torch


def greedy(output_token_ids, draft_lens, bonus):
    device = output_token_ids.device  # an alias: `device=device` below makes output a device tensor
    lens = torch.tensor(draft_lens, pin_memory=True).to(device, non_blocking=True)
    ok = torch.ones(len(draft_lens), dtype=torch.bool, device=device)
    needs = ok & (lens > 0)
    if torch.any(needs):  # expect: HS201
        output_token_ids[needs] = bonus
    while needs.any():  # expect: HS201
        needs = needs[1:]
    assert torch.all(lens >= 0), (  # expect: HS201
        f"bad lens {lens}")  # the message: built only as the assert fails
    n = int(lens.sum())  # expect: HS201
    frac = float(lens.float().mean())  # expect: HS201
    flag = bool(needs[0])  # expect: HS201
    ids = [i for i in range(n) if lens[i] != 0]  # expect: HS201
    first = lens[0] if lens[0] > 0 else 0  # expect: HS201
    for i in range(n):
        if output_token_ids[i] != -1:  # expect: HS201
            break
    return n, frac, flag, ids, first


class Runner:
    def __init__(self, device):
        self.device = device
        self.sampler = lambda logits, t: logits.argmax(-1)

    def prepare(self, temps):
        return torch.tensor(temps, pin_memory=True).cuda(non_blocking=True)

    def run(self, logits, temps):
        t = self.prepare(temps)
        ids = self.sampler(logits, t).tolist()  # expect: HS201
        marks = launch_kernel(x=t, n=3)
        hits = marks.detach().cpu().numpy()  # expect: HS201
        return ids, hits


def launch_kernel(x, n):
    return x


def host_look_alikes(lens_cpu, device, has_cuda, reqs):
    """Conditions on flags, device objects, metadata and host tensors: no device read."""
    on_device = lens_cpu.is_cuda
    cu = torch.tensor(reqs, dtype=torch.int64)
    keep = (cu[1:] - cu[:-1]) > 0
    if bool(keep.all()):
        pass
    if has_cuda and on_device:
        pass
    if device.type == "cuda" or device != torch.device("cpu"):
        pass
    q = torch.zeros(4, device="cuda")
    assert q.dim() == 1 and q.dtype == torch.float32 and q.shape[0] == 4, f"{q.shape}"
    if q.is_cuda and q.numel() > 0 and q is not None:
        pass
    marks = [0, 1]
    assert marks[0] == 0
    n = int(cu[-1])
    return n, f"{device}", f"{len(reqs)} requests on {device}"


def guarded(num_rejected, next_ids, t, state):
    """A test that a tensor is on an accelerator places it there where the test holds."""
    rejected = num_rejected.cpu() if num_rejected.is_cuda else num_rejected  # expect: HS201
    if next_ids.device.type == "cuda":
        ids = next_ids.tolist()  # expect: HS201
    else:
        ids = next_ids.tolist()  # the CPU branch: a host read
    if state.buf.is_cuda and t.is_cuda:
        first = state.buf[0].item()  # expect: HS201
    last = t.cpu()  # outside the guard: not known
    return rejected, ids, first, last
