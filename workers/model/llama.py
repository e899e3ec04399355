"""pagedq's own Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

It reads Hugging Face weights directly; q/k/v and gate/up projections are
fused into one matrix each so a layer is four matrix products.  A model can
hold a contiguous range of layers only (a pipeline stage): the first stage
embeds tokens, the last one normalises and computes logits.  It can also hold
one tensor-parallel shard of each layer: its KV-head groups' rows of q/k/v and
columns of o_proj (column- then row-parallel), its slice of the MLP's
intermediate columns, and one all-reduce after o_proj and after down_proj.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagedq.kernels import AttentionMetadata, paged_attention


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @classmethod
    def from_folder(cls, path: Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        gen_file = Path(path) / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        num_heads = raw["num_attention_heads"]
        window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            sliding_window=window,
        )


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


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for the config's RoPE variant."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], scaling.get("factor", 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen = old_len / scaling["low_freq_factor"]
        high_wavelen = old_len / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(cfg, scaling, inv_freq)
    raise ValueError(f"RoPE scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn_inv_freq(cfg: ModelConfig, scaling: dict, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim, base, factor = cfg.head_dim, cfg.rope_theta, scaling["factor"]
    original = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
    attention_factor = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow") or 1)), dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, attention_factor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operations, in the same order, as transformers' LlamaRMSNorm, so greedy tokens match it
    # exactly; only the temporaries are reused.
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * scale).mul_(weight)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with the sign of rotate_half folded into ``signed_sin``.

    ``rotate_half(x) = cat(-x2, x1)``; ``(-x2) * s`` and ``x2 * (-s)`` round alike, so this is
    bit-identical to transformers' form in four operations instead of five.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v rows, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class CausalLM:
    """A stack of decoder layers ``layer_range`` of the model, with embed/head on the ends."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer_range: tuple[int, int] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, attention=None,
                 shard: Shard | None = None) -> None:
        self.cfg = cfg
        self.first, self.last = layer_range or (0, cfg.num_layers)
        self.is_first_stage = self.first == 0
        self.is_last_stage = self.last == cfg.num_layers
        self.attention = attention
        self.shard = shard or Shard.full(cfg)
        self.tp_group = self.shard.group if self.shard.size > 1 else None
        self.scale = cfg.head_dim ** -0.5
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight") if self.is_first_stage or cfg.tie_word_embeddings else None
        if self.is_last_stage:
            self.norm = w("model.norm.weight")
            self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight")
        self.layers = [self._load_layer(w, i) for i in range(self.first, self.last)]
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.rope_scale).to(device=device, dtype=dtype)
        sin = emb.sin() * self.rope_scale
        half = cfg.head_dim // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)
        self._buffers: dict[str, torch.Tensor] = {}

    def _load_layer(self, w, i: int) -> DecoderLayer:
        p, d, sh = f"model.layers.{i}.", self.cfg.head_dim, self.shard
        rows = {"q": slice(sh.q_heads[0] * d, sh.q_heads[1] * d), "k": slice(sh.kv_heads[0] * d, sh.kv_heads[1] * d)}
        rows["v"] = rows["k"]
        mlp = slice(*sh.mlp)
        bias = None
        if self.cfg.attention_bias:
            bias = torch.cat([w(p + f"self_attn.{n}_proj.bias")[rows[n]] for n in "qkv"])
        return DecoderLayer(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=torch.cat([w(p + f"self_attn.{n}_proj.weight")[rows[n]] for n in "qkv"]),
            qkv_bias=bias,
            o_proj=w(p + "self_attn.o_proj.weight")[:, rows["q"]].contiguous(),
            post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([w(p + "mlp.gate_proj.weight")[mlp], w(p + "mlp.up_proj.weight")[mlp]]),
            down=w(p + "mlp.down_proj.weight")[:, mlp].contiguous(),
        )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run this stage's layers over ``hidden [num_tokens, hidden_size]``."""
        cos, sin = self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = hidden + self._reduce(self._attention(
                layer, rms_norm(hidden, layer.input_norm, self.cfg.rms_norm_eps), cos, sin, meta, k_cache, v_cache))
            h = rms_norm(hidden, layer.post_norm, self.cfg.rms_norm_eps)
            gate, up = self._matmul("gate_up", h, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + self._reduce(F.linear(F.silu(gate, inplace=True).mul_(up), layer.down))
        return hidden

    def _matmul(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` into a buffer reused by every layer and step.

        The widest products (gate/up, logits) are megabytes per call; fresh memory
        for them costs page faults that slow the product itself by up to a third.
        """
        rows, cols = x.shape[0], weight.shape[0]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * cols:
            buf = self._buffers[name] = x.new_empty(max(rows, 256) * cols)
        return torch.mm(x, weight.t(), out=buf[: rows * cols].view(rows, cols))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel product over this stage's shards (a no-op unsharded)."""
        if self.tp_group is not None:
            self.tp_group.allreduce([partial]).wait()
        return partial

    def _attention(self, layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        d, n = self.cfg.head_dim, h.shape[0]
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        # q and k sit side by side in qkv's rows: one RoPE pass covers both.
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, d), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, d)
        out = paged_attention(self.attention, q, k, v, k_cache, v_cache, meta, self.scale)
        return F.linear(out.reshape(n, self.q_size), layer.o_proj)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in a reused buffer: valid until the next call."""
        return self._matmul("logits", rms_norm(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights
