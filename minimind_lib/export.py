"""A model leaves the course, as notebook 08_sft ends: `export_run` writes a run directory in the
`transformers` format (Llama, Qwen3 or Qwen3-MoE classes, model.safetensors, the tokenizer),
`import_hf` reads one back into a run directory. MiniMind's parameter names already are those
classes', so the weights travel unrenamed. The config reads the same in transformers 5 and 4.x; an
export lists its files in MANIFEST, and only those are ever replaced or removed."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .checkpoint import (LORA_FILE, MODEL_FILE, RUN_FILES, RUN_FORMAT, RUN_VERSION, TOKENIZER_DIR,
                         RunError, check_other_files, check_out_dir, check_state_dict,
                         check_target, load_run, load_weights_only, read_run_config,
                         save_checkpoint, start_run_dir)
from .checks import require
from .corpus import check_choice, tokenizer_fingerprint
from .fileio import ADVICE, PREFIX, TMP_PREFIX, atomic_write_text, check_utf8_path, exclusive_dir
from .model import YARN_SCALING, MiniMindConfig, MiniMindForCausalLM
from .tokenizer import (
    CONFIG_FILE as TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    check_vocab,
    load_tokenizer,
)

# model_type -> class: Llama's blocks are MiniMind2's, Qwen3's add q/k norm, Qwen3-MoE's (no shared
# expert) MoE
ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# MANIFEST: the names of the files written
WEIGHTS_FILE, MANIFEST = "model.safetensors", PREFIX + "export.json"
EXPORT_FILES = ("config.json", WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's names
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads",
         "max_position_embeddings", "rms_norm_eps")  # the same name and meaning in both configs
MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
       "router_aux_loss_coef")
# Fields whose other values MiniMind's blocks cannot compute: (the value needed, transformers'
# default when absent)
FIXED = {"attention_bias": (False, False), "mlp_bias": (False, False),
         "tie_word_embeddings": (True, False),
         "hidden_act": ("silu", "silu"), "use_sliding_window": (False, False),
         "partial_rotary_factor": (1.0, 1.0),
         # MoE: every block's FFN is one
         "decoder_sparse_step": (1, 1), "mlp_only_layers": ([], [])}


def hf_config(mcfg: MiniMindConfig, tok, dtype: str = "fp32") -> dict:
    """config.json of the transformers class (Llama's; Qwen3's, q/k norm; Qwen3-MoE's) that computes
    what MiniMind's model does, in transformers 5 (rope_parameters, num_local_experts) and 4.x
    (rope_theta, rope_scaling, num_experts)."""
    # here only: the rest of the course runs without transformers
    from transformers import AutoConfig
    trained, d = YARN_SCALING["original_max_position_embeddings"], mcfg.head_dim
    # MiniMind stretches only then
    yarn = mcfg.inference_rope_scaling and mcfg.max_position_embeddings > trained
    if (
        yarn
        and math.ceil(d * math.log(trained / (2 * math.pi)) / (2 * math.log(mcfg.rope_theta)))
        > d // 2 - 1
    ):
        raise RunError(f"rope_theta={mcfg.rope_theta}, head_dim={d}: YaRN's ramp would end past "
                       "MiniMind's")
    if mcfg.use_moe and not mcfg.qk_norm:
        raise RunError("use_moe=True, qk_norm=False: Qwen3-MoE, the standard class of MiniMind-3's "
                       "MoE, has q/k norm")
    if mcfg.use_moe:
        kind = "qwen3_moe"
    else:
        kind = "qwen3" if mcfg.qk_norm else "llama"
    rope = {"rope_type": "yarn" if yarn else "default", "rope_theta": mcfg.rope_theta,
            **(YARN_SCALING if yarn else {})}
    fields = SHAPE + (MOE if mcfg.use_moe else ())
    config = AutoConfig.for_model(kind, architectures=[ARCHS[kind]], **{k: getattr(mcfg, k)
                                                                        for k in fields},
                                  num_key_value_heads=mcfg.num_key_value_heads, head_dim=d,
                                  rope_parameters=rope,
                                  hidden_act="silu", tie_word_embeddings=True,
                                  bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  dtype=DTYPES[dtype])
    # 4.x reads theta at the top, YaRN in rope_scaling (5 reads that too, before rope_parameters:
    # the same values)
    v4 = {"rope_theta": mcfg.rope_theta, "rope_scaling": {"rope_type": "yarn", **YARN_SCALING}
          if yarn else None}
    # 4.x's name
    return {**config.to_diff_dict(), **v4, **({"num_experts": mcfg.num_experts} if mcfg.use_moe
                                              else {})}


def model_files(run_dir: str | Path, dtype: str) -> tuple[dict, dict, Any, tuple]:
    """(config.json, tensors, tokenizer, file names) of a finished run's transformers export."""
    model, tok, _ = load_run(run_dir)  # errors: not a run directory, no model.pth (unfinished), ...
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}  # the tied lm_head: transformers re-ties it
    return hf_config(model.config, tok, dtype), tensors, tok, EXPORT_FILES


