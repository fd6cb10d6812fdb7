"""Engine-style: metadata for chunked-context MLA prefill (equal chunks per request)."""
from dataclasses import dataclass

import torch


@dataclass
class ContextChunks:
    cu_seq_lens: torch.Tensor
    starts: torch.Tensor
    chunk_totals: list[int]
    chunk_max_lens: list[int]
    workspace: torch.Tensor
    rank_cu_seq_lens: torch.Tensor | None = None


@dataclass
class BatchMeta:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor


class ChunkedContextBuilder:
    def __init__(self, workspace_tokens: int, page_size: int, dim: int, device: torch.device,
                 ranks: int = 1):
        self.device = device
        self.page_size = page_size
        self.ranks = ranks
        self.workspace_tokens = workspace_tokens
        self.workspace = torch.empty(workspace_tokens, dim, dtype=torch.bfloat16, device=device)

    def build(self, meta: BatchMeta, num_decodes: int) -> ContextChunks | None:
        device = self.device
        query_lens_cpu = meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1]
        context_lens_cpu = (meta.seq_lens_cpu - query_lens_cpu)[num_decodes:]
        num_prefills = context_lens_cpu.numel()
        longest = context_lens_cpu.max().item()  # host tensor: no sync
        with_context = (context_lens_cpu > 0).sum().item()
        if longest == 0:
            return None
        chunk = self.workspace_tokens // with_context // self.page_size * self.page_size
        num_chunks = -(-longest // chunk)

        starts = torch.arange(num_chunks, dtype=torch.int32).unsqueeze(1).expand(
            -1, num_prefills) * chunk
        ends = torch.minimum(context_lens_cpu.unsqueeze(0), starts + chunk)
        lens = (ends - starts).clamp(min=0)
        cu = torch.zeros(num_chunks, num_prefills + 1, dtype=torch.int32, pin_memory=True)
        torch.cumsum(lens, dim=1, out=cu[:, 1:])

        if self.ranks > 1:
            rank_chunk = chunk // self.ranks
            rank_starts = torch.arange(num_chunks, dtype=torch.int32)[:, None] * rank_chunk
            rank_lens = (torch.minimum((context_lens_cpu // self.ranks)[None], rank_starts
                                       + rank_chunk) - rank_starts).clamp(min=0)
            rank_cu = torch.zeros(num_chunks, num_prefills + 1, dtype=torch.int32,
                                  pin_memory=True)
            torch.cumsum(rank_lens, dim=1, out=rank_cu[:, 1:])
            out = ContextChunks(
                cu_seq_lens=cu.to(device, non_blocking=True),
                starts=rank_starts.to(device, non_blocking=True),  # expect: HS101
                chunk_totals=rank_lens.sum(dim=1).tolist(),
                chunk_max_lens=lens.max(dim=1).values.tolist(),
                workspace=self.workspace,
                rank_cu_seq_lens=rank_cu.to(device, non_blocking=True),
            )
        else:
            out = ContextChunks(
                cu_seq_lens=cu.to(device, non_blocking=True),
                starts=starts.to(device, non_blocking=True),  # expect: HS101
                chunk_totals=lens.sum(dim=1).tolist(),
                chunk_max_lens=lens.max(dim=1).values.tolist(),
                workspace=self.workspace,
            )
        return out

    def build_pinned(self, context_lens: list[int], chunk: int, num_chunks: int):
        # the fixed pattern: every table in one pinned staging buffer, one upload
        n = len(context_lens)
        host = torch.empty(3, num_chunks, n, dtype=torch.int32, pin_memory=True)
        torch.arange(num_chunks, dtype=torch.int32, out=host[0, :, 0])
        host[0] = host[0, :, :1] * chunk
        host[1] = torch.tensor(context_lens, dtype=torch.int32)
        return host.to(self.device, non_blocking=True)

    def prefill_query_start(self, meta: BatchMeta, num_decodes: int):
        qsl = meta.query_start_loc[num_decodes:] - meta.query_start_loc[num_decodes]
        first = qsl[1].item()  # expect: HS201
        return qsl, first


def iterate_chunks(chunks: ContextChunks, kv_cache, gather):
    for i, total in enumerate(chunks.chunk_totals):
        gather(kv_cache, chunks.workspace[:total], chunks.cu_seq_lens[i], chunks.starts[i])
        if chunks.starts[i].max().item() > 0:  # expect: HS201
            continue
