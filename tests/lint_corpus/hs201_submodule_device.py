"""HS201: the device of a submodule's parameter (``self.embed.weight.device``) is the device the
method's component serves, as a method's own device parameter is: what is made there is a
device tensor for ``.item()`` as it already was for conditions; the device of a tensor of
unknown place (``x.device``) still says nothing."""
import torch


class Model:
    def forward(self, x, seq_len):
        device = self.patch_embedding.weight.device
        seq_lens = torch.tensor([u.size(1) for u in x], dtype=torch.long, device=device)
        assert seq_lens.max() <= seq_len  # expect: HS201
        first = int(seq_lens[0].item())  # expect: HS201
        other = torch.tensor([len(x)], device=x[0].device)
        return first, other.item()  # x[0]'s place is unknown: not reported