def peft_adapter(run_dir: str | Path) -> tuple[dict, dict, None, tuple]:
    """(adapter_config.json, tensors, no tokenizer, file names): a LoRA run's lora.pth as PEFT's
    LoRA adapter (notebook 10_lora_dpo) for the export of the run it started from; lora_alpha = r,
    as the file's B carries the scale."""
    cfg, path = read_run_config(run_dir), Path(run_dir) / LORA_FILE
    require(bool(cfg.get("lora")) and path.is_file(), f"{run_dir} holds no LoRA adapters "
            f"({LORA_FILE}, written by `lora` or `dpo --lora-rank`)", RunError)
    state = load_weights_only(path, "LoRA file")
    tensors = {}
    for key, value in state.items():  # PEFT's names: lora_A, lora_B, under base_model.model.
        key = key.replace(".lora.A.", ".lora_A.").replace(".lora.B.", ".lora_B.")
        tensors["base_model.model." + key] = value.float().contiguous()
    rank, targets = cfg["lora"]["rank"], sorted({k.split(".")[-4] for k in state})  # q_proj, o_proj
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": cfg["init"]}
    return config, tensors, None, ADAPTER_FILES


def save_weights(tensors: dict, path: Path, target: Path) -> None:
    """save_file to `path`, the temp copy of `target`; a failed write (a full disk): one line naming
    `target`."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:  # its I/O errors give the errno in text only: "(os error 28)"
        found = re.search(r"os error (\d+)", str(e))
        if found:
            why = ADVICE.get(int(found[1]), str(e))
        else:
            why = str(e)
        raise OSError(f"cannot write {target}: {why}; nothing in {target.parent} was "
                      f"replaced") from None


def export_run(run_dir: str | Path, out_dir: str | Path, dtype: str = "fp32",
               overwrite: bool = False,
               allow_other_files: bool = False, adapter: bool = False) -> Path:
    """Write a finished run as a transformers directory (config.json, model.safetensors, tokenizer);
    returns it. overwrite: replace an earlier export's files; allow_other_files: write beside files
    it did not write (kept); adapter: a LoRA run's adapters alone, as a PEFT adapter (ADAPTER_FILES,
    fp32)."""
    check_choice("dtype", dtype, sorted(DTYPES))
    out = check_target(out_dir, "--to")
    if adapter:
        config, tensors, tok, names = peft_adapter(run_dir)
    else:
        config, tensors, tok, names = model_files(run_dir, dtype)
    # refuses a file or a dangling link; a folder it creates and leaves empty goes again
    with exclusive_dir(out):
        # MANIFEST: the files an earlier export wrote there, the only ones --overwrite replaces
        try:
            if (out / MANIFEST).exists():
                earlier = set(json.loads((out / MANIFEST).read_text(encoding="utf-8")))
            else:
                earlier = set()
        except (ValueError, TypeError, OSError) as e:
            raise RunError(f"{out / MANIFEST}: unreadable ({e}): which files export wrote there is "
                           "unknown") from None
        if earlier and not overwrite:
            raise RunError(f"{out} holds an earlier export: pass --overwrite to replace its files, "
                           "or another --to")
        check_other_files(out, earlier, allow_other_files, replaced=names)
        # the new files, whole before any old one goes (a killed export's: ours)
        tmp = out / f"{TMP_PREFIX}export"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            atomic_write_text(tmp / names[0], json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_weights(tensors, tmp / names[1], out / names[1])
            if tok is not None:
                tok.save(tmp)
            # listed before any move: a kill while moving leaves no file of ours unlisted
            atomic_write_text(out / MANIFEST, json.dumps(sorted(earlier | set(names))) + "\n")
            for name in names:
                # one by one, each old or new: the folder is never emptier
                os.replace(tmp / name, out / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def minimind_config(c: Any) -> MiniMindConfig:
    """The MiniMindConfig of a transformers config.json; ValueError naming the field the course
    cannot express."""
    require(isinstance(c, dict), f"a JSON object of fields, not {type(c).__name__} {c!r:.40}")
    if c.get("model_type") not in ARCHS:
        raise RunError(f"model_type={c.get('model_type')!r} ({c.get('architectures')}): the course "
                       "reads "
                       f"{sorted(ARCHS.values())} only")
    for key, (need, default) in FIXED.items():
        if c.get(key, default) != need:
            raise RunError(f"{key}={c.get(key, default)!r}: the course's model has {key}={need!r} "
                           "only")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}  # transformers 5 or 4
    kind, trained = (
        rope.get("rope_type", rope.get("type", "default")),
        YARN_SCALING["original_max_position_embeddings"],
    )
    yarn = kind == "yarn" and {k: rope.get(k) for k in YARN_SCALING} == YARN_SCALING
    if kind != "default" and not (yarn and c["max_position_embeddings"] > trained):
        raise RunError(f"rope scaling {rope} cannot be expressed: the course has only MiniMind-3's "
                       "YaRN "
                       f"{YARN_SCALING}, with max_position_embeddings above its "
                       "original_max_position_embeddings")
    # 5's name, or 4's
    moe, c = c["model_type"] == "qwen3_moe", {"num_experts": c.get("num_local_experts"), **c}
    return MiniMindConfig(**{k: c[k] for k in SHAPE + (MOE if moe else ())},
                          head_dim=c.get("head_dim"),
                          num_key_value_heads=c.get("num_key_value_heads",
                                                    c["num_attention_heads"]),
                          rope_theta=rope.get("rope_theta", c.get("rope_theta", 1e4)), use_moe=moe,
                          qk_norm=c["model_type"] != "llama", inference_rope_scaling=yarn)


def read_hf(hf_dir: str | Path) -> tuple[MiniMindForCausalLM, Any]:
    """(model, tokenizer) of a transformers directory the course can express: its config.json,
    tokenizer and weights checked (an error names the file and what is wrong: a field, the vocab, a
    missing, extra or mis-shaped key)."""
    hf_dir, path = Path(hf_dir), Path(hf_dir) / "config.json"
    require(path.is_file(), f"{path} not found: {hf_dir} is not a transformers model directory",
            FileNotFoundError)
    check_utf8_path(hf_dir, "the model directory")  # a run records where it came from
    try:
        mcfg = minimind_config(json.loads(path.read_text(encoding="utf-8")))
    # a missing field, bad JSON, a value out of range
    except (KeyError, ValueError, AttributeError, TypeError) as e:
        raise RunError(
            f"{path}: not a model config this course reads ({type(e).__name__}: {e})"
        ) from None
    tok = load_tokenizer(hf_dir)
    check_vocab(tok, mcfg.vocab_size)  # the message names the tokenizer's directory
    try:
        state = load_file(hf_dir / WEIGHTS_FILE)
        for k, v in state.items():
            if v.is_floating_point():
                state[k] = v.float()
    except (SafetensorError, OSError) as e:
        raise RunError(
            f"{hf_dir / WEIGHTS_FILE}: cannot read the weights ({type(e).__name__}: {e})"
        ) from None
    emb, model = state.get("model.embed_tokens.weight"), MiniMindForCausalLM(mcfg)
    # written once, if tied
    if emb is not None and not torch.equal(state.setdefault("lm_head.weight", emb), emb):
        raise RunError(f"{hf_dir / WEIGHTS_FILE}: lm_head.weight is not model.embed_tokens.weight: "
                       "an untied head")
    # names the first missing, extra or mis-shaped key
    check_state_dict(state, model, hf_dir / WEIGHTS_FILE)
    model.load_state_dict(state, strict=True)
    return model, tok


def import_hf(hf_dir: str | Path, run_dir: str | Path, overwrite: bool = False,
              allow_other_files: bool = False) -> Path:
    """A run directory for `chat` and `sft --init` from a transformers directory the course can
    express; returns it."""
    out = check_target(run_dir, "--out")
    model, tok = read_hf(hf_dir)
    run_cfg = {"format": RUN_FORMAT, "version": RUN_VERSION, "stage": "import",
               "model_preset": None, "model": model.config.to_dict(), "train": None,
               "source": str(Path(hf_dir).resolve()),
               "tokenizer": {"fingerprint": tokenizer_fingerprint(tok),
                             "vocab_size": tok.vocab_size}}
    # the lock a training run holds: never two writers in one run directory
    with exclusive_dir(out):
        check_out_dir(out, resume=False, overwrite=overwrite, resumable=False)  # nothing written
        ours = (*RUN_FILES, TOKENIZER_DIR)
        check_other_files(out, ours, allow_other_files, replaced=(MODEL_FILE,))
        save_checkpoint(model, out / MODEL_FILE)  # first, whole or not: a replaced run stays whole
        start_run_dir(out, run_cfg, tok, resume=False, keep=(MODEL_FILE,))
    return out
