"""Checks for the exercises of notebooks 00-10, shared by each chapter and its solution notebook (notebooks/solutions/).

Each check takes the learner's answer (a value or a function) and what the notebook built, and then:
- with the placeholder (None, or a function that raises NotImplementedError) prints "not attempted yet", a hint and
  where the worked solution is, never the answer;
- with a wrong answer raises NotRightYet (an AssertionError) whose message says what is wrong and gives the hint;
  Jupyter shows that message alone, never a traceback into this file;
- with a right answer prints a line that says it passed.
A check cannot be fooled by a guess: an answer is a function, run on inputs the check draws afresh (hidden), and
compared with minimind_lib's computation, or a value compared as a digest only where no guess reaches it (a whole
file's masks, packing rows), never a small number that trying values would find. The expected values are computed
from minimind_lib, from a learner's function already checked or by measuring (real files, a cast), so reading this file
gives few answers away (05.1's and 05.2's measurement is their answer).
This file is not part of minimind_lib: it is course material, like the notebooks.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import random
from pathlib import Path
from typing import Any, Callable

import torch

CHAPTERS = {"00": "00_setup", "01": "01_tokenizer", "02": "02_data", "03": "03_model",
            "04": "04_gradient_accumulation", "05": "05_mixed_precision", "06": "06_dynamic_batching",
            "07": "07_pretrain", "08": "08_sft", "09": "09_beyond_one_gpu", "10": "10_lora_dpo"}
NOT_ATTEMPTED = "not attempted yet"
PASSED = "passed"
STRICT = False  # the solution notebooks set True: there, an exercise left unattempted is an error


HERE = Path(__file__).resolve().parent


def solution_path(exercise: str) -> str:
    """Where the worked solution of an exercise such as "03.1" is, from the running notebook's folder (the working
    directory): solutions/ beside the chapters in a checkout, ../solutions/ in the handout (beside notebooks/, lab/)."""
    name = f"{CHAPTERS[exercise[:2]]}.ipynb"
    found = [d / name for d in (HERE / "solutions", HERE.parent / "solutions", HERE) if (d / name).is_file()]
    return os.path.relpath(found[0]) if found else f"solutions/{name} (ask your teacher)"


class NotRightYet(AssertionError):
    """A wrong answer. IPython shows only this message (through _render_traceback_): a traceback would print the
    check's own lines, and with them what the answer should be."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mNotRightYet\x1b[0m: {self}"]


def _not_attempted(exercise: str, hint: str) -> None:
    line = f"exercise {exercise}: {NOT_ATTEMPTED}. Hint: {hint} Worked solution: {solution_path(exercise)}"
    if STRICT:
        raise NotRightYet(line)
    print(line)


def verdict(exercise: str, hint: str, test: Callable[[], None], *answers: Any) -> None:
    """Run `test` on the learner's answers; print not-attempted or passed, or raise NotRightYet with the hint."""
    if any(a is None for a in answers):
        return _not_attempted(exercise, hint)
    try:
        test()
    except NotImplementedError:
        return _not_attempted(exercise, hint)
    except AssertionError as e:
        raise NotRightYet(f"exercise {exercise}: not right yet: {e} Hint: {hint}") from None
    except Exception as e:  # the answer itself failed: a function of the wrong arity, a value of the wrong type
        raise NotRightYet(f"exercise {exercise}: not right yet: checking your answer raised {type(e).__name__}: "
                          f"{e}. Hint: {hint}") from None
    print(f"exercise {exercise}: {PASSED}")


def _rounded(value: Any, digits: int) -> Any:
    if isinstance(value, (list, tuple)):
        return [_rounded(v, digits) for v in value]
    is_float = isinstance(value, float) or (torch.is_tensor(value) and value.dim() == 0)
    return float(f"{float(value):.{digits}g}") if is_float else value


def digest(value: Any, digits: int = 6) -> str:
    """A short SHA-256 of an answer's repr (floats, also in lists, rounded to `digits` significant digits): checks
    compare it with the digest of the right answer, which this file holds instead of the answer."""
    return hashlib.sha256(repr(_rounded(value, digits)).encode()).hexdigest()[:16]


def _close(a: Any, b: float, rel: float = 1e-6) -> bool:
    is_number = isinstance(a, (int, float)) and not isinstance(a, bool)
    return is_number and math.isclose(float(a), b, rel_tol=rel, abs_tol=1e-12)


# 00 setup -------------------------------------------------------------------------------------------------------------
def check_00_profiles(ci_profile: str | None, laptop_gpu_profile: str | None) -> None:
    """Exercise 00.1: the profile a CI service without a GPU gets, and the one a laptop with a GPU gets."""
    from minimind_lib.profiles import select_profile_name

    def test():
        assert ci_profile == select_profile_name({"CI": "true"}, cuda_available=False), "ci_profile is not right."
        assert laptop_gpu_profile == select_profile_name({}, cuda_available=True), "laptop_gpu_profile is not right."
    return verdict("00.1", "read select_profile_name's rules in section 3, or call it with each environment.",
                   test, ci_profile, laptop_gpu_profile)


