"""03_model's regions, against minimind_lib.model: RMSNorm, RoPE, repeat_kv, attention, the block with its SwiGLU, the
decoder, the initialisation."""
import torch
import torch.nn.functional as F

from minimind_lib import model as mm

from . import Case, Share, draw, edited, pick, randomized, region


def rms_norm(self, x):
    xf = x.float()
    return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def _rows(d, dtype):  # rows of RMS about 10^(k - 4) for row k = 0..5 (eps matters, then not), an all-zero row 6
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(d)) * torch.logspace(-4, 2, 7)[:, None]
    return Case(f"{str(dtype)[6:]} rows of RMS 10^(k - 4) for row k = 0..5 and an all-zero row 6, width {d}", d,
                torch.cat([x[:6], torch.zeros(1, d)]).to(dtype), tol=Share(1e-6, 1e-2, 0.01) if d > 16 else None)


ROOT = "torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)"
region("RMSNorm.forward", "x over the root of the mean of its squares over the last dimension (eps inside the root), "
       "in float32, cast back to x's dtype, then times the gain.", rms_norm, method="forward", axes=("row", "channel"),
       fixed=lambda: [_rows(16, torch.float32), _rows(512, torch.bfloat16)],
       drawn=lambda g: [Case("random float32 rows of width 48", 48, torch.randn(5, 48, generator=g) * 3)],
       run=lambda cls, c: randomized(cls(c.args[0], 1e-5), c.args[0])(c.args[1]), output="the output",
       mistakes=(("It leaves eps out (an all-zero row gives nan): eps goes inside the root.", (" + self.eps", "")),
                 ("It adds eps to the root: eps goes inside, to the mean of the squares.",
                  (ROOT, "1 / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)")),
                 ("It adds eps after the reciprocal root: eps goes inside, to the mean of the squares.",
                  (ROOT, "torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)) + self.eps")),
                 ("It computes in x's dtype: in bfloat16 the squares and their mean lose precision; use x.float().",
                  ("xf = x.float()", "xf = x")),
                 ("It does not cast back to x's dtype before the float32 gain.", (".type_as(x)", "")),
                 ("It multiplies by the gain before casting back, so a bfloat16 input gives bfloat16: MiniMind casts "
                  "back first, then multiplies by the float32 gain (a float32 output).",
                  ("self.weight * (xf * ", "(self.weight * xf * ")),
                 ("It leaves out the gain (self.weight).", ("self.weight * ", ""))))

TABLES = "torch.cat([angles.cos(), angles.cos()], dim=-1), torch.cat([angles.sin(), angles.sin()], dim=-1)"
region("rope_tables", "pair i turns at theta^(-2i/head_dim) per position; cos and sin of position x speed, the "
       "head_dim/2 columns repeated for the second half.", mm.precompute_freqs_cis, tol=1e-4, output="(cos, sin)",
       axes=("table (0: cos, 1: sin)", "position", "column"),
       fixed=lambda: [Case(f"rope_tables({d}, {n}, {t:g})", d, n, t) for d, n, t in ((8, 6, 1e4), (16, 40, 1e6))],
       drawn=lambda g: [Case(f"rope_tables({d}, {n}, {t:g})", d, n, t) for d, n, t in [
           (pick(g, (8, 64)), draw(g, 2, 200), pick(g, (1e4, 1e6)))]],
       mistakes=(("Its speeds are theta^(+2i/head_dim): the exponent is negative.", ("1.0 / (theta **", "(theta **")),
                 ("It takes every i of 0..head_dim - 1, not the even ones.",
                  ("torch.arange(0, head_dim, 2)[: head_dim // 2]", "torch.arange(0, head_dim)")),
                 ("It gives head_dim/2 columns: the second half repeats the first.",
                  (TABLES, "angles.cos(), angles.sin()")),
                 ("It repeats each column beside itself (GPT-J's pairs): MiniMind repeats the first half as a whole.",
                  (TABLES, "angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)"))))


