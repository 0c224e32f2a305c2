"""MiniMind-3 compatibility: the dense preset's keys and size, q/k norm against a reference written from the spec,
YaRN RoPE scaling, MiniMind-3's chat layout (tools, tool turns, <think> blocks) and its t2t SFT lines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minimind_lib import corpus as C
from minimind_lib import data as D
from minimind_lib.model import (YARN_SCALING, MiniMindConfig, MiniMindForCausalLM, count_parameters,
                                precompute_freqs_cis)
from minimind_lib.tokenizer import Tokenizer, load_tokenizer

KEYS_3 = Path(__file__).resolve().parents[2] / "shared" / "minimind3_keys.json"
# MiniMind-3 dense's key names and shapes (shared/minimind3_keys.json, 91 keys), written out here so that the test does
# not depend on a file outside the repository: 3 top-level keys + 11 per layer x 8 layers.
_LAYER_SHAPES = {
    "self_attn.q_proj.weight": [768, 768], "self_attn.k_proj.weight": [384, 768], "self_attn.v_proj.weight": [384, 768],
    "self_attn.o_proj.weight": [768, 768], "self_attn.q_norm.weight": [96], "self_attn.k_norm.weight": [96],
    "input_layernorm.weight": [768], "post_attention_layernorm.weight": [768],
    "mlp.gate_proj.weight": [2432, 768], "mlp.down_proj.weight": [768, 2432], "mlp.up_proj.weight": [2432, 768],
}
MINIMIND3_SHAPES = {
    "model.embed_tokens.weight": [6400, 768], "model.norm.weight": [768], "lm_head.weight": [6400, 768],
    **{f"model.layers.{i}.{k}": v for i in range(8) for k, v in _LAYER_SHAPES.items()},
}


def shapes(model) -> dict:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ the preset
def test_minimind3_preset_has_its_size_and_exact_keys():
    model = MiniMindForCausalLM(MiniMindConfig.preset("minimind-3"))
    assert count_parameters(model)["total"] == 63_912_192
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (768, 8, 8, 4)
    assert (c.head_dim, c.intermediate_size, c.rms_norm_eps, c.qk_norm) == (96, 2432, 1e-6, True)
    assert len(MINIMIND3_SHAPES) == 91 and shapes(model) == MINIMIND3_SHAPES
    if KEYS_3.is_file():  # the key list read off MiniMind-3's own model code, where it is at hand
        assert shapes(model) == json.loads(KEYS_3.read_text())
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (96,)


def test_minimind2_presets_unchanged():
    model = MiniMindForCausalLM(MiniMindConfig.preset("minimind2-small"))
    assert count_parameters(model)["total"] == 25_829_888  # its keys are checked in test_model.py
    assert not any("q_norm" in k or "k_norm" in k for k in model.state_dict())
    assert model.config.head_dim == 64 and model.config.to_dict()["qk_norm"] is False


def test_configs_written_before_minimind3_still_load():
    new_fields = ("head_dim", "qk_norm", "inference_rope_scaling")
    old = {k: v for k, v in MiniMindConfig().to_dict().items() if k not in new_fields}
    c = MiniMindConfig.from_dict(old)  # a config.json of an earlier run: no MiniMind-3 fields
    assert (c.head_dim, c.qk_norm, c.inference_rope_scaling) == (64, False, False)
    mm3 = MiniMindConfig.preset("minimind-3")
    assert MiniMindConfig.from_dict(mm3.to_dict()) == mm3
    with pytest.raises(ValueError, match="not divisible by num_attention_heads=7; set head_dim explicitly"):
        MiniMindConfig(hidden_size=64, num_attention_heads=7, num_key_value_heads=7)
    assert MiniMindConfig(hidden_size=64, num_attention_heads=7, num_key_value_heads=7, head_dim=8).head_dim == 8


def test_strict_load_both_ways(tmp_path):
    """Our state dict has exactly MiniMind-3's keys (so it loads into its code), and one built from the key list alone
    (as MiniMind-3's code would save it) loads into ours with strict=True."""
    model = MiniMindForCausalLM(MiniMindConfig.preset("minimind-3"))
    spec = MINIMIND3_SHAPES
    g = torch.Generator().manual_seed(0)
    theirs = {k: torch.randn(s, generator=g) for k, s in spec.items()}
    theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]  # tied, as MiniMind saves it
    model.load_state_dict(theirs, strict=True)
    assert torch.equal(model.model.layers[3].self_attn.k_norm.weight, theirs["model.layers.3.self_attn.k_norm.weight"])
    assert set(model.state_dict()) == set(spec)
    fresh = MiniMindForCausalLM(MiniMindConfig.preset("minimind-3"))
    fresh.load_state_dict(model.state_dict(), strict=True)
    with pytest.raises(RuntimeError, match="q_norm"):  # a MiniMind2-style model refuses MiniMind-3 weights
        MiniMindForCausalLM(MiniMindConfig.preset("minimind-3", qk_norm=False)).load_state_dict(theirs, strict=True)