def check_00_memory_fraction(fn: Callable[[float], float]) -> None:
    """Exercise 00.2: the memory fraction that makes a card of any size behave like a 24 GiB one."""
    def test():
        for card_gib in [random.uniform(24, 192) for _ in range(5)] + [80.0]:
            got = fn(card_gib)
            assert isinstance(got, float), f"fraction_for({card_gib:.3g}) = {got!r}: the fraction is a float."
            assert _close(got * card_gib, 24.0, 1e-9), \
                f"fraction_for({card_gib:.3g}) = {got:.6g} leaves {got * card_gib:.4g} GiB of the card, not 24 GiB."
    return verdict("00.2", "the fraction is target bytes / total bytes (memory_fraction_for).", test, fn)


# 01 tokenizer ---------------------------------------------------------------------------------------------------------
def check_01_bytes_per_token(value: float | None, corpus: list[str], held_out: list[str]) -> None:
    """Exercise 01.1: bytes per token on held_out of a BPE trained on corpus with 50 merges."""
    from minimind_lib import bpe

    def test():
        merges, _ = bpe.train(corpus, 256 + 50)
        want = sum(len(t.encode()) for t in held_out) / sum(len(bpe.encode(t, merges)) for t in held_out)
        assert _close(value, want, 1e-9), f"{value!r} is not the bytes per token of 50 merges on held_out."
    return verdict("01.1", "train(corpus, 256 + 50), then total UTF-8 bytes of held_out / total tokens of "
                   "encode(text, merges) over held_out.", test, value)


COUNT_LINE = "床前明月光，疑是地上霜。"


def check_01_count_tokens(n_tokens: int | None, n_bytes: int | None, tok: Any) -> None:
    """Exercise 01.2: tokens and UTF-8 bytes of one line of Chinese verse."""
    def test():
        assert n_bytes == len(COUNT_LINE.encode("utf-8")), "n_bytes: count the UTF-8 bytes, not the characters."
        assert n_tokens == len(tok.encode(COUNT_LINE)), "n_tokens: count the ids tok.encode returns."
    return verdict("01.2", "tok.encode gives the ids; str.encode('utf-8') gives the bytes (3 per Chinese character).",
                   test, n_tokens, n_bytes)


def check_01_chat_prompt(my_prompt: str | None, conv: list[dict], tok: Any) -> None:
    """Exercise 01.3: the ChatML prompt of conv with the generation prompt, written by hand."""
    def test():
        want = tok.apply_chat_template(conv, add_generation_prompt=True)
        assert isinstance(my_prompt, str), "my_prompt must be a str."
        assert my_prompt.startswith("<|im_start|>"), "a ChatML prompt starts with <|im_start|>."
        assert my_prompt == want, "the string differs from the template's; mind every \\n and the generation prompt."
    return verdict("01.3", "each turn is <|im_start|>role\\ncontent<|im_end|>\\n; the generation prompt adds "
                   "<|im_start|>assistant\\n.", test, my_prompt)


