"""03_model's regions, against minimind_lib.model: RMSNorm, RoPE, GQA, attention, block, decoder."""
import torch
import torch.nn.functional as F
from minimind_lib import model as mm
from . import Case, draw, edited, pick, randomized, region

def norm_rows(d, dtype):  # rows of RMS 10^(k - 4), k = 0..5 (eps matters, then not), a zero row
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(d))
    x = x * torch.logspace(-4, 2, 7)[:, None]
    return Case(f"{str(dtype)[6:]} rows of RMS 10^(k - 4) for row k = 0..5 and an all-zero row 6, "
                f"width {d}", d, x.index_fill(0, torch.tensor([6]), 0).to(dtype),
                tol=(1e-6, 1e-2, 0.01) if d > 16 else None)
region("RMSNorm.forward", "the root of the mean square over the last axis, in float32; the gain.",
       mm.RMSNorm.forward, method="forward", axes=("row", "channel"), output="the output",
       fixed=lambda: [norm_rows(16, torch.float32), norm_rows(512, torch.bfloat16)],
       drawn=lambda g: [Case("random rows of width 48", 48, torch.randn(5, 48, generator=g))],
       run=lambda cls, c: randomized(cls(c.args[0], 1e-5), c.args[0])(c.args[1]),
       mistakes=(("It leaves eps out: a zero row gives nan.", " + self.eps", ""),
                 ("It adds eps to the root: add it to the mean square.",
                  [("torch.rsqrt(", "1 / (("), (" + self.eps)", ").sqrt() + self.eps)")]),
                 ("It computes in x's dtype: use x.float().", "x.float()", "x"),
                 ("It does not cast back to x's dtype before the float32 gain.", ".type_as(x)", ""),
                 ("It multiplies by the gain before casting back, giving bfloat16: cast first.",
                  "self.weight * (xf * ", "(self.weight * xf * ")))
region("rope_tables", "pair i turns at theta^(-2i/head_dim); the second half repeats the first.",
       mm.precompute_freqs_cis, tol=1e-4, output="(cos, sin)", fixed=[(8, 6, 1e4), (16, 40, 1e6)],
       axes=("table (0: cos, 1: sin)", "position", "column"),
       drawn=lambda g: [(pick(g, (8, 64)), draw(g, 2, 200), pick(g, (1e4, 1e6)))])
def qk(t, h, kv, g):  # q, k and the tables' first t rows
    return (torch.randn(2, t, h, 8, generator=g), torch.randn(2, t, kv, 8, generator=g),
            *mm.precompute_freqs_cis(8, t, 1e4))
def turned(what, turn):  # apply_rope with another rotate_half
    return what, edited(mm.apply_rotary_pos_emb, ("rotate_half(", "turn("), turn=turn)
region("apply_rope", "x * cos + rotate_half(x) * sin; rotate_half makes (-x2, x1); a heads axis.",
       mm.apply_rotary_pos_emb, output="the rotated (q, k)", drawn=lambda g: [qk(9, 6, 3, g)],
       fixed=lambda: [qk(t, h, 2, torch.Generator().manual_seed(t)) for t, h in ((3, 4), (2, 2))],
       axes=("tensor (0 is q, 1 is k)", "batch", "position", "head", "dim"),
       mistakes=(turned("The minus sign is on the wrong half: (x1, x2) turns into (-x2, x1).",
                        lambda x: torch.cat([x.chunk(2, -1)[1], -x.chunk(2, -1)[0]], -1)),
                 turned("It pairs neighbours (2i, 2i+1), GPT-J's way: pair i with i + head_dim/2.",
                        lambda x: torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2))))
region("repeat_kv", "a new axis after the kv heads, expanded n_rep times, then merged.",
       mm.repeat_kv, tol=0.0, axes=("batch", "position", "head", "dim"),
       fixed=lambda: [(torch.randn(s, generator=torch.Generator()), n)
                      for s, n in (((1, 2, 2, 4), 3), ((2, 3, 3, 4), 1))],
       drawn=lambda g: [(torch.randn(2, 4, 3, 8, generator=g), 2)],
       mistakes=(("Query head h reads kv head h % n_kv (x.repeat tiles): it reads h // n_rep.",
                  lambda x, n: x.repeat(1, 1, n, 1)),))
def attention(self, x, cos, sin):  # the library's, no mask or cache, SDPA written out
    q, k, v = self.heads(x)
    q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = mm.repeat_kv(k, self.n_rep), mm.repeat_kv(v, self.n_rep)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape[:2], -1))
def config(seed, heads=4, kv=2, head_dim=8, hidden=32, layers=1, vocab=97):
    return mm.MiniMindConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=head_dim, intermediate_size=40 + 8 * (seed % 3),
                             vocab_size=vocab, num_hidden_layers=layers,
                             max_position_embeddings=64, rope_theta=1e4)
def module_case(c, t, seed, ids=False):  # x (2, t, width), or ids (2, t) for a decoder
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(c.vocab_size, (2, t), generator=g) if ids else torch.randn(
        2, t, c.hidden_size, generator=g)
    return Case(f"{c.num_attention_heads} query heads, {c.num_key_value_heads} kv heads of "
                f"{c.head_dim}, width {c.hidden_size}, {c.num_hidden_layers} layer(s), on "
                f"{x.tolist() if ids else f'2 random sequences of T={t}'} (seed {seed})", c, seed,
                x)
def run_module(cls, case):
    c, seed, x = case.args
    tables = () if x.dtype == torch.long else mm.precompute_freqs_cis(c.head_dim, x.shape[1], 1e4)
    return randomized(cls(c), seed)(x, *tables)
