"""The export to the transformers format and back (notebook 08's last section): tiny models, local files only.

The exported directory loads with AutoModelForCausalLM / AutoTokenizer without trust_remote_code and computes what
the course's model computes (logits, greedy tokens, token ids, chat strings); export -> import gives back the same
bytes of model.pth; every input the course cannot express is refused, naming the field, before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # everything below loads from local directories; nothing may be downloaded
transformers = pytest.importorskip("transformers")

from minimind_lib import cli  # noqa: E402
from minimind_lib.checkpoint import RUN_FORMAT, RUN_VERSION, load_run, start_run_dir  # noqa: E402
from minimind_lib.corpus import tokenizer_fingerprint  # noqa: E402
from minimind_lib.export import export_run, import_hf  # noqa: E402
from minimind_lib.generate import generate_ids  # noqa: E402
from minimind_lib.checkpoint import save_checkpoint  # noqa: E402
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from minimind_lib.tokenizer import load_tokenizer  # noqa: E402

torch.set_num_threads(1)

# MiniMind2-small's shape at a tiny size (GQA 4:2, head_dim = hidden / heads, eps 1e-5, no q/k norm), MiniMind-3's
# (q/k norm, head_dim apart from hidden / heads, eps 1e-6, YaRN to 32768 positions) and MiniMind-3-MoE's (4 experts of
# their own width, 2 per token, the chosen scores rescaled to sum to 1).
CONFIGS = {
    "minimind2-shaped": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2048),
    "qk-norm": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                    intermediate_size=160, rms_norm_eps=1e-6, qk_norm=True, inference_rope_scaling=True,
                    max_position_embeddings=32768),
    "moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                rms_norm_eps=1e-6, qk_norm=True, use_moe=True, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=96, max_position_embeddings=2048),
}
ARCH = {"minimind2-shaped": "LlamaForCausalLM", "qk-norm": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you today?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "你好，你是谁？"}],
    [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the 🐍 cross?"},
     {"role": "user", "content": "  and another,\nplease  "}],
]
TOOL_CONVERSATION = (  # tools, a tool call in OpenAI's nesting, a tool turn, reasoning: MiniMind-3's layout
    [{"role": "system", "content": "You can add."}, {"role": "user", "content": "17+25?"},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
         "name": "add", "arguments": '{"a": 17, "b": 25}'}}]}, {"role": "tool", "content": "42"},
     {"role": "assistant", "content": "42.", "reasoning_content": "The tool said 42."}],
    [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}])


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def make_run(path: Path, tok, seed: int = 0, **config) -> Path:
    """A finished run directory (config.json, model.pth, tokenizer/) with random weights, norms included."""
    torch.manual_seed(seed)
    mcfg = MiniMindConfig(**config)
    model = MiniMindForCausalLM(mcfg)
    with torch.no_grad():  # norm gains of 1 would hide a norm applied in the wrong place
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # a router far from uniform: the experts' weights differ
                p.mul_(30)
    start_run_dir(path, {"format": RUN_FORMAT, "version": RUN_VERSION, "stage": "pretrain", "model_preset": None,
                         "model": mcfg.to_dict(), "train": {},
                         "tokenizer": {"fingerprint": tokenizer_fingerprint(tok), "vocab_size": tok.vocab_size}},
                  tok, resume=False)
    save_checkpoint(model, path / "model.pth")
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tok, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    run = make_run(base / "run", tok, **CONFIGS[request.param])
    return request.param, run, export_run(run, base / "hf")


def load_hf(out: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)


def test_exported_directory_loads_as_the_standard_class(exported):
    name, _, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCH[name]] and config["tie_word_embeddings"] is True
    assert "auto_map" not in config  # no custom code: trust_remote_code is never needed
    model, _ = load_hf(out)
    assert type(model).__name__ == ARCH[name]


def test_exported_logits_equal_ours(exported):
    name, run, out = exported
    ours, _, _ = load_run(run)
    theirs, _ = load_hf(out)
    ids = torch.randint(3, 6400, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    err = (a - b).abs().max().item()
    print(f"{name}: max abs logit error {err:.3g} (logits up to {a.abs().max().item():.3g})")
    assert a.shape == b.shape and err < 1e-4


def test_greedy_generation_gives_the_same_tokens(exported, tok):
    _, run, out = exported
    ours, _, _ = load_run(run)
    theirs, _ = load_hf(out)
    prompt = tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=True)
    a = generate_ids(ours, torch.tensor(prompt), max_new_tokens=24, temperature=0.0,
                     stop_token_ids=[tok.eos_token_id])[0].tolist()
    b = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        do_sample=False, max_new_tokens=24)[0, len(prompt):].tolist()
    assert a == b and len(a) > 0


def test_tokenizer_gives_the_same_ids_and_chat_strings(exported, tok):
    _, _, out = exported
    _, hf_tok = load_hf(out)
    for text in ["Hello world", "你好，世界！", "  spaces\tand\nnewlines  ", "emoji 🐍 and <|im_end|> typed"]:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
    for messages, tools in [*((m, None) for m in CONVERSATIONS), TOOL_CONVERSATION]:
        for gen in (False, True):
            text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, tools=tools)
            assert text == tok.apply_chat_template(messages, add_generation_prompt=gen, tools=tools)
            ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, tools=tools)
            assert ids["input_ids"] == tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True,
                                                               tools=tools)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                               tok.pad_token_id)


def test_export_then_import_gives_back_the_same_model_pth(exported, tmp_path):
    _, run, out = exported
    back = import_hf(out, tmp_path / "back")
    assert (back / "model.pth").read_bytes() == (run / "model.pth").read_bytes()
    assert json.loads((back / "config.json").read_text())["model"] == json.loads((run / "config.json").read_text())["model"]
    assert (back / "tokenizer" / "tokenizer.json").read_bytes() == (run / "tokenizer" / "tokenizer.json").read_bytes()


def test_import_reads_a_config_in_transformers_4_layout(exported, tmp_path):
    """transformers 4 wrote rope_theta and rope_scaling at the top, num_experts by that name, head_dim only if set."""
    _, run, out = exported
    config = json.loads((out / "config.json").read_text())
    rope = config["rope_parameters"]
    v4 = {"rope_parameters": DROP, "rope_theta": rope["rope_theta"],
          "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}}
    if config["head_dim"] == config["hidden_size"] // config["num_attention_heads"]:
        v4["head_dim"] = DROP
    if "num_local_experts" in config:
        v4.update(num_local_experts=DROP, num_experts=config["num_local_experts"])
    back = import_hf(copy_with_config(out, tmp_path / "hf4", v4), tmp_path / "back")
    assert (back / "model.pth").read_bytes() == (run / "model.pth").read_bytes()
    assert json.loads((back / "config.json").read_text())["model"] == json.loads((run / "config.json").read_text())["model"]


@pytest.mark.parametrize("dtype, torch_dtype, bits", [("bf16", torch.bfloat16, 16), ("fp16", torch.float16, 16),
                                                      ("fp32", torch.float32, 32)])
def test_dtype_sets_the_weights_precision(tok, tmp_path, dtype, torch_dtype, bits):
    run = make_run(tmp_path / "run", tok, **CONFIGS["minimind2-shaped"])
    out = export_run(run, tmp_path / "hf", dtype=dtype)
    model, _ = load_hf(out)
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    ours, _, _ = load_run(run)
    n_unique = sum(p.numel() for p in ours.parameters())  # the tied head is stored once
    assert (out / "model.safetensors").stat().st_size == pytest.approx(n_unique * bits // 8, rel=0.01)
    back, _, _ = load_run(import_hf(out, tmp_path / "back"))  # read back in float32, rounded to dtype once
    for (name, p), q in zip(ours.named_parameters(), back.parameters()):
        assert torch.equal(p.to(torch_dtype).float(), q), name


def test_cli_export_and_import_and_the_imported_run_chats_and_fine_tunes(tok, tmp_path, capsys):
    run = make_run(tmp_path / "run", tok, **CONFIGS["qk-norm"])
    assert cli.main(["export", str(run), "--to", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert cli.main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "hf"), str(tmp_path / "back")]
    assert cli.main(["chat", "--ckpt", str(tmp_path / "back"), "--prompt", "hi", "--temperature", "0",
                     "--max-new-tokens", "4"]) == 0
    tiny = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "1", "--max-samples", "16",
            "--val-batches", "1", "--no-progress", "--steps", "2", "--cache", str(tmp_path / "cache")]
    assert cli.main(["sft", "--init", str(tmp_path / "back"), "--out", str(tmp_path / "sft"), *tiny]) == 0
    assert (tmp_path / "sft" / "model.pth").is_file()


def test_export_refuses_a_used_directory_and_overwrite_replaces_an_earlier_export(tok, tmp_path):
    run = make_run(tmp_path / "run", tok, **CONFIGS["minimind2-shaped"])
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_run(run, tmp_path / "used", overwrite=True)  # not an export: never replaced
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]
    out = export_run(run, tmp_path / "hf", dtype="bf16")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_run(run, out)
    export_run(run, out, dtype="fp32", overwrite=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run", "used"]  # no temporary directory left


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_export_of_what_is_not_a_finished_run_is_refused(tok, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    unfinished = make_run(tmp_path / "unfinished", tok, **CONFIGS["minimind2-shaped"])
    (unfinished / "model.pth").unlink()
    cases = [(tmp_path / "missing", "run directory not found"), (tmp_path / "empty", "not a run directory"),
             (unfinished, "did the run .* finish")]
    for run, message in cases:
        before = snapshot(tmp_path)
        assert cli.main(["export", str(run), "--to", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and re.search(message, err), err
        assert snapshot(tmp_path) == before and not (tmp_path / "hf").exists()


DROP = object()  # a field removed from config.json


def copy_with_config(out: Path, hf: Path, changes: dict) -> Path:
    """A copy of an exported directory whose config.json has `changes` (DROP: the field removed)."""
    hf.mkdir()
    for p in out.iterdir():
        (hf / p.name).write_bytes(p.read_bytes())
    config = {**json.loads((out / "config.json").read_text()), **changes}
    (hf / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))
    return hf


@pytest.mark.parametrize("changes, field", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type='gpt2'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "rope scaling .*linear"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                           "rope_theta": 1e6}), "rope scaling .*yarn"),
    (dict(hidden_size=DROP), "hidden_size"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]"),
])
def test_import_refuses_what_the_course_cannot_express(exported, tmp_path, capsys, changes, field):
    hf = copy_with_config(exported[2], tmp_path / "hf", changes)
    assert cli.main(["import-hf", str(hf), "--out", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(field, err), err
    assert not (tmp_path / "back").exists()


def test_import_refuses_an_untied_head_in_the_weights_and_missing_files(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, out = exported
    with pytest.raises(FileNotFoundError, match="not a transformers model directory"):
        import_hf(tmp_path, tmp_path / "back")
    hf = copy_with_config(out, tmp_path / "hf", {})
    state = load_file(hf / "model.safetensors")
    save_file({**state, "lm_head.weight": torch.randn_like(state["model.embed_tokens.weight"])},
              hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight is not model.embed_tokens.weight: an untied head"):
        import_hf(hf, tmp_path / "back")
    save_file({k: v for k, v in state.items() if "layers.1.mlp" not in k}, hf / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing key 'model.layers.1.mlp"):
        import_hf(hf, tmp_path / "back")
    (hf / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors: cannot read the weights"):
        import_hf(hf, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_yarn_only_when_minimind_applies_it(tok, tmp_path):
    """MiniMind stretches RoPE only when max_position_embeddings exceeds YaRN's original 2048: so does the export."""
    short = make_run(tmp_path / "short", tok, **{**CONFIGS["qk-norm"], "max_position_embeddings": 2048})
    config = json.loads((export_run(short, tmp_path / "hf_short") / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default"
    config = json.loads((export_run(make_run(tmp_path / "long", tok, **CONFIGS["qk-norm"]), tmp_path / "hf_long")
                         / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16,
                                         "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1,
                                         "attention_factor": 1.0}


def test_moe_without_q_k_norm_is_refused_naming_the_fields(tok, tmp_path):
    run = make_run(tmp_path / "run", tok, **{**CONFIGS["moe"], "qk_norm": False})
    with pytest.raises(ValueError, match="use_moe=True, qk_norm=False"):
        export_run(run, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_moe_routes_tokens_to_different_experts(tok, tmp_path):
    """The MoE comparison means something only if tokens take different experts with different weights."""
    model, _, _ = load_run(make_run(tmp_path / "run", tok, **CONFIGS["moe"]))
    ids = torch.randint(3, 6400, (2, 48), generator=torch.Generator().manual_seed(1))
    logits = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda module, args, out: logits.append(out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    top = torch.softmax(logits[0], dim=-1).topk(2, dim=-1)
    assert len(set(top.indices[:, 0].tolist())) == 4 and top.values.std() > 0.05, top


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_import_of_a_model_transformers_wrote(tok, tmp_path, model_type):
    """A Llama / Qwen3 checkpoint saved by transformers itself (not by export_run) becomes a run with its logits."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, vocab_size=6400, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                               head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
                                               rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                               tie_word_embeddings=True)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    tok.save(tmp_path / "hf")
    ours, _, _ = load_run(import_hf(tmp_path / "hf", tmp_path / "back"))
    assert (ours.config.head_dim, ours.config.qk_norm, ours.config.rope_theta) == (32, model_type == "qwen3", 5e5)
    ids = torch.randint(3, 6400, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4


def test_yarn_that_transformers_computes_otherwise_is_refused(tok, tmp_path):
    """With a small head_dim and theta, MiniMind ends YaRN's ramp at pair head_dim/2 - 1, transformers later."""
    run = make_run(tmp_path / "run", tok, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, rope_theta=1e4, inference_rope_scaling=True, max_position_embeddings=4096)
    with pytest.raises(ValueError, match="rope_theta=10000.0, head_dim=4: YaRN's ramp"):
        export_run(run, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