class _Vocab:
    """A stand-in tokenizer with a given vocabulary of strings (decode of one id is its string)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.vocab_size = tokens, len(tokens)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.tokens[i] for i in ids)


def check_01_inner_space(fn: Callable[[Any], list[int]], tok: Any) -> None:
    """Exercise 01.4: ids of tokens whose text has a space right after a non-space character."""
    def test():
        toy = _Vocab(["a", " b", "o b", "ab  ", "  ", "x y z", "c"])
        assert digest(sorted(fn(toy))) == "40d28069123e2a7d", \
            "on a toy vocabulary ['a', ' b', 'o b', 'ab  ', '  ', 'x y z', 'c'] your ids are wrong."
        assert tok.vocab_size != 6400 or digest(sorted(fn(tok))) == "4f53cda18c2baa0c", "on tok your list differs."
    return verdict("01.4", "decode each id alone (tok.decode([i]) for every id) and look for a space that "
                   "follows a non-space character.", test, fn)


# 02 data --------------------------------------------------------------------------------------------------------------
def _newline_after_reply(ids: list[int], mask: list[int], eos_id: int) -> list[int]:
    return [k + 1 for k in range(len(ids) - 1) if mask[k] and ids[k] == eos_id]


def check_02_minimind_mask(fn: Callable, fewer_trained: int | None, sft_mm: Any, eos_id: int) -> None:
    """Exercise 02.1: the mask that stops at <|im_end|> (without MiniMind's newline after it), and how many fewer
    tokens it trains."""
    def test():
        for i in range(min(50, len(sft_mm))):
            ids, mask = sft_mm.raw(i)[0].tolist(), sft_mm.raw(i)[1].tolist()
            want = list(mask)
            for k in _newline_after_reply(ids, mask, eos_id):
                want[k] = 0
            assert [int(m) for m in fn(ids)] == want, f"sample {i}: your mask differs from the rule."
        total = sum(len(_newline_after_reply(sft_mm.raw(i)[0].tolist(), sft_mm.raw(i)[1].tolist(), eos_id))
                    for i in range(len(sft_mm)))
        assert fewer_trained == total, "fewer_trained: count over every sample of sft_mm, not a few."
    return verdict("02.1", "start from assistant_mask; after each trained <|im_end|> set the next position to 0. "
                   "Then sum(old) - sum(new) over every sft_mm.raw(i)[0].", test, fn, fewer_trained)


def check_02_padding_64(value: float | None, lengths: Any) -> None:
    """Exercise 02.2: the padding fraction of consecutive batches of 64 SFT samples padded to the longest row."""
    from minimind_lib.data import padding_fraction

    def test():
        lengths_ = [int(n) for n in lengths]
        want = padding_fraction([lengths_[i:i + 64] for i in range(0, len(lengths_), 64)])
        assert _close(value, want, 1e-9), f"{value!r} is not the padding fraction of consecutive batches of 64."
    return verdict("02.2", "cut sft_mm.lengths into consecutive slices of 64 and give them to padding_fraction "
                   "without seq_len (pad to the longest row).", test, value)


def _memmap_files_bytes(n_tokens: int, n: int) -> int:
    """Bytes on disk of a real .bin (uint16 tokens, written as np.memmap) and .idx.npy (np.save of the int64 offsets)
    of n samples holding n_tokens tokens, as section 4 writes them: measured from the files."""
    import tempfile

    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        np.memmap(Path(tmp) / "x.bin", dtype=np.uint16, mode="w+", shape=(n_tokens,)).flush()
        np.save(Path(tmp) / "x.idx.npy", np.zeros(n + 1, dtype=np.int64))
        return sum(f.stat().st_size for f in Path(tmp).iterdir())


def check_02_memmap_bytes(fn: Callable[[int, int], int]) -> None:
    """Exercise 02.3: disk bytes of the .bin and .idx.npy of section 4, for sizes drawn afresh."""
    def test():
        for _ in range(3):
            n = random.randint(1, 20_000)
            n_tokens = random.randint(n, 5_000_000)
            got = fn(n_tokens, n)
            assert got == _memmap_files_bytes(n_tokens, n), f"memmap_bytes({n_tokens}, {n}) = {got!r} is not right."
    return verdict("02.3", "uint16 tokens; int64 offsets, one more than the samples; plus np.save's header.", test, fn)


# 03 model -------------------------------------------------------------------------------------------------------------
def _configs() -> list:
    from minimind_lib.model import MiniMindConfig
    return [MiniMindConfig(), MiniMindConfig(hidden_size=768, num_hidden_layers=16, num_attention_heads=12,
                                              num_key_value_heads=4),
            MiniMindConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1)]


def check_03_block_params(fn: Callable) -> None:
    """Exercise 03.1: the parameters of one transformer block, from the config alone."""
    from minimind_lib.model import MiniMindBlock

    def test():
        for c in _configs():
            with torch.device("meta"):
                want = sum(p.numel() for p in MiniMindBlock(c).parameters())
            got = fn(c)
            assert got == want, (f"hidden {c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}: "
                                 f"{got!r} is {'too many' if isinstance(got, int) and got > want else 'not right'}.")
    return verdict("03.1", "q and o are hidden x hidden; k and v are hidden x (kv heads x head_dim); gate, up and "
                   "down are hidden x intermediate_size; two RMSNorm weights of size hidden; no biases.", test, fn)


def check_03_model_params(fn: Callable) -> None:
    """Exercise 03.2: the whole model's parameters (tied embedding counted once)."""
    from minimind_lib.model import MiniMindForCausalLM, count_parameters

    def test():
        for c in _configs():
            with torch.device("meta"):
                want = count_parameters(MiniMindForCausalLM(c))["total"]
            got = fn(c)
            assert got == want, f"hidden {c.hidden_size}, {c.num_hidden_layers} layers: {got!r} is not right."
    return verdict("03.2", "embedding (vocab x hidden, shared with lm_head: count it once) + layers x your "
                   "block_params + the final norm.", test, fn)


def check_03_bigger_part(answer: str | None, full: Any) -> None:
    """Exercise 03.3: the layers' activations or the head, which is larger for MiniMind2-small at 1 x 512."""
    from minimind_lib.memory import estimate_memory

    def test():
        e = estimate_memory(full, 1, 512)
        assert answer in ("layers", "head"), 'answer "layers" or "head".'
        assert answer == ("layers" if e["activations_bytes"] > e["head_bytes"] else "head"), "the other one is larger."
    return verdict("03.3", "estimate_memory returns each part in bytes: find the layers' activations and the head's "
                   "among its keys.",
                   test, answer)


# 04 gradient accumulation ---------------------------------------------------------------------------------------------
def _library_losses(model: torch.nn.Module, micro_batches: list[dict]) -> dict[str, float]:
    """The step's loss both ways, as the library computes them: "naive", the mean of the micro-batches' mean losses
    (lm_loss, MiniMind's loop), and "token", train.accumulate_step's token-weighted loss (on a copy: it backwards)."""
    from minimind_lib.model import lm_loss
    from minimind_lib.train import accumulate_step
    device = next(model.parameters()).device
    with torch.no_grad():
        means = [float(lm_loss(model(mb["input_ids"].to(device)).logits, mb["labels"].to(device)))
                 for mb in micro_batches]
    return {"naive": sum(means) / len(means), "token": accumulate_step(copy.deepcopy(model), micro_batches)["loss"]}


def hard_and_easy_step(seed: int | None = None) -> tuple[torch.nn.Module, list[dict]]:
    """A small model and one step's micro-batches where the naive and the token-weighted losses differ clearly: a
    short micro-batch (one row, 2 trained tokens) whose targets are the model's least likely tokens, and a long one
    (3 rows, every token trained) whose targets are its most likely. Drawn afresh unless `seed` is given."""
    from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
    g = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            vocab_size=97, max_position_embeddings=64)
    model = MiniMindForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1, generator=g)  # confident logits: per-token losses spread widely
    micro = []
    for rows, trained, pick in ((1, 2, "least"), (3, 15, "most")):
        ids = torch.randint(0, config.vocab_size, (rows, 16), generator=g)
        with torch.no_grad():
            logits = model(ids).logits[:, :-1]  # position t scores the label at t + 1
        labels = ids.clone()
        labels[:, 1:] = logits.argmin(-1) if pick == "least" else logits.argmax(-1)
        labels[:, 1:-trained] = -100  # the short micro-batch trains only its last 2 positions
        micro.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return model, micro


