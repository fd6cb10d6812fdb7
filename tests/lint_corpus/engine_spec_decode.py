"""Engine-style: split a batch into speculative and plain rows, pad for CUDA graphs."""
from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    block_table: torch.Tensor
    num_tokens: int


class SpecSplitter:
    def __init__(self, max_rows: int, draft_len: int, device: torch.device):
        self.draft_len = draft_len
        self.rows_buf = torch.empty(max_rows, dtype=torch.int32, device=device)
        self.mask_buf = torch.empty(max_rows, dtype=torch.bool, device=device)
        self.loc_buf = torch.empty(max_rows + 1, dtype=torch.int32, device=device)

    def split(self, step: StepInputs, drafts_cpu: torch.Tensor | None,
              accepted: torch.Tensor | None):
        loc = step.query_start_loc
        if drafts_cpu is None or drafts_cpu[drafts_cpu >= 0].sum().item() == 0:
            spec_rows = None
            num_spec = 0
        else:
            spec_rows = drafts_cpu >= 0
            num_spec = spec_rows.sum().item()  # host mask: no sync
            if num_spec == 0:
                spec_rows = None
            else:
                spec_rows = spec_rows.to(loc.device, non_blocking=True)  # expect: HS101

        if spec_rows is None:
            plain_loc = loc
            rows = step.block_table[:, 0]
            num_plain = step.query_start_loc_cpu.numel() - 1
        else:
            lens = loc[1:] - loc[:-1]
            plain_lens = lens[~spec_rows]
            num_single = (plain_lens == 1).sum().item()  # expect: HS201
            num_plain = plain_lens.numel() - num_single
            num_plain_tokens = plain_lens.sum().item()  # expect: HS201
            plain_loc = torch.zeros(num_plain + 1, dtype=torch.int32, device=loc.device)
            torch.cumsum(plain_lens, dim=0, out=plain_loc[1:])
            rows = step.block_table[~spec_rows, 0]
            if accepted is not None:
                accepted = accepted[spec_rows]
            if num_plain_tokens == 0:
                return None

        if num_plain <= self.rows_buf.numel():
            # device-to-device copies into persistent buffers: not uploads
            self.rows_buf[:num_plain].copy_(rows, non_blocking=True)
            self.loc_buf[: num_plain + 1].copy_(plain_loc, non_blocking=True)
            if spec_rows is not None:
                self.mask_buf[: spec_rows.numel()].copy_(spec_rows, non_blocking=True)
        return rows, plain_loc, num_spec

    def capture_inputs(self, step: StepInputs):
        accepted = torch.diff(step.query_start_loc)
        drafts_cpu = (accepted - 1).cpu()  # expect: HS201
        return self.split(step, drafts_cpu, accepted)
