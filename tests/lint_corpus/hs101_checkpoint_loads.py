"""HS101: tensors read from a checkpoint onto the CPU are fresh pageable memory:
``torch.load(..., map_location="cpu")``, safetensors ``load_file(path)`` (the CPU by
default) and ``f.get_tensor(k)`` of ``with safe_open(path, framework="pt", device="cpu") as
f`` (the CPU by default too); so are the values of such a dict iterated with ``.items()`` /
``.values()``. A map_location or device that is an accelerator gives device tensors; one that
is a caller's device, a mapping function or absent from ``torch.load`` says nothing."""
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def load_pt(path, buffers):
    sd = torch.load(path, map_location="cpu")
    for name, t in sd.items():
        buffers[name].copy_(t, non_blocking=True)  # expect: HS101
    w = sd["weight"].to("cuda", non_blocking=True)  # expect: HS101
    gpu_sd = torch.load(path, map_location="cuda:0")
    for t in gpu_sd.values():
        t.to("cuda", non_blocking=True)  # already on the device
    saved = torch.load(path)  # wherever it was saved
    saved["weight"].to("cuda", non_blocking=True)
    mapped = torch.load(path, map_location=lambda storage, loc: storage)
    mapped["weight"].to("cuda", non_blocking=True)
    return w


def load_st(path, device, keys):
    sd = load_file(path)
    a = sd["a"].to(device, non_blocking=True)  # expect: HS101
    on_dev = load_file(path, device="cuda")
    b = on_dev["b"].to(device, non_blocking=True)
    theirs = load_file(path, device=device)  # the caller's device
    c = theirs["c"].to(device, non_blocking=True)
    out = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for k in keys:
            out[k] = f.get_tensor(k).to(torch.bfloat16).cuda(non_blocking=True)  # expect: HS101
    return a, b, c, out