def _hard_and_easy_losses() -> tuple[torch.nn.Module, list[dict], dict[str, float]]:
    model, micro = hard_and_easy_step()
    losses = _library_losses(model, micro)
    assert abs(losses["naive"] - losses["token"]) > 1.0, "the check's own step should separate the two losses"
    return model, micro, losses


def check_04_naive_loss(fn: Callable) -> None:
    """Exercise 04.1: the loss MiniMind's loop optimises: the mean of the micro-batches' mean token losses, on a
    fresh model and micro-batches where it differs from the token-weighted loss by more than 1."""
    def test():
        model, micro, want = _hard_and_easy_losses()
        got = float(fn(model, micro))
        assert not _close(got, want["token"], 1e-3), \
            "that is the token-weighted loss (exercise 3), not the mean of the micro-batches' means."
        assert _close(got, want["naive"], 1e-5), \
            "not the mean over micro-batches of each micro-batch's mean token loss (on the check's own step)."
    return verdict("04.1", "for each micro-batch: token_loss_sum(logits, labels) / count_trained(labels); then "
                   "average those k numbers; under torch.no_grad().", test, fn)


def check_04_token_weights(fn: Callable) -> None:
    """Exercise 04.2: the weight one trained token gets in each micro-batch, naive and token-weighted."""
    def test():
        for counts, naive, token in (([10, 90], "afda8067444bae80", "583c040df23772a9"),
                                     ([3, 5, 7, 1], "1f4d0417ec2b55d0", "9dae806df996e80c"),
                                     ([50], "4ec5d3779c0572b6", "4ec5d3779c0572b6")):
            got_naive, got_token = [float(g) for g in fn(counts, "naive")], [float(g) for g in fn(counts, "token")]
            assert len(got_naive) == len(counts) and len(got_token) == len(counts), "return one weight per micro-batch."
            assert digest(got_naive) == naive, f"naive weights for counts {counts} are not right."
            assert digest(got_token) == token, f"token weights for counts {counts} are not right."
    return verdict("04.2", "naive: a micro-batch's mean divides by its own count, the average by k; token: every "
                   "token is divided by the step's total count.", test, fn)


def check_04_exact_loss(fn: Callable) -> None:
    """Exercise 04.3: the token-weighted step loss, which equals one big batch's mean token loss (on a fresh step
    where it differs from the naive loss by more than 1)."""
    def test():
        model, micro, want = _hard_and_easy_losses()
        got = float(fn(model, micro))
        assert not _close(got, want["naive"], 1e-3), "that is the naive loss (exercise 1), not the token-weighted one."
        assert _close(got, want["token"], 1e-5), "not the sum of token losses over all trained tokens of the step."
    return verdict("04.3", "add up the token-loss sums of the micro-batches and divide by the step's total count "
                   "of trained tokens.", test, fn)


