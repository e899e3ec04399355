"""Layers every model family is built from: norms, rotary embeddings, attention, gated MLP, mixture of experts.

Each follows the operations of transformers' own modules in the same order,
so greedy tokens match them in fp32.  Every layer can hold one
tensor-parallel ``Shard`` of its matrices: attention by KV-head groups
(column-parallel q/k/v, row-parallel o_proj), the MLP (and each expert) by
intermediate columns; the model all-reduces after o_proj and after down_proj.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq.kernels import AttentionMetadata, paged_attention
from pagedq.workers.model.config import ModelConfig

WeightFn = Callable[[str], torch.Tensor]  # a checkpoint tensor by name, on the model's device and dtype


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``range(n)`` in ``parts`` pieces whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        ranges.append((start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class Shard:
    """The slice of every layer's matrices one tensor-parallel process holds.

    Attention is split by KV-head groups (each group keeps its query heads), so
    a model whose KV heads do not divide by T still splits: 3 KV heads over 2
    processes become 2 + 1.  MLP columns split as evenly as they go.
    """

    rank: int = 0
    size: int = 1
    kv_heads: tuple[int, int] = (0, 0)
    q_heads: tuple[int, int] = (0, 0)
    mlp: tuple[int, int] = (0, 0)
    group: object | None = None  # the process group of this stage's shards (all-reduce)

    @classmethod
    def full(cls, cfg: ModelConfig) -> Shard:
        return cls.of(cfg, 0, 1)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, group=None) -> Shard:
        if size > cfg.num_kv_heads:
            raise ValueError(f"tensor_parallel={size} exceeds the model's {cfg.num_kv_heads} KV heads")
        per_group = cfg.num_heads // cfg.num_kv_heads
        kv = split_evenly(cfg.num_kv_heads, size)[rank]
        return cls(rank, size, kv, (kv[0] * per_group, kv[1] * per_group),
                   split_evenly(cfg.intermediate_size, size)[rank], group)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    def columns(self, n: int) -> slice:
        """This shard's part of ``n`` intermediate columns (an expert's, or a dense MLP of another width)."""
        return slice(*split_evenly(n, self.size)[self.rank])


# --- norms and activations --------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operations, in the same order, as transformers' LlamaRMSNorm (and Gemma's, whose (1 + w) the
    # loader folds into the weight), so greedy tokens match it exactly; only the temporaries are reused.
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * scale).mul_(weight)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation by its config.json name; may overwrite its input (a fresh product)."""
    if name == "silu":
        return lambda x: F.silu(x, inplace=True)
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"activation {name!r} is not supported (silu, gelu, gelu_pytorch_tanh)")


