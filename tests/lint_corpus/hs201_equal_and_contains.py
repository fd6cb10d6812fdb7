"""HS201: comparisons that return a Python bool read the device: ``torch.equal(a, b)``,
``torch.allclose(a, b)`` and the methods ``a.equal(b)`` / ``a.allclose(b)`` of device tensors,
and membership of a device tensor in a device tensor (``x in t``, ``x not in t``:
``Tensor.__contains__`` is ``bool((t == x).any())``). The same on host tensors, and membership
in a list of tensors or in a dict of them, stay silent; so does a constant tested against a
device tensor (``1 in t``: the lint takes containers of tensors for tensors, so it asks for a
tensor on both sides)."""
import torch


def check_prefix(input_ids, tokenizer, device):
    think = torch.tensor([tokenizer.encode("<think>")], device=input_ids.device)
    if not torch.equal(input_ids[0, -think.shape[-1]:], think[-1]):  # expect: HS201
        input_ids = torch.cat([input_ids, think], dim=1)
    host = torch.tensor([1, 2, 3])
    same = torch.equal(host, torch.arange(3))
    close = think.float().allclose(think.float())  # expect: HS201
    return input_ids, same, close, torch.allclose(host.float(), host.float())


def union_blocks(n, topk, device):
    table = torch.zeros(4, topk, dtype=torch.long, device="cuda")
    for layer in range(3):
        for i in range(1, topk):
            x = table[-1, i]
            if x not in table[layer]:  # expect: HS201
                table[layer, topk - i] = x
    host = torch.arange(topk)
    kept = [i for i in range(n) if i in host]
    caches = [torch.zeros(2, device="cuda")]
    named = {"k": torch.zeros(2, device="cuda")}
    return kept, 3 in caches, "k" in named


def load_keys(path, names):
    sd = torch.load(path, map_location="cuda")
    found = [k for k in ("state_dict", "model") if k in sd]  # a key of a dict of tensors
    w = torch.zeros(2, device="cuda")
    return found, ["norm" in n for n in names], 1 in w  # missed: HS201