# 05 mixed precision ---------------------------------------------------------------------------------------------------
def check_05_rounding_error(fn: Callable) -> None:
    """Exercise 05.1: the largest relative rounding error of a float32 tensor cast to a 16-bit type (a tensor drawn
    afresh; the expected value is the cast measured here, as the exercise asks)."""
    def test():
        x = torch.randn(10_000) * random.uniform(0.1, 10) + 0.01
        for dtype in (torch.bfloat16, torch.float16):
            got, want = fn(x, dtype), ((x.to(dtype).float() - x).abs() / x.abs()).max()
            assert _close(float(got), float(want), 1e-4), f"{dtype}: your error is not right."
    return verdict("05.1", "cast to dtype and back to float32, then max |rounded - x| / |x|. To read off the bits: "
                   "rounding to nearest with p significant bits errs by at most 2^-p of the value.", test, fn)


def check_05_lost_updates(fn: Callable) -> None:
    """Exercise 05.2: the share of weights that an update leaves unchanged when weights are stored in dtype."""
    def test():
        w, update = torch.randn(10_000) * 0.02, torch.full((10_000,), 10 ** random.uniform(-6, -4))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            stored = w.to(dtype)
            got, want = fn(w, update, dtype), (stored + update.to(dtype) == stored).float().mean()
            assert _close(float(got), float(want), 1e-6), f"{dtype}: your fraction is not right."
    return verdict("05.2", "store w and the update in dtype, add them, and compare the sum with the stored weights.",
                   test, fn)


def check_05_t4(t4_dtype: str | None, t4_scaler: bool | None) -> None:
    """Exercise 05.3: what amp="auto" chooses on a CUDA card without native bf16 (a T4)."""
    import minimind_lib.device as device_module
    from minimind_lib.train import resolve_amp

    def test():
        real = device_module.bf16_native
        device_module.bf16_native = lambda d: False  # pretend: a CUDA card without native bf16
        try:
            t4 = resolve_amp("auto", torch.device("cuda"))
        finally:
            device_module.bf16_native = real
        assert t4_dtype == t4.name, "t4_dtype is not right."
        assert t4_scaler == t4.use_scaler, "t4_scaler is not right."
    return verdict("05.3", "read resolve_amp's rule in section 5: what does auto pick without native bf16, and "
                   "does that format need loss scaling?", test, t4_dtype, t4_scaler)


# 06 dynamic batching --------------------------------------------------------------------------------------------------
def check_06_padded_fraction(fn: Callable, lengths: Any) -> None:
    """Exercise 06.1: the padding fraction of batches of sample lengths."""
    from minimind_lib.data import padding_fraction

    def test():
        assert _close(float(fn([[2, 4], [3]])), padding_fraction([[2, 4], [3]]), 1e-9), \
            "padding to the longest row: [[2, 4], [3]]."
        assert _close(float(fn([[2, 4], [3]], seq_len=8)), padding_fraction([[2, 4], [3]], seq_len=8), 1e-9), \
            "padding to seq_len=8: [[2, 4], [3]]."
        real = [int(n) for n in lengths[:200]]
        batches = [real[i:i + 8] for i in range(0, len(real), 8)]
        assert _close(float(fn(batches)), padding_fraction(batches), 1e-9), "differs on batches of 8 real lengths."
    return verdict("06.1", "real tokens = sum of all lengths; padded = sum over batches of rows x (seq_len or the "
                   "batch's longest); return 1 - real / padded.", test, fn)


def check_06_capped_batches(fn: Callable) -> None:
    """Exercise 06.2: token-budget batches with a row cap, as the library's sampler makes them."""
    import numpy as np
    from minimind_lib.batching import TokenBudgetBatchSampler

    def test():
        rng = np.random.default_rng(0)
        for _ in range(20):
            lengths = rng.integers(1, 50, size=40).tolist()
            want = TokenBudgetBatchSampler(lengths, 100, max_batch_size=3, shuffle=False).batches()
            got = [list(map(int, b)) for b in fn(lengths, 100, 3)]
            assert got == [list(map(int, b)) for b in want], f"differs from the library on lengths {lengths[:8]}..."
    return verdict("06.2", "sort indices longest first (stable), then fill_batches with max_batch_size: a batch "
                   "closes when the next row would exceed max_tokens (rows x longest) or max_rows.", test, fn)


def check_06_first_fit(fn: Callable, lengths: Any, seq_len: int) -> None:
    """Exercise 06.3: first-fit packing of whole documents into rows of seq_len tokens."""
    import numpy as np

    def test():
        toy = fn([5, 4, 3, 3, 2, 2, 1], 8)
        assert sorted(i for r in toy for i in r) == list(range(7)), "every document must be in exactly one row."
        assert all(sum([5, 4, 3, 3, 2, 2, 1][i] for i in r) <= 8 for r in toy), "a toy row holds more than 8 tokens."
        assert digest([[int(i) for i in r] for r in toy]) == "7afb3ff679e3c9ff", \
            "on [5, 4, 3, 3, 2, 2, 1] with seq_len 8 the rows are not first fit, longest first."
        many = [int(n) for n in np.random.default_rng(6).integers(1, 129, size=300)]
        assert digest([[int(i) for i in r] for r in fn(many, 128)]) == "49eea0b270bcfd58", \
            "differs on 300 lengths from 1 to 128 (seq_len 128)."
    return verdict("06.3", "visit documents by (-length, index); put each into the first row whose room is "
                   "enough, else open a new row.", test, fn)