# --- rotary embeddings ------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaling: dict | None | str = "config",
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for a RoPE variant (the config's own unless given).

    LongRoPE returns its short factors here; ``long_rope_inv_freq`` gives the long ones.
    """
    base = cfg.rope_theta if theta is None else theta
    scaling = cfg.rope_scaling if scaling == "config" else scaling
    dim = rotary_dim(cfg, scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], scaling.get("factor", 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(scaling, inv_freq, factor), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(cfg, base, dim, scaling, inv_freq)
    if kind in ("longrope", "su"):
        return _long_rope(cfg, base, dim, scaling, "short_factor")
    raise ValueError(f"RoPE scaling type {kind!r} is not supported (default, linear, llama3, yarn, longrope)")


def rotary_dim(cfg: ModelConfig, scaling: dict | None) -> int:
    partial = ((scaling or {}).get("partial_rotary_factor") or cfg.get("rope_parameters", {}).get("partial_rotary_factor")
               or cfg.get("partial_rotary_factor", 1.0))
    return int(cfg.head_dim * partial)


def _llama3_inv_freq(scaling: dict, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / scaling["low_freq_factor"]
    high_wavelen = old_len / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(cfg: ModelConfig, base: float, dim: int, scaling: dict,
                   inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
    attention_factor = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow") or 1)), dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, attention_factor


def long_rope_original(cfg: ModelConfig, scaling: dict) -> int:
    return scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")


def _long_rope(cfg: ModelConfig, base: float, dim: int, scaling: dict, which: str) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("su"): per-frequency factors, and an attention factor from the context extension."""
    original = long_rope_original(cfg, scaling)
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(scaling[which], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base ** shape), attention_factor


class Rotary:
    """cos / sin tables over every position, with rotate_half's sign folded into sin (see ``apply_rope``).

    LongRoPE: positions below the original context use the short factors, later ones the long factors
    (transformers switches the whole sequence to the long factors once it outgrows the original context;
    the two agree whenever the prompt fits in it).
    """

    def __init__(self, cfg: ModelConfig, device, dtype: torch.dtype, theta: float | None = None,
                 scaling: dict | None | str = "config") -> None:
        scaling = cfg.rope_scaling if scaling == "config" else scaling
        inv_freq, scale = rope_inv_freq(cfg, theta, scaling)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        if scaling is not None and scaling["rope_type"] in ("longrope", "su"):
            original = long_rope_original(cfg, scaling)
            long_freq, _ = _long_rope(cfg, cfg.rope_theta if theta is None else theta, rotary_dim(cfg, scaling),
                                      scaling, "long_factor")
            freqs[original:] = positions[original:, None] * long_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        sin = emb.sin() * scale
        half = inv_freq.numel()
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with the sign of rotate_half folded into ``signed_sin``.

    ``rotate_half(x) = cat(-x2, x1)``; ``(-x2) * s`` and ``x2 * (-s)`` round alike, so this is
    bit-identical to transformers' form in four operations instead of five.  With a partial rotary
    factor only the first ``cos.shape[-1]`` dimensions rotate.
    """
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dim], cos, signed_sin), x[..., dim:]), dim=-1)
    half = dim // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))


# --- attention --------------------------------------------------------------------------------------------------
@dataclass
class Attention:
    """One layer's attention over the paged KV cache: fused q/k/v, RoPE, attention, o_proj."""

    qkv: torch.Tensor  # [q + k + v rows, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    num_heads: int  # this shard's
    num_kv_heads: int
    head_dim: int
    scale: float
    rope: str = "default"  # which of the model's Rotary tables
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: per-head RMSNorm of q and k (Qwen3, Gemma 3)
    norm_eps: float = 1e-6
    window: int | None = None  # sliding-window layer: attend to the last `window` positions
    softcap: float | None = None  # Gemma 2: tanh soft-capping of the scores

    def __call__(self, backend, h: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        d, n = self.head_dim, h.shape[0]
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = F.linear(h, self.qkv, self.qkv_bias)
        # q and k sit side by side in qkv's rows: one norm and one RoPE pass cover both.
        qk = qkv[:, :q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, d)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.norm_eps)
        qk = apply_rope(qk, *ropes[self.rope])
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, d)
        out = paged_attention(backend, q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap)
        return F.linear(out.reshape(n, q_size), self.o_proj)


def load_attention(w: WeightFn, prefix: str, cfg: ModelConfig, shard: Shard, *, fused_qkv: bool = False,
                   bias: bool = False, qk_norm: bool = False, norm_offset: float = 0.0, **kw) -> Attention:
    """A layer's attention from ``{prefix}q_proj/k_proj/v_proj/o_proj`` (or a fused ``qkv_proj``), sharded."""
    d, sh = cfg.head_dim, shard
    rows = {"q": slice(sh.q_heads[0] * d, sh.q_heads[1] * d), "k": slice(sh.kv_heads[0] * d, sh.kv_heads[1] * d)}
    rows["v"] = rows["k"]
    if fused_qkv:
        full = w(prefix + "qkv_proj.weight")
        q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
        parts = dict(zip("qkv", full.split([q_rows, kv_rows, kv_rows]), strict=True))
    else:
        parts = {n: w(prefix + f"{n}_proj.weight") for n in "qkv"}
    qkv_bias = torch.cat([w(prefix + f"{n}_proj.bias")[rows[n]] for n in "qkv"]) if bias else None
    norm = None
    if qk_norm:
        q_w = w(prefix + "q_norm.weight") + norm_offset
        k_w = w(prefix + "k_norm.weight") + norm_offset
        norm = torch.cat([q_w.expand(sh.num_heads, d), k_w.expand(sh.num_kv_heads, d)]).contiguous()
    return Attention(
        qkv=torch.cat([parts[n][rows[n]] for n in "qkv"]).contiguous(), qkv_bias=qkv_bias,
        o_proj=w(prefix + "o_proj.weight")[:, rows["q"]].contiguous(),
        num_heads=sh.num_heads, num_kv_heads=sh.num_kv_heads, head_dim=d, qk_norm=norm, norm_eps=cfg.rms_norm_eps,
        **{"scale": d ** -0.5, **kw})