# ------------------------------------------------------------------ a reference forward, from the spec
def dense_ffn(h: torch.Tensor, p) -> torch.Tensor:
    """SwiGLU of the layer whose weights p(name) gives."""
    return (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T


def reference_logits(sd: dict, c: MiniMindConfig, ids: torch.Tensor, ffn=dense_ffn) -> torch.Tensor:
    """MiniMind-3's forward written from its description, with other means than the library: RoPE by complex
    multiplication of the pairs (x[i], x[i + d/2]), GQA by repeat_interleave, attention by an explicit masked
    softmax. ffn(h, p) is the feed-forward of the normalised (b, t, C) input (tests/test_moe.py passes MoE's)."""
    def rms(x, w, eps):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    b, t = ids.shape
    d, hq, hk = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inv = c.rope_theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    rot = torch.polar(torch.ones(t, d // 2, dtype=torch.float64), torch.arange(t, dtype=torch.float64)[:, None] * inv)

    def rope(x):  # (b, t, h, d): pair i is (x[..., i], x[..., i + d/2])
        z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * rot[None, :, None, :]
        return torch.cat([z.real, z.imag], dim=-1).float()

    x = sd["model.embed_tokens.weight"][ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(c.num_hidden_layers):
        p = lambda name: sd[f"model.layers.{i}.{name}.weight"]
        h = rms(x, p("input_layernorm"), c.rms_norm_eps)
        q = (h @ p("self_attn.q_proj").T).view(b, t, hq, d)
        k = (h @ p("self_attn.k_proj").T).view(b, t, hk, d)
        v = (h @ p("self_attn.v_proj").T).view(b, t, hk, d)
        q, k = rope(rms(q, p("self_attn.q_norm"), c.rms_norm_eps)), rope(rms(k, p("self_attn.k_norm"), c.rms_norm_eps))
        k, v = k.repeat_interleave(hq // hk, dim=2), v.repeat_interleave(hq // hk, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, hq * d)
        x = x + y @ p("self_attn.o_proj").T
        h = rms(x, p("post_attention_layernorm"), c.rms_norm_eps)
        x = x + ffn(h, p)
    return rms(x, sd["model.norm.weight"], c.rms_norm_eps) @ sd["model.embed_tokens.weight"].T


def test_tiny_qk_norm_logits_equal_the_reference():
    # head_dim set apart from hidden/heads (48 * 4 = 192 != 64), as MiniMind-3's config allows
    c = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=97, head_dim=48, qk_norm=True, rms_norm_eps=1e-6, max_position_embeddings=64)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(c).eval()
    with torch.no_grad():  # non-trivial norm gains, so a swapped q_norm / k_norm would show
        for name, w in model.named_parameters():
            if "norm" in name:
                w.uniform_(0.5, 1.5)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ours = model(ids).logits
        ref = reference_logits({k: v.float() for k, v in model.state_dict().items()}, c, ids)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-4), (ours - ref).abs().max()
    with torch.no_grad():  # and the q/k norm matters: without its gains the logits differ
        model.model.layers[0].self_attn.q_norm.weight.fill_(1.0)
        assert not torch.allclose(model(ids).logits, ref, atol=1e-3)


# ------------------------------------------------------------------ YaRN
def test_yarn_is_off_by_default_and_changes_nothing_when_off():
    c = MiniMindConfig.preset("minimind-3")
    assert c.inference_rope_scaling is False
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke", qk_norm=True))
    cos, sin = precompute_freqs_cis(model.config.head_dim, model.config.max_position_embeddings, 1e6)
    assert torch.equal(model.model.freqs_cos, cos) and torch.equal(model.model.freqs_sin, sin)
    # on, but within the trained length (2048): YaRN leaves the tables alone, as MiniMind-3 does
    short = precompute_freqs_cis(96, 2048, 1e6, YARN_SCALING)
    assert torch.equal(short[0], precompute_freqs_cis(96, 2048, 1e6)[0])


def test_yarn_frequencies():
    d, theta, trained, factor = 96, 1e6, 2048, 16
    cos, sin = precompute_freqs_cis(d, 32768, theta, YARN_SCALING)
    plain = precompute_freqs_cis(d, 32768, theta)
    assert not torch.equal(cos, plain[0])
    # the frequency of pair i is the angle at position 1 (exact in float64 terms up to float32 rounding)
    got = torch.atan2(sin[1, : d // 2].double(), cos[1, : d // 2].double())
    base = theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    turns = trained * base / (2 * math.pi)  # rotations of pair i within the trained length
    fast, slow = turns > 32, turns < 1  # beta_fast = 32, beta_slow = 1
    assert fast.any() and slow.any()
    assert torch.allclose(got[fast], base[fast], rtol=1e-5)  # fast pairs keep their speed
    assert torch.allclose(got[slow], base[slow] / factor, rtol=1e-4)  # slow pairs are interpolated 16x
    ratio = got / base
    assert ((ratio >= 1 / factor - 1e-6) & (ratio <= 1 + 1e-6)).all()
    assert (ratio[1:] <= ratio[:-1] + 1e-6).all()  # the ramp only slows down, pair by pair
    assert torch.allclose(cos ** 2 + sin ** 2, torch.ones_like(cos), atol=1e-5)  # attention_factor 1.0
    long = MiniMindForCausalLM(MiniMindConfig.preset("smoke", inference_rope_scaling=True,
                                                     max_position_embeddings=4096))
    assert torch.equal(long.model.freqs_cos, precompute_freqs_cis(16, 4096, 1e6, YARN_SCALING)[0])


# ------------------------------------------------------------------ chat layout and t2t data
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                          "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                         "b": {"type": "integer"}}}}}]
TOOL_CONV = [
    {"role": "system", "content": "You can use tools.", "tools": TOOLS},
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 17, "b": 25}}]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "17 + 25 = 42.", "reasoning_content": "The tool returned 42."},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def minimind3_tokenizer(tok, tmp_path) -> Tokenizer:
    """A tokenizer directory in MiniMind-3's layout: think/tool markers as added special tokens, a <think> template."""
    hf = type(tok.hf).from_str(tok.hf.to_str())
    from tokenizers import AddedToken
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    hf.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    config = dict(tok.config, chat_template="{# a MiniMind-3 template: <think> ... </think> #}")
    config["added_tokens_decoder"] = {str(hf.token_to_id(m)): {"content": m, "special": True}
                                      for m in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *markers]}
    return Tokenizer.load(Tokenizer(hf, config).save(tmp_path / "minimind3_tokenizer"))


def test_tool_conversation_renders_minimind3_layout(tok, tmp_path):
    tok3 = minimind3_tokenizer(tok, tmp_path)
    assert tok3.think and not tok.think
    msgs = [{k: v for k, v in m.items() if k != "tools"} for m in TOOL_CONV]
    text = tok3.apply_chat_template(msgs, tools=TOOLS)
    tools_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nYou can use tools.\n\n# Tools\n\n")
    assert f"<tools>\n{tools_json}\n</tools>" in text and text.count("<|im_start|>system") == 1
    assert ('<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n'
            '{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nThe tool returned 42.\n</think>\n\n17 + 25 = 42.<|im_end|>\n")
    ids = tok3.apply_chat_template(msgs, tools=TOOLS, tokenize=True)
    assert tok3.decode(ids) == text  # the ids spell the text
    assert ids.count(tok3.token_to_id("<think>")) == 2  # markers are single special ids ...
    typed = tok3.apply_chat_template([{"role": "user", "content": "<think>"}], tokenize=True)
    assert tok3.token_to_id("<think>") not in typed  # ... but a typed marker in content stays text
    assert tok3.apply_chat_template(msgs[:2], add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    inline = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nstep\n</think>\n\nA."}]
    assert tok3.apply_chat_template(inline).endswith("<|im_start|>assistant\n<think>\nstep\n</think>\n\nA.<|im_end|>\n")
    # the course's tokenizer keeps plain ChatML for plain turns: no <think> block unless reasoning is given
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"


def test_tool_role_sft_line_trains_with_its_mask(tok, tmp_path):
    path = tmp_path / "sft_t2t_mini.jsonl"
    path.write_text(json.dumps({"conversations": TOOL_CONV}, ensure_ascii=False) + "\n", encoding="utf-8")
    ds = D.SFTDataset(path, tok, seq_len=512)
    sample = ds[0]
    ids, labels = sample["input_ids"], sample["labels"]
    trained = tok.decode(ids[labels != D.IGNORE_INDEX].tolist())
    # exactly the two assistant turns, each up to its "<|im_end|>\n" (MiniMind-3's trained tokens): the tool call, then
    # thought and answer
    assert trained == ('<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>\n'
                       "<think>\nThe tool returned 42.\n</think>\n\n17 + 25 = 42.<|im_end|>\n")
    assert "<tool_response>" in tok.decode(ids.tolist()) and "42\n</tool_response>" not in trained
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = D.pad_collate([sample])
    losses = []
    for _ in range(8):
        loss = model(batch["input_ids"], labels=batch["labels"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[0]) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("turns, match", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": {"name": "f"}}],
     r"conversations\[1\]\['tool_calls'\] must be a list"),
    ([{"role": "user", "content": "q", "tool_calls": []}, {"role": "assistant", "content": "a"}],
     r"conversations\[0\]\['tool_calls'\] is only allowed on an assistant turn, not on a 'user' turn"),
    ([{"role": "user", "content": "q", "tool_calls": '[{"name": "f", "arguments": {}}]'},
      {"role": "assistant", "content": "a"}],
     r"conversations\[0\]\['tool_calls'\] is only allowed on an assistant turn, not on a 'user' turn"),
    ([{"role": "user", "content": "q", "reasoning_content": "r"}, {"role": "assistant", "content": "a"}],
     r"conversations\[0\]\['reasoning_content'\] is only allowed on an assistant turn, not on a 'user' turn"),
    ([{"role": "user", "content": "q", "tools": TOOLS}, {"role": "assistant", "content": "a"}],
     r"conversations\[0\]\['tools'\] is only allowed on the first turn, a system turn"),
    ([{"role": "system", "content": "s", "tools": [{"name": "add"}]}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}],
     r"conversations\[0\]\['tools'\]\[0\] must be \{'type': 'function', 'function': \{'name': str, \.\.\.\}\}"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": '[{"name": "f", "arg'}],
     r"conversations\[1\]\['tool_calls'\] is not valid JSON \(Unterminated string"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{'a': 1}"}]},
      {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}],
     r"conversations\[1\]\['tool_calls'\]\[0\]\['arguments'\] is not valid JSON"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]},
      {"role": "assistant", "content": "a"}],
     r"conversations\[2\]: each tool call gets its own 'tool' turn .* 1 call\(s\) unanswered before this 'assistant'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}],
     r"conversations ends with 1 tool call\(s\) that no 'tool' turn answers"),
    ([{"role": "tool", "content": "42"}, {"role": "assistant", "content": "a"}],
     r"conversations\[0\]: each tool call gets its own 'tool' turn .* 0 call\(s\) unanswered before this 'tool' turn"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "42"},
      {"role": "assistant", "content": "b"}],
     r"conversations\[2\]: each tool call gets its own 'tool' turn"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
     r"conversations\[1\]\['tool_calls'\]\[0\] must be \{'name': str, 'arguments'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 3}],
     r"conversations\[1\]\['reasoning_content'\] must be a string"),
    ([{"role": "system", "content": "s", "tools": "not json"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}], r"conversations\[0\]\['tools'\] is not valid JSON"),
    ([{"role": "system", "content": "s", "tools": '{"type": "function"}'}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}], r"conversations\[0\]\['tools'\] must be a list \(or its JSON text\)"),
    ([{"role": "function", "content": "42"}, {"role": "assistant", "content": "a"}],
     r"conversations\[0\]\['role'\] = 'function' is not one of"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
     r"conversations\[1\]\['content'\] is empty"),
])
def test_bad_t2t_lines_name_file_and_line(tok, tmp_path, turns, match):
    path = tmp_path / "sft_t2t.jsonl"
    good = {"conversations": TOOL_CONV}
    path.write_text("\n".join(json.dumps(r) for r in (good, good, {"conversations": turns})) + "\n", encoding="utf-8")
    with pytest.raises(C.DataFormatError, match=r"sft_t2t\.jsonl:3: " + match):
        D.SFTDataset(path, tok, seq_len=256)