def _clean_and_stale(model: torch.nn.Module, micro: list[dict]) -> float:
    from minimind_lib.train import accumulate_step
    clean, stale = copy.deepcopy(model), copy.deepcopy(model)
    accumulate_step(clean, micro)
    accumulate_step(stale, micro[:1])  # the failed attempt got this far
    accumulate_step(stale, micro)
    return max(float((s.grad - c.grad).norm() / c.grad.norm()) for s, c in zip(stale.parameters(), clean.parameters())
               if c.grad is not None and c.grad.norm() > 0)


def check_06_stale_gradient(fn: Callable, model: torch.nn.Module, micro: list[dict]) -> None:
    """Exercise 06.4: how far a retry without zeroing the gradients is from a clean step."""
    def test():
        got = float(fn(model, micro))
        assert got > 0.01, f"a gradient that kept the failed attempt's part is off by more than 1%, you got {got:.2g}."
        assert _close(got, _clean_and_stale(model, micro), 1e-3), \
            "not max over parameters of |g_stale - g_clean| / |g_clean| (norms per parameter)."
    return verdict("06.4", "copy.deepcopy(model) twice; clean: accumulate_step(all); stale: accumulate_step(first "
                   "micro-batch), then accumulate_step(all) without zero_grad; compare per parameter.", test, fn)


# 07 pretraining -------------------------------------------------------------------------------------------------------
def check_07_lr(fn: Callable, train_cfg: dict, metrics: Any) -> None:
    """Exercise 07.1: the run's learning rate at every step, from its config, against what the run logged."""
    from minimind_lib.train import lr_at
    keys = ("lr", "min_lr", "warmup_steps", "max_steps")

    def test():
        trained = metrics[metrics["step"] >= 0]
        for step, logged in zip(trained["step"], trained["lr"]):
            want = lr_at(int(step), **{k: train_cfg[k] for k in keys})
            got = fn(int(step), train_cfg)
            assert _close(float(got), want, 1e-6), f"step {int(step)}: {got!r} is not the schedule's value."
            assert _close(float(got), float(logged), 1e-4), f"step {int(step)}: the run logged another learning rate."
    return verdict("07.1", "warmup: lr * (step + 1) / warmup_steps; then a cosine from lr to min_lr over the steps "
                   "left up to max_steps (notebook 04, section 2).", test, fn)


def check_07_tokens_to_reach(fn: Callable, metrics: Any) -> None:
    """Exercise 07.2: tokens trained when the training loss first fell below a value."""
    def test():
        trained = metrics[metrics["step"] >= 0].reset_index(drop=True)
        seen = trained["tokens"].cumsum()
        losses = trained["loss"].dropna()
        for target in (float(losses.iloc[0]) - 1e-6, float(losses.median()), float(losses.min()) + 1e-9, 0.0):
            below = trained.index[trained["loss"] < target]
            want = int(seen[below[0]]) if len(below) else None
            got = fn(metrics, target)
            assert (got is None if want is None else got is not None and int(got) == want), \
                (f"loss below {target:.4f}: {got!r} is not right (the tokens up to and including that step; "
                 "None if never).")
    return verdict("07.2", "keep rows with step >= 0 (the row at step -1 is the evaluation before training); "
                   "cumulative sum of 'tokens'; the first row whose loss < target.", test, fn)


def check_07_perplexity(fn: Callable, metrics: Any) -> None:
    """Exercise 07.3: validation perplexity at each evaluation, from the logged validation loss."""
    def test():
        val = metrics.dropna(subset=["val_loss"])
        got = fn(metrics)
        assert len(got) == len(val), "one perplexity per evaluation (rows with a val_loss)."
        assert all(_close(float(g), math.exp(v), 1e-6) for g, v in zip(got, val["val_loss"])), \
            "perplexity is e to the power of the mean token loss."
    return verdict("07.3", "metrics.dropna(subset=['val_loss']), then exp of each val_loss.", test, fn)


# 08 SFT ---------------------------------------------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "You are MiniMind."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "床前明月光的下一句？"},
     {"role": "assistant", "content": "疑是地上霜。"}],
    [{"role": "user", "content": "3+4?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                          "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},
     {"role": "tool", "content": "7"}, {"role": "assistant", "content": "7."}],
]