def _rope(t, h, h_kv, d):
    g = torch.Generator().manual_seed(t)
    return Case(f"q of shape (2, {t}, {h}, {d}), k of shape (2, {t}, {h_kv}, {d}) and the tables' first {t} rows",
                torch.randn(2, t, h, d, generator=g), torch.randn(2, t, h_kv, d, generator=g),
                *mm.precompute_freqs_cis(d, t, 1e4))


def _turned(turn):
    return edited(mm.apply_rotary_pos_emb, ("rotate_half(", "turn("), turn=turn)


region("apply_rope", "x * cos + rotate_half(x) * sin for q and for k, rotate_half turning the halves (x1, x2) into "
       "(-x2, x1); cos and sin need a heads axis.", mm.apply_rotary_pos_emb, output="the rotated (q, k)",
       fixed=lambda: [_rope(3, 4, 2, 8), _rope(2, 2, 2, 8)], drawn=lambda g: [_rope(draw(g, 1, 9), 6, 3, 8)],
       axes=("tensor (0 is q, 1 is k)", "batch", "position", "head", "dim"),
       mistakes=(("The minus sign is on the wrong half: (x1, x2) turns into (-x2, x1).",
                  _turned(lambda x: torch.cat([x.chunk(2, -1)[1], -x.chunk(2, -1)[0]], -1))),
                 ("It pairs neighbours (2i, 2i+1), as GPT-J does: MiniMind pairs i with i + head_dim/2.",
                  _turned(lambda x: torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2))),
                 ("cos and sin have no heads axis, so they turn heads, not positions: unsqueeze(-2).",
                  ("cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)", "pass"))))

region("repeat_kv", "a new axis after the kv heads, expanded to n_rep copies, the two head axes merged.", mm.repeat_kv,
       tol=0.0, axes=("batch", "position", "head", "dim"),
       fixed=lambda: [Case(f"x of shape {s}, n_rep={n}", torch.randn(s, generator=torch.Generator().manual_seed(1)),
                           n) for s, n in (((1, 2, 2, 4), 3), ((2, 3, 3, 4), 1))],
       drawn=lambda g: [Case("x of shape (2, 4, 3, 8), n_rep=2", torch.randn(2, 4, 3, 8, generator=g), 2)],
       mistakes=(("Query head h reads kv head h % n_kv (x.repeat tiles the heads): it reads h // n_rep.",
                  lambda x, n: x.repeat(1, 1, n, 1)),))


def attention(self, x, cos, sin):
    """minimind_lib's Attention.forward (no mask, cache or dropout) on the chapter's module (its `heads`)."""
    q, k, v = self.heads(x)
    q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (mm.repeat_kv(z, self.n_rep).transpose(1, 2) for z in (k, v))
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(*x.shape[:2], -1))


def written_out(self, x, cos, sin):
    """The same, written out: the base of its usual mistakes."""
    q, k, v = self.heads(x)
    q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = mm.repeat_kv(k, self.n_rep), mm.repeat_kv(v, self.n_rep)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape[:2], -1))


def config(seed, heads=4, kv=2, head_dim=8, hidden=32, layers=1, vocab=97) -> mm.MiniMindConfig:
    return mm.MiniMindConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                             intermediate_size=40 + 8 * (seed % 3), vocab_size=vocab, num_hidden_layers=layers,
                             max_position_embeddings=64, rope_theta=1e4)


def module_case(c, t: int, seed: int) -> Case:
    return Case(f"{c.num_attention_heads} query heads, {c.num_key_value_heads} kv heads of {c.head_dim}, width "
                f"{c.hidden_size}, 2 sequences of T={t} (weights from seed {seed})", c, seed,
                torch.randn(2, t, c.hidden_size, generator=torch.Generator().manual_seed(seed)))


def run_module(cls, case):
    c, seed, x = case.args
    return randomized(cls(c), seed)(x, *mm.precompute_freqs_cis(c.head_dim, x.shape[1], c.rope_theta))


def _reading(case, at):
    return ("Position 0 attends only to itself and already differs: not the mask; look at the scale, the softmax's "
            "dimension, how the heads are laid out and merged back." if at[1] == 0 else
            f"Position 0 agrees, {at[1]} differs: look at what a query sees of earlier positions (the mask, k, v).")