MODULE = {"method": "forward", "run": run_module, "tol": 1e-4, "axes": ("batch", "position", "dim")}
region("Attention.forward", "heads; rope on q, k; repeat_kv; (B, heads, T, D) into causal SDPA.",
       attention, output="the output", **MODULE, reading=lambda case, at: (
           "Position 0 sees only itself and differs: not the mask; look at the scale, softmax's "
           "axis, heads' layout." if at[1] == 0 else f"Position 0 agrees: see what {at[1]} sees."),
       fixed=lambda: [module_case(config(0), 5, 0), module_case(config(1, 6, 3, 16, 48), 7, 1)],
       drawn=lambda g: [module_case(config(2, pick(g, (4, 6))), draw(g, 2, 12), draw(g, 0, 999))],
       mistakes=(("Queries see later keys: the causal mask is missing.", ".ones(", ".zeros("),
                 ("The scores are not scaled by 1 / sqrt(head_dim).", " / q.shape[-1] ** 0.5", ""),
                 ("The softmax runs over the queries (dim -2), not the keys.", "(-1) @", "(-2) @"),
                 ("The heads are merged without moving them back.", "v).transpose(1, 2).", "v)."),
                 ("Attention runs on (B, T, heads, D), so it attends across heads: transpose.",
                  ".transpose(1, 2)", "")))
def block(self, x, cos, sin):  # the library's MiniMindBlock.forward, SwiGLU from self.mlp
    x = x + self.self_attn(self.input_layernorm(x), cos, sin)
    h = self.post_attention_layernorm(x)
    return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))
def post_norm(self, x, cos, sin):
    x = self.input_layernorm(x + self.self_attn(x, cos, sin))
    ffn = self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))
    return self.post_attention_layernorm(x + ffn)
region("Block.forward", "x + attention(norm(x)); then that + SwiGLU(norm(that)); pre-norm.", block,
       output="the block's output", **MODULE,
       fixed=lambda: [module_case(config(0), 5, 3), module_case(config(1, 6, 3, 16, 48), 3, 4)],
       drawn=lambda g: [module_case(config(2), draw(g, 2, 9), draw(g, 0, 999))],
       mistakes=(("It normalises after each residual add (post-norm), not each input.", post_norm),
                 ("It gates with gelu: SwiGLU gates with silu.", "F.silu(", "F.gelu("),
                 ("silu is applied to up_proj's output: SwiGLU gates gate_proj's.",
                  "silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h)",
                  "silu(self.mlp.up_proj(h)) * self.mlp.gate_proj(h)")))
def decoder(self, ids):  # the library's MiniMindModel.forward, no masks or cache
    x, t = self.embed_tokens(ids), ids.shape[1]
    for layer in self.layers:
        x = layer(x, self.freqs_cos[:t], self.freqs_sin[:t])
    return self.norm(x)
region("Decoder.forward", "embed; each layer with the first T rows of the tables; the final norm.",
       decoder, output="the hidden states", **MODULE,
       fixed=lambda: [module_case(config(0, layers=2), 6, 5, True)],
       drawn=lambda g: [module_case(config(1, layers=2), draw(g, 1, 20), 7, True)],
       mistakes=(("It leaves out the final norm (self.norm).", "return self.norm(x)", "return x"),))
KINDS = "embed_tokens q_proj k_proj v_proj o_proj gate_proj up_proj down_proj".split()
STD, MEAN = (f"the {s} of each kind ({', '.join(KINDS)})" for s in ("std", "mean"))
def initialised(fn, case):  # stats of a default-initialised model after apply(fn)
    model = mm.MiniMindForCausalLM(case.args[0])
    for m in model.modules():
        getattr(m, "reset_parameters", lambda: None)()  # PyTorch's defaults; the norm gains 1
    with torch.random.fork_rng():
        torch.manual_seed(case.args[1])
        model.apply(fn)
    w = [torch.cat([p.flatten() for n, p in model.named_parameters() if f".{k}." in n])
         for k in KINDS]
    z = (torch.cat(w) - torch.cat(w).mean()) / torch.cat(w).std()
    return {"the kurtosis": z.pow(4).mean()[None],
            "whether lm_head.weight is model.embed_tokens.weight": model.lm_head.weight is
            model.model.embed_tokens.weight, STD: torch.stack([v.std() for v in w]),
            MEAN: torch.stack([v.mean() for v in w]), "the buffers": list(model.buffers()),
            "the RMSNorm gains": [p for n, p in model.named_parameters() if "norm" in n]}
region("init_weights", "a Linear's or Embedding's weight drawn in place from N(0, 0.02); no other.",
       mm.MiniMindForCausalLM._init_weights, run=initialised,
       tol={STD: 0.003, MEAN: 0.003, "the kurtosis": 0.4},
       fixed=[Case("a model of 2 layers of width 64 (seed 0)", config(0, 4, 2, 8, 64, 2, 300), 0)],
       drawn=lambda g: [Case("a model of 3 layers of width 64", config(1, 4, 2, 8, 64, 3, 300),
                             draw(g, 0, 9999))],
       mistakes=(("Mean 0.02, standard deviation 1: normal_'s second positional argument is the "
                  "mean.", "mean=0.0, std=0.02", "0.02"),
                 ("It draws the RMSNorm gains too: they start at 1.",
                  "isinstance(module, (nn.Linear, nn.Embedding))", "hasattr(module, 'weight')")))