# --- feed-forward -----------------------------------------------------------------------------------------------
class Matmul:
    """``x @ weight.T`` into a buffer reused by every layer and step.

    The widest products (gate/up, logits) are megabytes per call; fresh memory
    for them costs page faults that slow the product itself by up to a third.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape[0], weight.shape[0]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * cols:
            buf = self._buffers[name] = x.new_empty(max(rows, 256) * cols)
        return torch.mm(x, weight.t(), out=buf[: rows * cols].view(rows, cols))


@dataclass
class GatedMLP:
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matrix."""

    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, matmul: Matmul, h: torch.Tensor) -> torch.Tensor:
        gate, up = matmul("gate_up", h, self.gate_up).chunk(2, dim=-1)
        return F.linear(self.act(gate).mul_(up), self.down)


def load_mlp(w: WeightFn, prefix: str, columns: slice, act: str, *, fused: bool = False,
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> GatedMLP:
    """A gated MLP from ``{prefix}gate_proj/up_proj/down_proj`` (or a fused ``gate_up_proj``), sharded by columns."""
    gate_name, up_name, down_name = names
    if fused:
        gate, up = w(prefix + "gate_up_proj.weight").chunk(2, dim=0)
    else:
        gate, up = w(prefix + f"{gate_name}.weight"), w(prefix + f"{up_name}.weight")
    return GatedMLP(gate_up=torch.cat([gate[columns], up[columns]]).contiguous(),
                    down=w(prefix + f"{down_name}.weight")[:, columns].contiguous(), act=activation(act))


@dataclass
class SparseMoE:
    """A mixture-of-experts block: softmax router, top-k experts per token, gated-MLP experts.

    The step's (token, expert) pairs are sorted by expert, so each expert runs
    once over all of its tokens; the Python loop is over experts, never tokens.
    Each token's expert outputs are summed in expert order, as transformers does.
    """

    router: torch.Tensor  # [experts, hidden], replicated on every shard
    gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]
    down: torch.Tensor  # [experts, hidden, intermediate]
    top_k: int
    renormalize: bool  # divide the top-k probabilities by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, matmul: Matmul, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype).reshape(-1)
        pairs = experts.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=self.router.shape[0]).tolist()
        out = torch.zeros_like(h)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            picked = order[start:start + count]
            start += count
            tokens = picked // self.top_k
            gate, up = F.linear(h[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate).mul_(up), self.down[e]) * weights[picked, None]
            out.index_add_(0, tokens, y)
        return out


def load_moe(w: WeightFn, prefix: str, num_experts: int, columns: slice, act: str, *, top_k: int,
             renormalize: bool, router: str = "gate",
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> SparseMoE:
    """Experts from ``{prefix}experts.{e}.{gate,up,down}`` stacked into 3-D tensors, sharded by columns."""
    mlps = [load_mlp(w, f"{prefix}experts.{e}.", columns, act, names=names) for e in range(num_experts)]
    return SparseMoE(router=w(f"{prefix}{router}.weight"), gate_up=torch.stack([m.gate_up for m in mlps]),
                     down=torch.stack([m.down for m in mlps]), top_k=top_k, renormalize=renormalize,
                     act=activation(act))