region("Attention.forward", "heads, apply_rope to q and k, repeat_kv to k and v, heads before T for "
       "F.scaled_dot_product_attention with the causal mask, then back, heads merged, o_proj.", attention, tol=1e-4,
       method="forward", run=run_module, output="the output", axes=("batch", "position", "channel"), reading=_reading,
       fixed=lambda: [module_case(config(0), 5, 0), module_case(config(1, 6, 3, 16, 48), 7, 1)],
       drawn=lambda g: [module_case(config(2, 2 * pick(g, (2, 3)), 2, 8), draw(g, 2, 12), draw(g, 0, 999))],
       mistakes=tuple((what, edited(written_out, edit)) for what, edit in (
           ("Queries see later keys: the causal mask is missing.", (".ones(s.shape[-2:]", ".zeros(s.shape[-2:]")),
           ("The scores are not scaled by 1 / sqrt(head_dim).", (" / q.shape[-1] ** 0.5", "")),
           ("The scores are divided by head_dim: the scale is 1 / sqrt(head_dim).", ("** 0.5", "** 1")),
           ("The scores are scaled by the width: the scale is 1 / sqrt(head_dim).",
            ("q.shape[-1] **", "x.shape[-1] **")),
           ("The softmax runs over the queries (dim -2): each query's weights over the keys sum to 1.",
            ("softmax(-1)", "softmax(-2)")),
           ("The heads are merged without moving them back (transpose(1, 2)), so positions and heads mix.",
            ("v).transpose(1, 2).", "v).")),
           ("Attention runs on (B, T, heads, D): SDPA wants (B, heads, T, D), or it attends across heads.",
            (".transpose(1, 2)", "")),
           ("q and k are not rotated (apply_rope).", ("q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)", "pass")))))


def block(self, x, cos, sin):
    """minimind_lib's MiniMindBlock.forward on the chapter's modules, SwiGLU from self.mlp's projections."""
    x = x + self.self_attn(self.input_layernorm(x), cos, sin)
    h = self.post_attention_layernorm(x)
    return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


ATTN = "x = x + self.self_attn(self.input_layernorm(x), cos, sin)"
region("Block.forward", "x plus attention of the first norm of x; that plus the SwiGLU of its second norm, "
       "down_proj(silu(gate_proj(h)) * up_proj(h)). The residual stream itself is never normalised.", block, tol=1e-4,
       method="forward", run=run_module, output="the block's output", axes=("batch", "position", "channel"),
       fixed=lambda: [module_case(config(0), 5, 3), module_case(config(1, 6, 3, 16, 48), 3, 4)],
       drawn=lambda g: [module_case(config(2), draw(g, 2, 9), draw(g, 0, 999))],
       mistakes=(("It normalises after each residual add (post-norm): MiniMind normalises each sub-layer's input.",
                  [(ATTN, "x = self.input_layernorm(x + self.self_attn(x, cos, sin))"), ("h = self.post_", "h = x  #"),
                   ("return x + self.mlp.down_proj(", "return self.post_attention_layernorm(x + self.mlp.down_proj("),
                   ("up_proj(h))\n", "up_proj(h)))\n")]),
                 ("It normalises the residual stream itself (x = norm(x) + attn(norm(x))): only sub-layers' inputs.",
                  [("x = x + self", "x = self.input_layernorm(x) + self"), ("return x + ", "return h + ")]),
                 ("The feed-forward is fed the block's input: it takes the norm of the sum after attention.",
                  [(ATTN, "x0, " + ATTN.replace("x = x", "x = x, x")), ("layernorm(x)\n", "layernorm(x0)\n")]),
                 ("It gates with gelu: SwiGLU gates with silu (x * sigmoid(x)).", ("F.silu(", "F.gelu(")),
                 ("silu is applied to up_proj's output: SwiGLU gates with gate_proj's.",
                  ("silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h)",
                   "silu(self.mlp.up_proj(h)) * self.mlp.gate_proj(h)"))))


