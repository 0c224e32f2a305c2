"""The MiniMind language model, built piece by piece in notebook 03_model: RMSNorm, RoPE, GQA,
SwiGLU (its checkpoints: checkpoint.py; packed documents' masks, dense or FlexAttention's: notebook
06_dynamic_batching, batching.py).

Read it top to bottom, like nanoGPT. Architecture and parameter names are exactly MiniMind2's and,
with qk_norm ("minimind-3") and use_moe ("minimind-3-moe"), MiniMind-3's: a MiniMind ``.pth`` loads
with ``strict=True``. x -> embed_tokens -> [ x + attn(norm(x)); x + mlp(norm(x)) ] * L -> norm ->
lm_head (tied to embed_tokens)"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import flex_attention  # the module: tests may stand in for its functions
from torch.nn.attention.flex_attention import BlockMask

# the label of a position whose next token is not trained (PyTorch CE's ignore_index)
IGNORE_INDEX = -100


# ---- Configuration
MAX_POSITIONS = 2**17  # the rotary tables: 2 x head_dim floats a position, 128 MB at head_dim 128
# every field's rule, checked wherever a config is built: presets, notebooks, config.json, import-hf
FIELD_RULES = {
    **dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size",
                     "num_experts", "num_experts_per_tok"),
                    # type(): True is no size
                    (lambda v: type(v) is int and v > 0, "a positive integer")),
    "max_position_embeddings": (
        lambda v: type(v) is int and 0 < v <= MAX_POSITIONS,
        f"a positive integer <= {MAX_POSITIONS} (the rotary tables hold a row per position)"),
    # None: derived from the others
    **dict.fromkeys(("intermediate_size", "head_dim", "moe_intermediate_size"),
                    (lambda v: v is None or type(v) is int and v > 0,
                     "a positive integer (or None)")),
    **dict.fromkeys(("rope_theta", "rms_norm_eps"),  # the comparisons refuse nan
                    (lambda v: type(v) in (int, float) and 0 < v < math.inf,
                     "a finite number > 0")),
    "dropout": (lambda v: type(v) in (int, float) and 0 <= v < 1,
                "a number from 0 to 1 (1 excluded)"),
    "router_aux_loss_coef": (lambda v: type(v) in (int, float) and 0 <= v < math.inf,
                             "a finite number >= 0"),
    **dict.fromkeys(("qk_norm", "inference_rope_scaling", "use_moe", "norm_topk_prob"),
                    (lambda v: type(v) is bool, "a bool")),
}


@dataclass
class MiniMindConfig:
    """Hyper-parameters of a MiniMind model; the defaults are MiniMind2-small (25,829,888
    parameters)."""
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    vocab_size: int = 6400
    # None: 64 * ceil(int(hidden * 8 / 3) / 64), MiniMind's rule (1408 for 512)
    intermediate_size: int | None = None
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768
    dropout: float = 0.0
    # None: hidden_size // num_attention_heads (MiniMind-3 may set it apart)
    head_dim: int | None = None
    qk_norm: bool = False  # MiniMind-3: a per-head RMSNorm on queries and keys, before RoPE
    # MiniMind-3's YaRN (YARN_SCALING), to run past the trained length
    inference_rope_scaling: bool = False
    # MiniMind-3-MoE: every block's FFN is a mixture of experts (MoEFeedForward)
    use_moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 1  # k: the experts each token is sent to
    # None: intermediate_size (each expert as wide as the dense FFN)
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True  # rescale the k chosen router scores to sum to 1
    router_aux_loss_coef: float = 5e-4  # weight of the load-balancing loss added in training

    def __post_init__(self) -> None:
        for name, (ok, rule) in FIELD_RULES.items():
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"MiniMindConfig.{name}={value!r}: must be {rule}")
        self.intermediate_size = self.intermediate_size or 64 * math.ceil(
            int(self.hidden_size * 8 / 3) / 64
        )
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}; set head_dim "
                             "explicitly")
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             "num_key_value_heads="
                             f"{self.num_key_value_heads} (grouped-query attention needs whole "
                             "groups)")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even integer (rotary "
                             "embeddings pair dims)")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MiniMindConfig.num_experts_per_tok={self.num_experts_per_tok!r}: "
                             "must be an integer "
                             f"from 1 to num_experts={self.num_experts}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "MiniMindConfig":
        """A named configuration of PRESETS, e.g. 'minimind2-small', 'minimind-3' or 'smoke' (plus
        field overrides)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    # JSON-ready; a dense model's has no MoE fields (its config.json reads as before MoE)
    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if self.use_moe or k not in MOE_FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> "MiniMindConfig":
        """Inverse of to_dict; unknown keys are an error (they would otherwise be silently ignored).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MiniMindConfig field(s) {unknown}; known fields: "
                             f"{sorted(known)}")
        return cls(**d)


MOE_FIELDS = ("use_moe", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "norm_topk_prob",
              "router_aux_loss_coef")
PRESETS: dict[str, dict] = {
    # MiniMind2-small exactly (head_dim 64, FFN 1408): 25,829,888 parameters.
    "minimind2-small": dict(),
    # MiniMind-3 dense exactly: head_dim 96, 4 kv heads, FFN 64 * ceil(768 * pi / 64) = 2432;
    # 63,912,192 parameters.
    "minimind-3": dict(hidden_size=768, num_key_value_heads=4,
                       intermediate_size=64 * math.ceil(768 * math.pi / 64),
                       rms_norm_eps=1e-6, qk_norm=True),
    # Trains visibly in minutes on a laptop CPU; keeps MiniMind's head_dim 64 and 4:1 query:kv head
    # ratio.
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                max_position_embeddings=2048),
    # Tiny, for CI: seconds per notebook. Still grouped-query (4 query heads share 2 kv heads).
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048),
}
# MiniMind-3-MoE exactly: each FFN becomes 4 experts of width 2432 and a router, a token uses 1;
# 198,416,640 parameters.
PRESETS["minimind-3-moe"] = {**PRESETS["minimind-3"], "use_moe": True}
# MiniMind-3's inference_rope_scaling: YaRN stretching a 2048-token training length 16 times (to
# 32768).
YARN_SCALING = dict(factor=16.0, original_max_position_embeddings=2048, beta_fast=32.0,
                    beta_slow=1.0, attention_factor=1.0)


# ---- Building blocks
class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the gain (as MiniMind does).
    """
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1,
                                                              keepdim=True) + self.eps)).type_as(x)


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 1e6,
                         rope_scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (end, head_dim): position t, pair i rotates by angle t /
    theta^(2i/d). YaRN (rope_scaling): pairs turning over beta_fast times in the trained length keep
    their speed, under beta_slow are slowed `factor` times, a linear ramp between."""
    freqs, scale = 1.0 / (theta ** (torch.arange(0, head_dim,
                                                 2)[: head_dim // 2].float() / head_dim)), 1.0
    trained = end if rope_scaling is None else rope_scaling["original_max_position_embeddings"]
    if end > trained:
        # pair i turns trained * freqs[i] / (2 pi) times in the trained length: solve "turns = beta"
        # for i
        pair_at = lambda beta: (
            head_dim * math.log(trained / (beta * 2 * math.pi)) / (2 * math.log(theta))
        )
        low = max(math.floor(pair_at(rope_scaling["beta_fast"])), 0)
        high = min(math.ceil(pair_at(rope_scaling["beta_slow"])), head_dim // 2 - 1)
        ramp = ((torch.arange(head_dim // 2).float() - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs, scale = freqs * (1 - ramp
                                + ramp / rope_scaling["factor"]), rope_scaling["attention_factor"]
    angles = torch.outer(torch.arange(end).float(), freqs)  # (end, head_dim/2)
    # MiniMind's "rotate half" layout: both halves of the head use the same frequencies.
    cos, sin = torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat([angles.sin(),
                                                                           angles.sin()], dim=-1)
    return cos * scale, sin * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k of shape (B, T, H, D) by cos/sin of shape (B, T, D) or (T, D)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, n_kv, D) -> (B, T, n_kv * n_rep, D): each key/value head serves n_rep query heads
    (GQA)."""
    if n_rep == 1:
        return x
    b, t, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, t, n_kv, n_rep, d).reshape(b, t, n_kv * n_rep, d)


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row of a (B, T) 0/1 padding mask is ones then zeros (no padding, or padding
    on the right)."""
    return bool((attention_mask[:, :-1] >= attention_mask[:, 1:]).all())


def build_attention_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, past_len: int,
                         device: torch.device) -> torch.Tensor | None:
    """The boolean (B, 1, T, past+T) mask for SDPA (True = may attend), or None when plain causal
    suffices.

    attention_mask: None, a (B, past+T) padding mask (1 = real token; causal AND key is real), a (B,
    1, T, past+T) bool block mask (packed documents) or a FlexAttention BlockMask (returned as it
    is). A row with no allowed key attends to itself (no NaN).
