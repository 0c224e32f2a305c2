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
from minimind_lib.export import EXPORT_FILES, export_run, import_hf  # noqa: E402
from minimind_lib.fileio import exclusive_dir  # noqa: E402
from minimind_lib.generate import generate_ids  # noqa: E402
from minimind_lib.checkpoint import save_checkpoint  # noqa: E402
from minimind_lib.model import YARN_SCALING, MiniMindConfig, MiniMindForCausalLM  # noqa: E402
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
    assert sorted(p.name for p in out.iterdir()) == [".minimind-export.json", "config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / ".minimind-export.json").read_text()) == sorted(EXPORT_FILES)  # what --overwrite may replace
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
    with pytest.raises(ValueError, match="used holds notes.txt, which this command did not write"):
        export_run(run, tmp_path / "used", overwrite=True)  # not an export: never replaced
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]
    out = export_run(run, tmp_path / "hf", dtype="bf16")
    with pytest.raises(ValueError, match="holds an earlier export: pass --overwrite"):
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


# ------------------------------------------------------------------ nothing of the user's is lost (issue 35)
def earlier_export_with_users_files(tok, tmp_path: Path) -> tuple[Path, Path, dict]:
    """A run, an earlier export of it in tmp_path/hf and files the user added there: (run, hf, the user's files)."""
    run = make_run(tmp_path / "run", tok, **CONFIGS["minimind2-shaped"])
    hf = export_run(run, tmp_path / "hf", dtype="bf16")
    users = {"notes.txt": "mine", ".lock": "my lock", ".x.tmp1": "my draft", "sub/data.txt": "my data"}
    for name, text in users.items():
        (hf / name).parent.mkdir(exist_ok=True)
        (hf / name).write_text(text)
    return run, hf, users