def decoder(self, ids):
    """minimind_lib's MiniMindModel.forward (no masks or cache) on the chapter's blocks."""
    x, t = self.embed_tokens(ids), ids.shape[1]
    for layer in self.layers:
        x = layer(x, self.freqs_cos[:t], self.freqs_sin[:t])
    return self.norm(x)


def _ids(c, t, seed):
    ids = torch.randint(0, c.vocab_size, (2, t), generator=torch.Generator().manual_seed(seed))
    return Case(f"2 layers of width {c.hidden_size} on the ids {ids.tolist()}", c, seed, ids)


region("Decoder.forward", "embed; every layer with the first T rows of the cos and sin buffers; the final norm.",
       decoder, method="forward", output="the hidden states", axes=("batch", "position", "channel"), tol=1e-4,
       run=lambda cls, case: randomized(cls(case.args[0]), case.args[1])(case.args[2]),
       fixed=lambda: [_ids(config(0, layers=2), 6, 5)], drawn=lambda g: [_ids(config(1, layers=2), draw(g, 1, 20), 7)],
       mistakes=(("It leaves out the final norm (self.norm).", ("return self.norm(x)", "return x")),
                 ("It passes every row of the cos and sin buffers: the layers take the first T.",
                  ("self.freqs_cos[:t], self.freqs_sin[:t]", "self.freqs_cos, self.freqs_sin"))))

KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KIND = " of each kind (embed_tokens, q, k, v, o, gate, up, down)"
STD, MEAN, KURT = "the standard deviation" + KIND, "the mean" + KIND, "the kurtosis of all the weights"


def _initialised(fn, case):
    """A library model with PyTorch's defaults, after model.apply(fn) from a seeded generator: its statistics."""
    model = mm.MiniMindForCausalLM(case.args[0])
    for m in [*(m for m in model.modules() if isinstance(m, torch.nn.Linear)), model.model.embed_tokens]:
        m.reset_parameters()
    with torch.random.fork_rng():
        torch.manual_seed(case.args[1])
        model.apply(fn)
    kinds = [torch.cat([p.flatten() for n, p in model.named_parameters() if f".{kind}." in n]) for kind in KINDS]
    z = torch.cat(kinds)
    return {"whether lm_head.weight still is model.embed_tokens.weight": model.lm_head.weight is
            model.model.embed_tokens.weight, STD: torch.stack([w.std() for w in kinds]),
            MEAN: torch.stack([w.mean() for w in kinds]), KURT: ((z - z.mean()) / z.std()).pow(4).mean()[None],
            "the RMSNorm gains": torch.cat([p.flatten() for n, p in model.named_parameters() if "norm" in n]),
            "the RoPE table freqs_cos (a buffer)": model.model.freqs_cos}


region("init_weights", "an nn.Linear's or nn.Embedding's weight drawn in place from a normal distribution of mean 0 "
       "and standard deviation 0.02 (name the keyword arguments); any other module left alone.",
       mm.MiniMindForCausalLM._init_weights, run=_initialised, tol={STD: 0.003, MEAN: 0.003, KURT: 0.4},
       fixed=lambda: [Case("a model of 2 layers of width 64 (seed 0)", config(0, hidden=64, layers=2, vocab=300), 0)],
       drawn=lambda g: [Case("a model of 3 layers of width 64", config(1, hidden=64, layers=3, vocab=300),
                             draw(g, 0, 9999))],
       mistakes=(("Mean 0.02, standard deviation 1: normal_'s second positional argument is the mean.",
                  ("mean=0.0, std=0.02", "0.02")),
                 ("The standard deviation is the root of 0.02: 0.02 is the standard deviation, not the variance.",
                  ("std=0.02", "std=0.02 ** 0.5")),
                 ("The weights are uniform in [-0.02, 0.02], not normal.",
                  ("normal_(module.weight, mean=0.0, std=0.02)", "uniform_(module.weight, -0.02, 0.02)")),
                 ("It draws the RMSNorm gains too: they start at 1.",
                  ("isinstance(module, (nn.Linear, nn.Embedding))", "hasattr(module, 'weight')"))))