def test_tools_and_tool_calls_given_as_json_text_are_read(tok, tmp_path):
    """MiniMind-3's files hold tools and tool_calls as JSON text: the same sample as with lists, ids and mask."""
    as_text = [dict(t, **{k: json.dumps(t[k], ensure_ascii=False) for k in ("tools", "tool_calls") if k in t})
               for t in TOOL_CONV]
    assert isinstance(as_text[0]["tools"], str) and isinstance(as_text[2]["tool_calls"], str)
    assert C.tools_of(as_text) == TOOLS
    for got, want in zip(C.encode_sft(tok, as_text), C.encode_sft(tok, TOOL_CONV)):
        assert got.tolist() == want.tolist()
    path = tmp_path / "both.jsonl"  # both forms in one file, read by the dataset
    path.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in (TOOL_CONV, as_text)), encoding="utf-8")
    ds = D.SFTDataset(path, tok, seq_len=512)
    assert ds[0]["input_ids"].tolist() == ds[1]["input_ids"].tolist()
    assert ds[0]["labels"].tolist() == ds[1]["labels"].tolist()
    # an OpenAI-style call turn (content None) and MiniMind-3's "" for "no tools / no calls" are read too
    openai = [dict(t, content=None) if t.get("tool_calls") else t for t in TOOL_CONV]
    assert C.encode_sft(tok, openai)[0].tolist() == C.encode_sft(tok, TOOL_CONV)[0].tolist()
    C.validate_record({"conversations": openai}, "sft")
    plain = [{"role": "system", "content": "s", "tools": ""}, {"role": "user", "content": "q", "tool_calls": ""},
             {"role": "assistant", "content": "a", "tool_calls": ""}]
    C.validate_record({"conversations": plain}, "sft")
    assert tok.decode(C.encode_sft(tok, plain)[0].tolist()).startswith("<|im_start|>system\ns<|im_end|>")