def test_overwrite_replaces_only_what_export_wrote_and_asks_before_writing_beside_other_files(tok, tmp_path, capsys):
    run, hf, users = earlier_export_with_users_files(tok, tmp_path)
    before = snapshot(hf)
    assert cli.main(["export", str(run), "--to", str(hf), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert ".lock, .x.tmp1, notes.txt, sub, which this command did not write" in err and "--allow-other-files" in err
    assert snapshot(hf) == before
    assert cli.main(["export", str(run), "--to", str(hf), "--overwrite", "--allow-other-files"]) == 0
    assert all((hf / name).read_text() == text for name, text in users.items())  # kept, byte for byte
    assert json.loads((hf / "config.json").read_text())["dtype"] == "float32"  # the export itself was replaced
    assert sorted(p.name for p in hf.iterdir()) == sorted([".minimind-export.json", *EXPORT_FILES, ".lock", ".x.tmp1",
                                                           "notes.txt", "sub"])  # no lock or temporary left


def test_a_users_config_json_is_never_replaced(tok, tmp_path, capsys):
    run = make_run(tmp_path / "run", tok, **CONFIGS["minimind2-shaped"])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")  # e.g. another model's: no manifest lists it
    for extra in ([], ["--overwrite", "--allow-other-files"]):
        assert cli.main(["export", str(run), "--to", str(tmp_path / "mine"), *extra]) == 2
        assert "it would replace config.json" in capsys.readouterr().err
    assert (tmp_path / "mine" / "config.json").read_text() == "{}"
    assert cli.main(["export", str(run), "--to", str(run), "--overwrite", "--allow-other-files"]) == 2
    assert "would replace config.json" in capsys.readouterr().err and load_run(run)  # the run itself is untouched


@pytest.mark.parametrize("target", [".", ""])
def test_the_working_directory_is_refused_and_left_as_it_was(tok, tmp_path, monkeypatch, capsys, target):
    run, hf, _ = earlier_export_with_users_files(tok, tmp_path)
    before = snapshot(hf)
    monkeypatch.chdir(hf)
    assert cli.main(["export", str(run), "--to", target, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"--to {target!r} is the working directory ({hf})" in err, err
    assert snapshot(hf) == before


def test_a_failed_overwrite_leaves_the_earlier_export_whole(tok, tmp_path, monkeypatch, capsys):
    run, hf, _ = earlier_export_with_users_files(tok, tmp_path)
    before, real_replace = snapshot(hf), os.replace

    def full_disk(src, dst):  # the new files are written whole; moving one of them in (or onto hf) fails
        if Path(dst) == hf or Path(dst).parent == hf and Path(dst).name in EXPORT_FILES:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    assert cli.main(["export", str(run), "--to", str(hf), "--overwrite", "--allow-other-files"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(os, "replace", real_replace)
    assert snapshot(hf) == before and load_hf(hf)  # the earlier export, still complete and loadable


def test_clear_messages_for_a_file_and_a_link_as_the_target(tok, tmp_path, capsys):
    run, hf, _ = earlier_export_with_users_files(tok, tmp_path)
    (tmp_path / "afile").write_text("x")
    assert cli.main(["export", str(run), "--to", str(tmp_path / "afile")]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    (tmp_path / "link").symlink_to(hf)  # a link to the earlier export: written through, the link stays a link
    assert cli.main(["export", str(run), "--to", str(tmp_path / "link"), "--overwrite", "--allow-other-files"]) == 0
    assert (tmp_path / "link").is_symlink() and json.loads((hf / "config.json").read_text())["dtype"] == "float32"


def test_import_refuses_an_empty_out_a_file_and_says_no_resume(exported, tmp_path, monkeypatch, capsys):
    _, run, out = exported
    monkeypatch.chdir(tmp_path)
    assert cli.main(["import-hf", str(out), "--out", ""]) == 2
    assert "--out '' is the working directory" in capsys.readouterr().err and not (tmp_path / "config.json").exists()
    (tmp_path / "afile").write_text("x")
    assert cli.main(["import-hf", str(out), "--out", "afile"]) == 2
    assert "afile is a file, not a directory" in capsys.readouterr().err
    assert cli.main(["import-hf", str(out), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite to replace it" in err and "--resume" not in err


def test_import_overwrite_waits_for_the_lock_and_keeps_a_run_whole_on_failure(exported, tmp_path, monkeypatch, capsys):
    _, run, out = exported
    target = tmp_path / "target"
    import_hf(out, target)
    with exclusive_dir(target):  # a pretraining run holds it (another process in real use)
        assert cli.main(["import-hf", str(out), "--out", str(target), "--overwrite"]) == 2
        assert f"is in use by pid {os.getpid()}" in capsys.readouterr().err
    before = snapshot(target)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    assert cli.main(["import-hf", str(out), "--out", str(target), "--overwrite"]) == 2
    monkeypatch.setattr(torch, "save", real_save)
    assert snapshot(target) == before and load_run(target)  # the run it would have replaced is whole
    (target / "notes.txt").write_text("mine")
    assert cli.main(["import-hf", str(out), "--out", str(target), "--overwrite"]) == 2
    assert "notes.txt, which this command did not write" in capsys.readouterr().err
    assert cli.main(["import-hf", str(out), "--out", str(target), "--overwrite", "--allow-other-files"]) == 0
    assert (target / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("changes, message", [
    (dict(rms_norm_eps=-1), "rms_norm_eps=-1: must be a finite number > 0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), "rope_theta='abc': must be a finite number"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0: must be a positive integer"),
])
def test_import_refuses_a_value_out_of_range_naming_the_file_and_field(exported, tmp_path, capsys, changes, message):
    hf = copy_with_config(exported[2], tmp_path / "hf", changes)
    assert cli.main(["import-hf", str(hf), "--out", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert f"{hf / 'config.json'}: " in err and message in err, err
    assert not (tmp_path / "back").exists()


def read_like_transformers_4(config: dict) -> dict:
    """What transformers 4.x takes from a config.json for RoPE, head size and experts, as 4.57's code reads it.

    Checked by reading transformers 4.57.6's source (installed apart from the course's pinned 5.x):
    LlamaConfig/Qwen3Config/Qwen3MoeConfig.__init__ take rope_theta=10000.0 and rope_scaling=None from the top level
    and never read rope_parameters (an unknown key to them); a rope_scaling "type" is copied to "rope_type";
    Qwen3MoeConfig reads num_experts (default 128), not 5's num_local_experts; Qwen3Config's head_dim defaults to
    128, Llama's to hidden_size // num_attention_heads; _validate_yarn_parameters wants factor, beta_fast and beta_slow
    as floats. The exports of CONFIGS, loaded in that 4.57.6 with AutoModelForCausalLM, gave our logits (see README)."""
    scaling = dict(config.get("rope_scaling") or {}) or None
    if scaling is not None and "type" in scaling:
        scaling["rope_type"] = scaling["type"]
    default_head = 128 if config["model_type"] in ("qwen3", "qwen3_moe") else config["hidden_size"] // config[
        "num_attention_heads"]
    return {"rope_theta": config.get("rope_theta", 10000.0), "rope_scaling": scaling,
            "head_dim": config.get("head_dim", default_head),
            "num_experts": config.get("num_experts", 128) if config["model_type"] == "qwen3_moe" else None}


def test_the_exported_config_reads_the_same_in_transformers_4(exported):
    name, run, out = exported
    mcfg = load_run(run)[0].config
    v4 = read_like_transformers_4(json.loads((out / "config.json").read_text()))
    assert (v4["rope_theta"], v4["head_dim"]) == (mcfg.rope_theta, mcfg.head_dim)
    assert v4["num_experts"] == (mcfg.num_experts if mcfg.use_moe else None)
    if mcfg.inference_rope_scaling:  # YaRN as 4.x computes it: the same values as 5's rope_parameters
        assert v4["rope_scaling"] == {"rope_type": "yarn", **YARN_SCALING}
        assert all(type(v4["rope_scaling"][k]) is float for k in ("factor", "beta_fast", "beta_slow"))
    else:
        assert v4["rope_scaling"] is None
