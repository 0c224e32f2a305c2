"""Sampling text from a MiniMind model (notebook 03_model) and chatting with it (notebook 08_sft).

Greedy, temperature, top-k and top-p sampling with a KV cache; `chat_reply` answers a conversation
in MiniMind's chat template. The CLI's chat command, notebook 08 and the chat box
(notebooks/chat_box.py) all call these functions.
"""

from __future__ import annotations

import codecs
import warnings
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .checks import require


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from logits (B, V): greedy when temperature == 0, else filtered
    sampling."""
    if not 0 <= temperature < float("inf"):  # NaN fails every comparison
        raise ValueError(f"temperature must be >= 0 and finite, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (nucleus
        # sampling).
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # tokens entirely beyond the nucleus; the first stays
        drop = cum - sorted_logits.softmax(-1) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, use_cache: bool = True,
                 stop_token_ids: Iterable[int] | None = None,
                 stream: Callable[[int], None] | None = None) -> torch.LongTensor:
    """Extend input_ids (T,) or (1, T) by up to max_new_tokens; returns only the new ids, shape
    (1, n_new). Stops after emitting a stop token (included in the result). `stream(token_id)` is
    called per new token. With use_cache the prompt is run once and each step feeds one token plus
    the KV cache; without it the whole sequence is re-run every step (slower, the same tokens)."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    require(input_ids.dim() == 2 and input_ids.shape[0] == 1, "generate_ids takes one sequence, "
            f"(T,) or (1, T); got shape {tuple(input_ids.shape)}")
    require(input_ids.shape[1] > 0,
            "generate_ids needs a non-empty prompt (at least one token, e.g. the bos token)")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    # RoPE has no position past max_pos
    if max_pos is not None and input_ids.shape[1] + max_new_tokens > max_pos:
        if input_ids.shape[1] >= max_pos:
            raise ValueError(f"the prompt has {input_ids.shape[1]} tokens: no room to generate "
                             "within the model's "
                             f"max_position_embeddings={max_pos}")
        warnings.warn(f"generating {max_pos - input_ids.shape[1]} of the {max_new_tokens} new "
                      "tokens asked for: the "
                      f"prompt's {input_ids.shape[1]} tokens leave no more room in {max_pos} "
                      "positions", stacklevel=3)
        max_new_tokens = max_pos - input_ids.shape[1]
    stops = set(stop_token_ids or ())
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        new: list[int] = []
        past, step_input, seq = None, input_ids, input_ids
        for _ in range(max_new_tokens):
            if use_cache:
                out = model(step_input, past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
            else:
                out = model(seq, logits_to_keep=1)
            token = sample_next(out.logits[:, -1], temperature, top_p, top_k, generator)  # (1,)
            tok = int(token)
            new.append(tok)
            if stream is not None:
                stream(tok)
            step_input = token[:, None]
            seq = torch.cat([seq, step_input], dim=1)
            if tok in stops:
                break
    finally:
        model.train(was_training)
    return torch.tensor([new], dtype=torch.long, device=device)


class TextStream:
    """Turns new token ids into text for `on_text`, whole characters only (the generate_ids `stream`
    callback).

    An incremental UTF-8 decoder holds the bytes of a character that a byte-level token leaves
    unfinished, so a character split across tokens arrives whole. Bytes that never form a character
    (a model can emit them) show as U+FFFD, as chat programs show them; `close()` flushes what is
    still held (an unfinished character: U+FFFD).
"""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None = None) -> None:
        self.tokenizer, self.on_text, self.ids, self.text = tokenizer, on_text, [], ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token_id: int) -> None:
        """Record one new token and stream the text it completes (special tokens add none)."""
        self.ids.append(token_id)
        if self.tokenizer.decode([token_id], skip_special_tokens=True):
            self._emit(self._utf8.decode(self.tokenizer.token_bytes(token_id)))

    def close(self) -> str:
        """Flush the bytes still held (an unfinished last character shows as U+FFFD); return the
        whole text."""
        self._emit(self._utf8.decode(b"", final=True))
        return self.text

    def _emit(self, piece: str) -> None:
        self.text += piece
        if piece and self.on_text is not None:
            self.on_text(piece)


def generate(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 64,
             temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None, use_cache: bool = True,
             stop_token_ids: Iterable[int] | None = None, stream: Callable[[str],
                                                                           None] | None = None,
             add_bos: bool = True) -> str:
    """Continue `prompt` and return the decoded new text (greedy when temperature == 0).

    stop_token_ids defaults to the tokenizer's eos token. `stream(text_piece)` receives the text as
    it grows, whole characters only (TextStream); the returned text is what was streamed.
"""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids  # the pretraining samples start with bos
    if stop_token_ids is None:  # the end of a document (eos), if the tokenizer has one
        stop_token_ids = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id",
                                                             None) is not None else []
    text = TextStream(tokenizer, stream)
    generate_ids(model, torch.tensor(ids, dtype=torch.long), max_new_tokens, temperature, top_p,
                 top_k, seed,
                 use_cache, stop_token_ids, text)
    return text.close()


def chat_prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The chat template's token ids for `messages`, ending with '<|im_start|>assistant\\n' (the
    model's turn)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, str):
        ids = tokenizer.encode(ids, add_special_tokens=False)
    return list(ids)


def chat_reply(model: torch.nn.Module, tokenizer, messages: Sequence[dict], *,
               temperature: float = 0.7,
               top_p: float = 0.9, top_k: int = 0, max_new_tokens: int = 128,
               seed: int | None = None,
               stream: Callable[[str], None] | None = None, details: dict | None = None) -> str:
    """The assistant's answer to a conversation (list of {"role", "content"}), stopping at
    <|im_end|>.

    seed fixes the sampling (same seed, same answer); temperature 0 is greedy. `stream(piece)`
    receives the text as it grows, whole characters only (a Chinese character spans several byte
    tokens). A `details` dict is filled with n_tokens (generated) and ended (True when the model
    closed its turn with <|im_end|>).
"""
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("messages must end with a 'user' turn (the question to answer)")
    on_token = TextStream(tokenizer, stream)
    prompt_ids = torch.tensor(chat_prompt_ids(tokenizer, messages), dtype=torch.long)
    generate_ids(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=top_p,
                 top_k=top_k, seed=seed, stop_token_ids=[tokenizer.eos_token_id], stream=on_token)
    if details is not None:
        details.update(n_tokens=len(on_token.ids),
                       ended=on_token.ids[-1:] == [tokenizer.eos_token_id])
    return on_token.close().strip()


def chat(prompt: str, model: torch.nn.Module, tokenizer, *, history: list[dict] | None = None,
         system: str | None = None, **kwargs) -> str:
    """One answer to `prompt`; with `history` (a list that is extended in place) the conversation
    goes on."""
    messages = [] if history is None else history
    if system and not messages:
        messages.append({"role": "system", "content": system})
    turn = messages + [{"role": "user", "content": prompt}]
    answer = chat_reply(model, tokenizer, turn, **kwargs)
    if history is not None:
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return answer