def test_a_later_system_turn_is_read_as_minimind3_renders_it(tok):
    conv = [{"role": "user", "content": "q"}, {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "a"}]
    C.validate_record({"conversations": conv}, "sft")
    ids, mask = C.encode_sft(tok, conv)
    assert tok.decode(ids.tolist()) == ("<|im_start|>user\nq<|im_end|>\n<|im_start|>system\nbe brief<|im_end|>\n"
                                        "<|im_start|>assistant\na<|im_end|>\n")
    assert tok.decode(ids[mask == 1].tolist()) == "a<|im_end|>\n"


# ------------------------------------------------------------------ the bundled t2t examples
DATA = Path(__file__).resolve().parents[1] / "data"


def test_bundled_t2t_files_are_what_the_builder_writes(tmp_path):
    from test_data_files import bc  # data/build_corpus.py, loaded once
    bc.main(["--t2t-only", "--out-dir", str(tmp_path)])
    for name in ("pretrain_t2t_mini.jsonl", "sft_t2t_mini.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} differs from build_corpus.py's"


def test_bundled_sft_t2t_file_is_in_minimind3_format():
    """tools and tool_calls are JSON text (MiniMind-3's dataset declares both as strings and json.loads them)."""
    records = [json.loads(line) for line in (DATA / "sft_t2t_mini.jsonl").read_text(encoding="utf-8").splitlines()]
    fields = [(k, t[k]) for r in records for t in r["conversations"] for k in ("tools", "tool_calls") if k in t]
    assert {k for k, _ in fields} == {"tools", "tool_calls"} and len(fields) == 40  # 20 tool conversations
    assert all(isinstance(v, str) and isinstance(json.loads(v), list) for _, v in fields)
    assert {k for r in records for t in r["conversations"] for k in t} <= {"role", "content", "reasoning_content",
                                                                           "tools", "tool_calls"}


def test_bundled_t2t_files_read_and_train_only_assistant_turns(tok):
    pre = D.PretrainDataset(DATA / "pretrain_t2t_mini.jsonl", tok, seq_len=256)
    assert len(pre) == 40 and pre.stats.n_skipped == 0
    records = [json.loads(line) for line in (DATA / "sft_t2t_mini.jsonl").read_text(encoding="utf-8").splitlines()]
    kinds = [("tool" if any(t["role"] == "tool" for t in r["conversations"]) else
              "think" if "reasoning_content" in r["conversations"][-1] else "plain") for r in records]
    assert {k: kinds.count(k) for k in set(kinds)} == {"tool": 20, "think": 20, "plain": 20}
    ds = D.SFTDataset(DATA / "sft_t2t_mini.jsonl", tok, seq_len=1024)
    assert ds.stats.n_truncated == 0 and ds.stats.n_no_target == 0
    for i, record in enumerate(records):
        sample = ds[i]
        trained = tok.decode(sample["input_ids"][sample["labels"] != D.IGNORE_INDEX].tolist())
        final = record["conversations"][-1]["content"]
        assert trained.endswith(final + "<|im_end|>\n")  # the answer is trained, up to its "<|im_end|>\n" ...
        assert record["conversations"][-2]["content"] not in trained  # ... the question or tool result is not
        for turn in record["conversations"]:  # every number in an answer is right (the files hold computed answers)
            if turn["role"] == "assistant" and turn["content"]:
                a, sign, b, _, c = turn["content"].rstrip(".。").split()
                assert int(c) == (int(a) + int(b) if sign == "+" else int(a) * int(b))


def test_memory_estimate_covers_qk_norm_and_head_dim():
    from minimind_lib.memory import estimate_memory, measure_step_memory
    c = MiniMindConfig.preset("smoke", qk_norm=True, head_dim=24, num_key_value_heads=4, max_position_embeddings=256)
    for amp in ("off", "bf16"):
        est, got = estimate_memory(c, 2, 64, amp=amp), measure_step_memory(c, 2, 64, amp=amp)
        assert est["n_params"] == got["n_params"] == count_parameters(MiniMindForCausalLM(c))["total"]
        assert abs(est["peak_bytes"] / got["peak_bytes"] - 1) < 0.05, (amp, est["peak_bytes"], got["peak_bytes"])


def test_caches_with_the_old_masks_are_rebuilt(tok, tmp_path):
    """A memmap tokenized before the newline after <|im_end|> was trained (format 1) is stale, never reused."""
    src = DATA / "sft_t2t_mini.jsonl"
    info = C.tokenize_to_memmap(src, tok, tmp_path / "sft", kind="sft", num_workers=0, progress=False)
    meta_path = Path(info.prefix + ".json")
    meta_path.write_text(json.dumps(dict(json.loads(meta_path.read_text()), version=1)))
    assert not C.memmap_is_fresh(info.prefix, src, tok, kind="sft")[0]
    with pytest.raises(ValueError, match="not a minimind memmap of version 2; rebuild it"):
        D.SFTDataset(info.prefix, tok, 1024)
    again = C.tokenize_to_memmap(src, tok, tmp_path / "sft", kind="sft", num_workers=0, progress=False)
    assert not again.reused and D.SFTDataset(again.prefix, tok, 1024).stats.n_trained_tokens == \
        D.SFTDataset(src, tok, 1024).stats.n_trained_tokens