"""
    if isinstance(attention_mask, BlockMask):
        return attention_mask
    k_len = past_len + q_len
    if attention_mask is None and (past_len == 0 or q_len == 1):
        return None  # plain causal, or one new token that may see every earlier key
    keys = torch.arange(k_len, device=device)
    # query i sits at position past+i
    queries = torch.arange(past_len, k_len, device=device)[:, None]
    if attention_mask is None:
        return keys <= queries  # (T, K): causal with the cache's offset
    if attention_mask.dim() == 2:
        if attention_mask.shape != (batch, k_len):
            raise ValueError(f"padding attention_mask has shape {tuple(attention_mask.shape)}, "
                             "expected (batch, "
                             f"past+seq) = ({batch}, {k_len})")
        if past_len == 0 and is_right_padded(attention_mask):
            # Only right padding (what the collators make): under plain causal attention real tokens
            # never see a
            # pad, so SDPA's fast is_causal path is exact for them (pad outputs are never trained or
            # read).
            return None
        # causal AND the key is real; a pad row, with no such key, attends to itself (else SDPA
        # gives NaN)
        return ((keys <= queries) & attention_mask.bool()[:, None, None, :]) | (keys == queries)
    if attention_mask.dim() != 4:
        raise ValueError("attention_mask must be (B, T) padding or (B, 1, T, T) bool, got "
                         f"{attention_mask.dim()}-D")
    if attention_mask.dtype != torch.bool:
        raise ValueError("a 4-D attention_mask must be bool (True = may attend), got "
                         f"{attention_mask.dtype}")
    if attention_mask.shape[0] != batch or attention_mask.shape[-2:] != (q_len, k_len):
        raise ValueError(f"block attention_mask has shape {tuple(attention_mask.shape)}, expected "
                         f"({batch}, 1, {q_len}, {k_len})")
    return attention_mask | (keys == queries)  # pad rows attend to themselves


@cache
def flex_attention_for(device_type: str):
    """FlexAttention as the model runs it on a device type (notebook 06 builds its BlockMask:
    batching.document_mask): compiled on CUDA, once (eager FlexAttention materialises every score);
    eager elsewhere (a CPU has only its forward in torch 2.13)."""
    if device_type == "cuda":
        return torch.compile(flex_attention.flex_attention)
    return flex_attention.flex_attention


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query heads, RoPE and an optional KV cache."""
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.n_rep = config.head_dim, self.n_heads // self.n_kv_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:  # only then: MiniMind2's checkpoints have no such keys
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, mask=None, past_key_value=None, use_cache=False):
        """x (B, T, C) -> (B, T, C), plus the (k, v) cache of shape (B, past+T, n_kv, D) when
        use_cache."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        # each head's q and k get unit RMS: their dot products stay bounded
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # before the transpose, as in MiniMind
        if past_key_value is not None:
            k, v = torch.cat([past_key_value[0], k], dim=1), torch.cat([past_key_value[1], v],
                                                                       dim=1)
        present = (k, v) if use_cache else None
        # packed documents through FlexAttention (no dropout: MiniMind's is 0)
        if isinstance(mask, BlockMask):
            flex = flex_attention_for(x.device.type)
            y = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                     enable_gqa=self.n_rep > 1)
            return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(b, t, -1))), present
        # (B, H, T, D) for SDPA; the kv heads are repeated to match the query heads.
        q, k, v = (
            q.transpose(1, 2),
            repeat_kv(k, self.n_rep).transpose(1, 2),
            repeat_kv(v, self.n_rep).transpose(1, 2),
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout
                                           if self.training else 0.0,
                                           is_causal=mask is None and past_key_value is None)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(y)), present


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), of width config.intermediate_size unless `width` is
    given (an expert)."""
    def __init__(self, config: MiniMindConfig, width: int | None = None):
        super().__init__()
        width = width or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MoEFeedForward(nn.Module):
    """MiniMind-3's mixture of experts: a router (`gate`) scores E SwiGLU experts per token
    (softmax); the output is the token's top-k experts' outputs weighted by their scores (rescaled
    to sum 1: norm_topk_prob). In training `aux_loss` is the load-balancing loss coef * E * sum_e
    load_e * mean_score_e (load_e: picks of e per token)."""
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(config, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (N, C): routing is per token
        shape, x, c = x.shape, x.reshape(-1, x.shape[-1]), self.config
        scores = F.softmax(self.gate(x), dim=-1)  # (N, E)
        weights, chosen = torch.topk(scores, c.num_experts_per_tok, dim=-1)  # (N, k)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        y = torch.zeros_like(x)
        # every expert runs, on its tokens only (maybe none: grads of 0)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # a token picks an expert at most once
            y.index_add_(0, token, (expert(x[token]) * weights[token, slot, None]).to(y.dtype))
        self.aux_loss = None
        # all N positions count, padding included (as MiniMind-3's)
        if self.training and c.router_aux_loss_coef > 0:
            load = F.one_hot(chosen, c.num_experts).sum(1).float().mean(0)  # (E,), sums to k
            self.aux_loss = c.router_aux_loss_coef * c.num_experts * (load * scores.mean(0)).sum()
        return y.view(shape)


class MiniMindBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_moe:
            self.mlp = MoEFeedForward(config)
        else:
            self.mlp = FeedForward(config)

    def forward(self, x, cos, sin, mask=None, past_key_value=None, use_cache=False):
        h, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_key_value,
                                    use_cache)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class MiniMindModel(nn.Module):
    """Embeddings, the stack of blocks and the final norm (MiniMind's ``model.*`` keys)."""
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([MiniMindBlock(config)
                                     for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = precompute_freqs_cis(config.head_dim, config.max_position_embeddings,
                                        config.rope_theta,
                                        YARN_SCALING if config.inference_rope_scaling else None)
        # not persistent: not in MiniMind's checkpoints
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False):
        """input_ids (B, T) -> hidden states (B, T, C) and the new KV cache (list of (k, v) per
        layer, or None)."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError("input_ids must be a (batch, seq_len) tensor of token ids, "
                             "torch.long or torch.int; got "
                             f"shape {tuple(input_ids.shape)} of {input_ids.dtype} (one sequence: "
                             "input_ids[None])")
        b, t = input_ids.shape
        past_len = past_key_values[0][0].shape[1] if past_key_values else 0
        # Real CPU tensors only: on a GPU a check would stall the host every forward (packed rows'
        # positions come from
        # the collate, on the CPU); fake tensors hold no values; a compiled graph would break there.
        on_cpu = lambda ids: (type(ids) is torch.Tensor and ids.device.type == "cpu"  # noqa: E731
                              and not torch.compiler.is_compiling())
        if position_ids is None:
            if past_len + t > self.config.max_position_embeddings:
                raise ValueError(f"sequence of {past_len + t} tokens exceeds "
                                 "max_position_embeddings="
                                 f"{self.config.max_position_embeddings}")
            cos, sin = self.freqs_cos[past_len : past_len + t], self.freqs_sin[past_len : past_len
                                                                               + t]
        else:
            # Packed rows restart positions at every document: look each position up in the table.
            if position_ids.shape[-1] != t:
                raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected "
                                 f"(B, {t}) or ({t},)")
            if on_cpu(position_ids) and (
                int(position_ids.max()) >= self.config.max_position_embeddings
                or int(position_ids.min()) < 0
            ):
                raise ValueError(f"position_ids range [{int(position_ids.min())}, "
                                 f"{int(position_ids.max())}] is "
                                 "outside [0, "
                                 f"max_position_embeddings={self.config.max_position_embeddings})")
            cos, sin = self.freqs_cos[position_ids], self.freqs_sin[position_ids]
        mask = build_attention_mask(attention_mask, b, t, past_len, input_ids.device)
        if (
            on_cpu(input_ids)
            and input_ids.numel()
            and bool((input_ids.min() < 0) | (input_ids.max() >= self.config.vocab_size))
        ):
            raise ValueError(f"token ids range [{int(input_ids.min())}, {int(input_ids.max())}] is "
                             "outside "
                             f"[0, vocab_size={self.config.vocab_size})")
        x = self.dropout(self.embed_tokens(input_ids))
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, cos, sin, mask, past_key_values[i] if past_key_values else None,
                               use_cache)
            presents.append(present)
        return self.norm(x), presents if use_cache else None


@dataclass
class CausalLMOutput:
    """What MiniMindForCausalLM.forward returns (aux_loss: the MoE layers' load-balancing loss, in
    training)."""
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    past_key_values: list | None = None
    aux_loss: torch.Tensor | None = None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in float32: logits[:, t] predicts labels[:, t+1]; -100 labels are
    ignored."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree "
                         "on (B, T)")
    # Shift the labels, not the logits (slicing logits would copy all B*T*V); the last position gets
    # IGNORE_INDEX.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets,
                           ignore_index=IGNORE_INDEX,
                           reduction=reduction)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (hidden @ weight.T) over targets, `chunk` rows at a time: each
    chunk's fp32 logits become their gradient (softmax - one-hot) in place and are folded into the
    gradients of hidden and weight at once, so neither the (N, V) logits nor their gradient ever
    exist whole and backward only scales."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        for start in range(0, hidden.shape[0], chunk):  # a chunk's logits die with its call
            rows = slice(start, start + chunk)
            loss += LinearCrossEntropy.chunk(hidden[rows], weight, targets[rows], grad_hidden[rows],
                                             grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def chunk(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, grad_h: torch.Tensor,
              grad_weight: torch.Tensor) -> torch.Tensor:
        """One chunk's summed loss; its gradients written into grad_h and added into grad_weight."""
        trained = (y != IGNORE_INDEX)[:, None]  # a mask, not an index: no host read on a GPU
        logits = (h @ weight.T).float()  # autocast: the matmul in its dtype; the softmax in fp32
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        picked = logits.gather(1, y.clamp(min=0)[:, None])
        one_hot = -torch.ones_like(picked)
        grad = logits.sub_(lse).exp_().scatter_add_(1, y.clamp(min=0)[:, None], one_hot)
        grad = grad.mul_(trained).to(weight.dtype)  # untrained positions: no loss, no gradient
        grad_h.copy_(grad @ weight)
        grad_weight += (grad.T @ h).to(weight.dtype)
        return ((lse - picked) * trained).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk: int) -> torch.Tensor:
    """lm_loss(hidden @ weight.T, labels, reduction="sum") without the (B, T, V) logits: the head
    and the loss `chunk` positions at a time (LinearCrossEntropy); equal up to float rounding,
    gradients too."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be >= 1 positions")
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets, chunk)


class MiniMindForCausalLM(nn.Module):
    """MiniMind2: the model plus the language-model head, whose weight is the embedding matrix
    (tied)."""
    def __init__(self, config: MiniMindConfig | None = None):
        super().__init__()
        self.config = config or MiniMindConfig()
        self.model = MiniMindModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        # tied: one matrix, two keys in the state dict
        self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's N(0, 0.02) for every Linear and Embedding, without its scaled residual projections
        # (notebook 03).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                past_key_values: list | None = None, use_cache: bool = False,
                logits_to_keep: int = 0) -> CausalLMOutput:
        """Logits (B, T, V); loss (mean over non -100 shifted labels) when labels are given; KV
        cache if asked; in training the MoE layers' summed aux_loss (not in `loss`: the training
        loop adds it, as MiniMind-3's does)."""
        h, presents = self.model(input_ids, attention_mask, position_ids, past_key_values,
                                 use_cache)
        if logits_to_keep:  # generation only needs the last position(s)
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        # GPU: no stall
        cpu_labels = (
            type(labels) is torch.Tensor and labels.device.type == "cpu" and labels.dim() == 2
        )
        # a mean over no tokens is 0/0
        if cpu_labels and not bool((labels[:, 1:] != IGNORE_INDEX).any()):
            raise ValueError("the loss is undefined: every label after the first position is -100 "
                             "(ignored), so no "
                             "token is predicted and the mean over none is NaN; lm_loss(..., "
                             "reduction='sum') gives 0")
        if labels is not None:
            loss = lm_loss(logits, labels)
        else:
            loss = None
        aux = [layer.mlp.aux_loss for layer in self.model.layers if getattr(layer.mlp, "aux_loss",
                                                                            None) is not None]
        aux_loss = None
        if aux:
            aux_loss = sum(aux)
        return CausalLMOutput(logits=logits, loss=loss, past_key_values=presents, aux_loss=aux_loss)


# ---- Parameter counting
_PARTS = (("embed_tokens", "embeddings"), ("lm_head", "embeddings"), ("self_attn", "attention"),
          (".mlp.", "mlp"),
          ("norm", "norms"))


def count_parameters(model: nn.Module) -> dict:
    """Unique parameters per component: embeddings (tied with lm_head), attention, mlp, norms,
    total."""
    counts = {"embeddings": 0, "attention": 0, "mlp": 0, "norms": 0, "other": 0}
    for name, p in model.named_parameters():  # named_parameters yields a tied weight once
        part = next((part for key, part in _PARTS if key in name), "other")
        counts[part] += p.numel()
    if counts["other"] == 0:
        del counts["other"]
    counts["total"] = sum(counts.values())
    return counts