def check_08_last_reply_mask(fn: Callable, fewer_trained: Callable, tok: Any) -> None:
    """Exercise 08.1: the mask of the last assistant turn only, and how many fewer tokens it trains than the full
    rule over a list of conversations (checked on a random sample of the file's lines, drawn afresh)."""
    import json

    from minimind_lib.corpus import assistant_mask, encode_sft
    from minimind_lib.paths import DATA_DIR

    def test():
        masks = [[int(m) for m in fn(encode_sft(tok, conv)[0].tolist())] for conv in CONVERSATIONS]
        assert digest(masks) == "3d01bbfd91b2baeb", \
            "your mask differs on the check's three conversations (a plain one, a multi-turn one, one with a tool)."
        with open(DATA_DIR / "sft_t2t_mini.jsonl", encoding="utf-8") as f:
            convs = [json.loads(line)["conversations"] for line in f]
        ids = [encode_sft(tok, conv)[0].tolist() for conv in convs]
        masks = [[int(m) for m in fn(i)] for i in ids]
        assert digest(masks) == "0e1f8b48cef646f6", "your mask differs on some line of data/sft_t2t_mini.jsonl."
        sample = random.sample(range(len(convs)), random.randint(5, len(convs) - 5))
        want = sum(int(assistant_mask(tok, ids[i]).sum()) - sum(masks[i]) for i in sample)  # masks: checked above
        got = fewer_trained([convs[i] for i in sample])
        assert got == want, (f"fewer_trained on {len(sample)} lines of the file drawn at random gives {got!r}, not the "
                             "difference of the two rules' trained tokens over them.")
    return verdict("08.1", "start from assistant_mask_of(ids) and keep only its last run of 1s (each assistant turn "
                   "is one run: the header between two turns is never trained); then add up sum(full) - sum(last) "
                   "over the conversations.", test, fn, fewer_trained)


def check_08_masked_loss(fn: Callable) -> None:
    """Exercise 08.2: the SFT loss: next-token cross-entropy averaged over positions with a label."""
    from minimind_lib.model import lm_loss

    def test():
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 7, 11, generator=g)
        labels = torch.randint(0, 11, (2, 7), generator=g)
        labels[0, :3] = -100
        labels[1, 4:] = -100
        got = fn(logits, labels)
        assert torch.is_tensor(got) and got.dim() == 0, "return a scalar tensor."
        assert torch.allclose(got.float(), lm_loss(logits, labels), atol=1e-5), \
            "not the mean over trained targets: logits[:, t] predicts labels[:, t + 1]; ignore -100."
    return verdict("08.2", "shift by one (the logits at t score the label at t + 1) and let F.cross_entropy "
                   "ignore -100.", test, fn)


def check_08_prompt_text(prompt_text: str | None, tok: Any) -> None:
    """Exercise 08.3: the text the model sees when it must answer "hi"."""
    def test():
        want = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert prompt_text == want, "the string differs from the template's; mind every \\n and what comes last."
    return verdict("08.3", "one user turn in ChatML, then the header the assistant's answer starts after.",
                   test, prompt_text)


# 09 beyond one GPU ----------------------------------------------------------------------------------------------------
def check_09_rank_loss(fn: Callable) -> None:
    """Exercise 09.1: each rank's loss so that DDP's average over ranks is the global token-weighted mean."""
    def test():
        g = torch.Generator().manual_seed(0)
        for world in (2, 3, 4, 8):
            counts = torch.randint(0, 60, (world,), generator=g)
            counts[0] += 1
            sums = torch.rand(world, generator=g) * counts
            n_global = int(counts.sum())
            ddp_average = sum(float(fn(float(s), n_global, world)) for s in sums) / world
            assert _close(ddp_average, float(sums.sum()) / n_global, 1e-5), \
                f"with {world} ranks DDP's average of your losses is not the global mean token loss."
    return verdict("09.1", "DDP divides the sum of the rank gradients by world; divide by the global token count "
                   "and undo that average.", test, fn)


def check_09_idle_ranks(fn: Callable) -> None:
    """Exercise 09.2: how many ranks get no micro-batch when a step's micro-batches are dealt by tokens."""
    from minimind_lib.distributed import assign_to_ranks

    def test():
        for costs, ranks in (([1, 1, 1], 4), ([5, 3, 2, 2], 2), ([7], 3), ([1, 2, 3, 4, 5], 8)):
            want = sum(len(s) == 0 for s in assign_to_ranks(costs, ranks))
            assert fn(costs, ranks) == want, f"{len(costs)} micro-batches on {ranks} ranks: not right."
    return verdict("09.2", "deal the micro-batches with deal (or D.assign_to_ranks) and count the empty shares.",
                   test, fn)


