"""HS201: a field of a value moved to the device whole is on the device: a tokenizer's
``BatchEncoding`` after ``.to(device)`` holds its ``input_ids`` and ``attention_mask`` there, and
a tensor's ``.grad`` lives where the tensor does. The same encoding left on the host, or moved
to the CPU, stays silent, and so does a field of a host tensor."""
import torch


class Pipeline:
    def __init__(self, tokenizer, text_encoder, device):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.device = device

    def encode(self, prompts):
        tokens = self.tokenizer(prompts, padding=True, return_tensors="pt").to(self.device)
        n = tokens.attention_mask.sum(dim=1).tolist()  # expect: HS201
        out = self.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        return out, n

    def lengths_on_host(self, prompts):
        tokens = self.tokenizer(prompts, padding=True, return_tensors="pt")
        host = tokens.to("cpu")
        return tokens.attention_mask.sum(dim=1).tolist(), host.input_ids.tolist()


def grad_norms(n):
    w = torch.randn(n, device="cuda", requires_grad=True)
    w.sum().backward()
    h = torch.randn(n, requires_grad=True)
    h.sum().backward()
    return w.grad.norm().item(), h.grad.norm().item()  # expect: HS201
