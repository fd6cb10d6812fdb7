"""HS201: a field of a value moved to the device whole is on the device: a tokenizer's
``BatchEncoding`` after ``.to(device)`` holds its ``input_ids`` and ``attention_mask`` there, and
a helper method called with such a field reads the device (call-site parameter facts). The
same encoding left on the host, or moved to the CPU, stays silent."""
import torch


class Pipeline:
    def __init__(self, tokenizer, text_encoder, device):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.device = device

    def _split_masked(self, hidden, mask):
        bool_mask = mask.bool()
        lengths = bool_mask.sum(dim=1)
        return torch.split(hidden[bool_mask], lengths.tolist(), dim=0)  # expect: HS201

    def encode(self, prompts):
        tokens = self.tokenizer(prompts, padding=True, return_tensors="pt").to(self.device)
        n = tokens.attention_mask.sum(dim=1).tolist()  # expect: HS201
        out = self.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        return self._split_masked(out.hidden_states[-1], tokens.attention_mask), n

    def lengths_on_host(self, prompts):
        tokens = self.tokenizer(prompts, padding=True, return_tensors="pt")
        host = tokens.to("cpu")
        return tokens.attention_mask.sum(dim=1).tolist(), host.input_ids.tolist()