def check_09_fsdp_state(fn: Callable) -> None:
    """Exercise 09.3: bytes of weights, gradients and AdamW states that each of `world` FSDP2 ranks holds."""
    from minimind_lib.memory import estimate_memory
    from minimind_lib.model import MiniMindConfig

    def test():
        configs = _configs() + [MiniMindConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                               num_key_value_heads=4)]
        for c in configs:
            est = estimate_memory(c, 1, 8)
            for world in (1, 2, 8):
                want = (est["params_bytes"] + est["grads_bytes"] + est["optimizer_bytes"]) / world
                got = fn(c, world)
                assert _close(float(got), want, 1e-9), f"hidden {c.hidden_size}, {world} ranks: {got!r} is not right."
    return verdict("09.3", "add up the bytes per parameter of fp32 weights, gradients and AdamW's two moments; "
                   "FSDP2 splits them over the ranks.", test, fn)


def check_09_unmatched_broadcasts(fn: Callable[[list[int]], int]) -> None:
    """Exercise 09.4: how many of rank 0's broadcasts have no partner, for the forwards each rank runs in a step
    (checked on rank counts and forwards drawn afresh)."""
    def test():
        for _ in range(20):
            forwards = [random.randint(0, 9) for _ in range(random.randint(2, 8))]
            # the i-th broadcast of rank 0 is a collective: it completes only if every rank makes an i-th one too
            want = sum(not all(f > i for f in forwards) for i in range(forwards[0]))
            got = fn(list(forwards))
            assert got == want, f"forwards per rank {forwards}: {got!r} is not right."
    return verdict("09.4", "one broadcast per forward on each rank; pair them up in order.", test, fn)


# 10 LoRA and DPO ------------------------------------------------------------------------------------------------------
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_10_lora_trainable(fn: Callable) -> None:
    """Exercise 10.1: the parameters LoRA trains for given projections, from a configuration's shapes alone."""
    from minimind_lib.lora import apply_lora
    from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM

    def test():
        for _ in range(6):
            kv = random.choice((1, 2, 4))
            config = MiniMindConfig(hidden_size=random.choice((64, 96, 512)), num_attention_heads=kv * random.choice(
                (1, 2, 4)), num_key_value_heads=kv, head_dim=random.choice((16, 32, 48)), intermediate_size=
                random.choice((128, 320, 1408)), num_hidden_layers=random.randint(1, 4), vocab_size=300)
            targets = tuple(random.sample(PROJECTIONS, random.randint(1, len(PROJECTIONS))))
            rank = random.randint(1, 16)
            with torch.device("meta"):
                model = apply_lora(MiniMindForCausalLM(config), rank, targets=targets)
            want = sum(p.numel() for p in model.parameters() if p.requires_grad)
            got = fn(config, rank, targets)
            assert got == want, (f"lora_trainable for {config.num_hidden_layers} blocks, hidden {config.hidden_size}, "
                                 f"{config.num_attention_heads} heads of {config.head_dim}, "
                                 f"{config.num_key_value_heads} kv heads, FFN {config.intermediate_size}, rank {rank}, "
                                 f"targets {targets}: {got!r}, not the count the library's LoRA layers train.")
    return verdict("10.1", "an adapted Linear of in -> out trains rank * (in + out); q maps hidden to heads x "
                   "head_dim, k and v to kv_heads x head_dim, o back to hidden, gate and up to the FFN width, down "
                   "back; once per block.", test, fn)


def check_10_margin_for(fn: Callable) -> None:
    """Exercise 10.2: the log-ratio margin at which a pair's DPO loss has fallen to a given value."""
    from minimind_lib.dpo import dpo_loss

    def test():
        for _ in range(8):
            loss, beta = random.uniform(0.005, 2.0), random.uniform(0.02, 1.0)
            m = fn(loss, beta)
            got = float(dpo_loss(torch.tensor(float(m), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64),
                                 torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64), beta))
            assert _close(got, loss, 1e-6), (f"margin_for({loss:.4g}, {beta:.3g}) = {m!r}: at that margin the loss is "
                                             f"{got:.6g}, not {loss:.4g}.")
    return verdict("10.2", "solve -log sigmoid(beta m) = loss for m: sigmoid(beta m) = exp(-loss), so beta m is the "
                   "logit of exp(-loss).", test, fn)


def check_10_reply_kl(fn: Callable) -> None:
    """Exercise 10.3: KL(policy || reference) of a reply's next-token distributions, summed over its positions."""
    def test():
        for _ in range(5):
            t, v = random.randint(1, 12), random.randint(5, 400)
            p, q = torch.randn(t, v) * random.uniform(0.5, 4), torch.randn(t, v) * random.uniform(0.5, 4)
            lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
            want = float((lp.exp() * (lp - lq)).sum())
            got = fn(p, q)
            assert _close(float(got), want, 1e-4), (f"on logits of {t} positions x {v} tokens: {float(got):.6g}, "
                                                    f"not the KL of the policy from the reference.")
            assert abs(float(fn(p, p.clone()))) < 1e-6, "a policy equal to its reference has a KL of 0."
    return verdict("10.3", "log_softmax both over the vocabulary; the policy's probabilities times the difference of "
                   "the log-probabilities, summed over tokens and positions.", test, fn)
