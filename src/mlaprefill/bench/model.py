"""A stack of MLA decoder layers with random weights at a preset's dimensions (bench model).

Per layer (DeepSeek-V2/V3 layout, Hugging Face weight shapes)::

    h      = rms_norm(x)
    q      = q_b(rms_norm(q_a(h)))            [T, H, qk_nope + qk_rope]   (q_proj(h) without q_lora)
    kv     = kv_a(h)                          [T, kv_lora_rank + qk_rope]
    kv_c   = rms_norm(kv[:, :kv_lora_rank]);  k_pe = rope(kv[:, kv_lora_rank:])
    q_pe   = rope(q[..., qk_nope:])
    out    = attend(layer, q, kv_c, k_pe)     [T, H, v_head_dim]  (the engine's chunked forward)
    x      = x + o_proj(out)
    x      = x + mlp(rms_norm(x))             dense SwiGLU standing in for the MoE

and at the end ``argmax(lm_head(rms_norm(x[sample_index])))``: the first sampled token of each
request whose last prompt token is in the step. The attention is a callback so that the engine
(paged cache + :class:`mlaprefill.MLAChunkedPrefill`) and a plain full-attention
reference run the very same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from mlaprefill.config import MLAConfig

__all__ = ["MODEL_PRESETS", "BenchModel", "ModelDims", "model_dims"]

# preset -> (hidden_size, q_lora_rank or None, intermediate_size of the dense stand-in MLP).
# deepseek-v3 / kimi-k2: 8 routed experts of 2048 + 1 shared (2048) -> 18432 active per token.
# deepseek-v2-lite: no q compression; its dense MLP width 10944 (~6 routed + 2 shared of 1408).
MODEL_PRESETS: Mapping[str, tuple[int, int | None, int]] = MappingProxyType({
    "deepseek-v3": (7168, 1536, 18432),
    "deepseek-v2-lite": (2048, None, 10944),
    "kimi-k2": (7168, 1536, 18432),
    "tiny": (64, 32, 128),
})

# attend(layer_index, q [T, H, qk_head], kv_c [T, kv_lora_rank], k_pe [T, qk_rope]) -> [T, H, v]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
QueryBufferFn = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ModelDims:
    """Dimensions of the bench model.

    Parameters
    ----------
    mla : MLAConfig
        Attention head dimensions (``num_heads`` already divided by the tensor-parallel size).
    hidden_size, intermediate_size, vocab_size : int
    q_lora_rank : int or None
        None means a plain ``q_proj`` (DeepSeek-V2-Lite).
    rope_theta : float
    """

    mla: MLAConfig
    hidden_size: int
    q_lora_rank: int | None
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelDims.{name} must be a positive int, got {v!r}.")
        if self.mla.qk_rope_head_dim % 2:
            raise ValueError(f"ModelDims: qk_rope_head_dim must be even for RoPE, got "
                             f"{self.mla.qk_rope_head_dim}.")


def model_dims(preset: str, *, tp: int = 1, vocab_size: int = 4096) -> ModelDims:
    """Dimensions of one tensor-parallel shard of ``preset``.

    ``tp`` divides the heads and the MLP width (the per-GPU shard of a TP deployment:
    DeepSeek-V3 at ``tp=8`` has 16 heads per GPU).

    Raises
    ------
    ValueError
        Unknown preset, or ``tp`` that does not divide the heads / MLP width.
    """
    mla = MLAConfig.from_preset(preset)
    hidden, q_lora, inter = MODEL_PRESETS[preset]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp must be a positive int, got {tp!r}.")
    if mla.num_heads % tp or inter % tp:
        raise ValueError(f"tp={tp} must divide num_heads={mla.num_heads} and "
                         f"intermediate_size={inter} of preset {preset!r}.")
    mla = MLAConfig(num_heads=mla.num_heads // tp, kv_lora_rank=mla.kv_lora_rank,
                    qk_nope_head_dim=mla.qk_nope_head_dim,
                    qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
    return ModelDims(mla=mla, hidden_size=hidden, q_lora_rank=q_lora,
                     intermediate_size=inter // tp, vocab_size=vocab_size)


def _rand(gen: torch.Generator, shape: tuple[int, ...], fan_in: int, *, device: torch.device,
          dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * fan_in ** -0.5
    return w.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim. x [T, ..., R]; cos/sin [T, R/2] broadcast over middle."""
    half = x.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class BenchModel:
    """Random-weight MLA decoder stack (inference only, no autograd).

    Parameters
    ----------
    dims : ModelDims
    num_layers : int
    device : torch.device
    dtype : torch.dtype
        bfloat16 on the GPU; float32/float64 on the CPU.
    seed : int
        Weights are drawn from a generator on ``device`` seeded with this value.

    Attributes
    ----------
    kv_b_proj : list of Tensor [H * (qk_nope + v_head), kv_lora_rank]
        Per layer, the up-projection in the Hugging Face layout the forward takes.
    """

    def __init__(self, dims: ModelDims, num_layers: int, *, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
        self.dims = dims
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.dtype = dtype
        m = dims.mla
        hd, H = dims.hidden_size, m.num_heads
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        kw = {"device": self.device, "dtype": dtype}

        def rand(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
            return _rand(gen, shape, fan_in, **kw)

        self.embed = rand((dims.vocab_size, hd), 1)
        self.layers: list[dict[str, torch.Tensor]] = []
        self.kv_b_proj: list[torch.Tensor] = []
        for _ in range(num_layers):
            w: dict[str, torch.Tensor] = {}
            if dims.q_lora_rank is None:
                w["q_proj"] = rand((H * m.qk_head_dim, hd), hd)
            else:
                w["q_a"] = rand((dims.q_lora_rank, hd), hd)
                w["q_b"] = rand((H * m.qk_head_dim, dims.q_lora_rank), dims.q_lora_rank)
            w["kv_a"] = rand((m.latent_dim, hd), hd)
            w["o_proj"] = rand((hd, H * m.v_head_dim), H * m.v_head_dim)
            w["gate_up"] = rand((2 * dims.intermediate_size, hd), hd)
            w["down"] = rand((hd, dims.intermediate_size), dims.intermediate_size)
            self.layers.append(w)
            self.kv_b_proj.append(rand((H * (m.qk_nope_head_dim + m.v_head_dim),
                                        m.kv_lora_rank), m.kv_lora_rank))
        self.lm_head = rand((dims.vocab_size, hd), hd)
        half = m.qk_rope_head_dim // 2
        self.inv_freq = 1.0 / (dims.rope_theta ** (
            torch.arange(half, device=self.device, dtype=torch.float32) / half))

    @property
    def num_params(self) -> int:
        n = self.embed.numel() + self.lm_head.numel()
        n += sum(t.numel() for w in self.layers for t in w.values())
        return n + sum(t.numel() for t in self.kv_b_proj)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), eps=1e-6)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                sample_index: torch.Tensor | None, attend: AttendFn, *,
                return_logits: bool = False,
                query_buffer: QueryBufferFn | None = None) -> torch.Tensor | None:
        """Run all layers on one step's tokens; return the greedy first token of sampled rows.

        Parameters
        ----------
        token_ids, positions : int32 [T], on the model's device
            Packed new tokens of the step and their positions in their prompts.
        sample_index : int32 [S] or None
            Rows of ``T`` whose next token is sampled (None or S == 0: no sampling).
        attend : AttendFn
            ``attend(layer, q [T, H, qk_head], kv_c [T, kv_lora_rank], k_pe [T, qk_rope])``
            -> ``[T, H, v_head_dim]``; q and k_pe are already roped.

        return_logits : bool
            Return the float32 logits [S, vocab] instead of the argmax (tests use it).
        query_buffer : callable, optional
            ``query_buffer(layer, T)`` -> ``[T, H, qk_head]``: where to write that layer's roped
            q (e.g. the attention's ``io_buffers(T).q``, so that it is not copied); default: a new
            tensor per layer.

        Returns
        -------
        int32 [S] on the model's device, or None when nothing is sampled.

        Notes
        -----
        Device work only (no host sync) as long as ``attend`` is.
        """
        m = self.dims.mla
        T, H = token_ids.shape[0], m.num_heads
        x = F.embedding(token_ids, self.embed)  # [T, hidden]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, R/2]
        cos, sin = freqs.cos(), freqs.sin()
        for i, w in enumerate(self.layers):
            h = self._norm(x)
            if "q_proj" in w:
                q = F.linear(h, w["q_proj"])
            else:
                q = F.linear(self._norm(F.linear(h, w["q_a"])), w["q_b"])
            q = q.view(T, H, m.qk_head_dim)
            parts = (q[..., : m.qk_nope_head_dim], _rope(q[..., m.qk_nope_head_dim:], cos, sin))
            q = torch.cat(parts, dim=-1) if query_buffer is None else torch.cat(
                parts, dim=-1, out=query_buffer(i, T))
            kv = F.linear(h, w["kv_a"])  # [T, kv_lora_rank + qk_rope]
            kv_c = self._norm(kv[:, : m.kv_lora_rank])
            k_pe = _rope(kv[:, m.kv_lora_rank:], cos, sin)
            out = attend(i, q, kv_c, k_pe)  # [T, H, v_head_dim]
            x = x + F.linear(out.reshape(T, H * m.v_head_dim).to(x.dtype), w["o_proj"])
            gu = F.linear(self._norm(x), w["gate_up"])  # [T, 2 * intermediate]
            gate, up = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        if sample_index is None or sample_index.shape[0] == 0:
            return None
        rows = self._norm(x.index_select(0, sample_index.to(torch.int64)))  # [S, hidden]
        logits = F.linear(rows, self.lm_head).float()  # [S, vocab]
        if return_logits:
            return logits
        return logits.argmax(dim=-1).to(torch.int32)
