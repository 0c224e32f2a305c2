"""Chatting with a trained model: plain functions (`chat_reply`, `chat`) and an ipywidgets chat box.

The functions are what everything uses (the CLI's chat command, notebook 08's asserts, nbval, which renders
no widgets); the widget is a thin view on top: a text box, temperature and top-p sliders, and an answer
that streams in token by token.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .generate import TextStream, generate_ids


def chat_prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The chat template's token ids for `messages`, ending with '<|im_start|>assistant\\n' (the model's turn)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, str):
        ids = tokenizer.encode(ids, add_special_tokens=False)
    return list(ids)


def chat_reply(model: torch.nn.Module, tokenizer, messages: Sequence[dict], *, temperature: float = 0.7,
               top_p: float = 0.9, top_k: int = 0, max_new_tokens: int = 128, seed: int | None = None,
               stream: Callable[[str], None] | None = None, details: dict | None = None) -> str:
    """The assistant's answer to a conversation (list of {"role", "content"}), stopping at <|im_end|>.

    seed fixes the sampling (same seed, same answer); temperature 0 is greedy. `stream(piece)` receives the
    text as it grows, whole characters only (a Chinese character spans several byte tokens). A `details` dict
    is filled with n_tokens (generated) and ended (True when the model closed its turn with <|im_end|>).
    """
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("messages must end with a 'user' turn (the question to answer)")
    ids = chat_prompt_ids(tokenizer, messages)
    on_token = TextStream(tokenizer, stream)
    emitted = on_token.ids

    new = generate_ids(model, torch.tensor(ids, dtype=torch.long), max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       stop_token_ids=[tokenizer.eos_token_id], stream=on_token)
    if details is not None:
        details.update(n_tokens=len(emitted), ended=bool(emitted) and emitted[-1] == tokenizer.eos_token_id)
    return tokenizer.decode(new[0].tolist(), skip_special_tokens=True).strip()


def chat(prompt: str, model: torch.nn.Module, tokenizer, *, history: list[dict] | None = None,
         system: str | None = None, **kwargs) -> str:
    """One answer to `prompt`; with `history` (a list that is extended in place) the conversation goes on."""
    messages = [] if history is None else history
    if system and not messages:
        messages.append({"role": "system", "content": system})
    turn = messages + [{"role": "user", "content": prompt}]
    answer = chat_reply(model, tokenizer, turn, **kwargs)
    if history is not None:
        history.append({"role": "user", "content": prompt})
        history.append({"role": "assistant", "content": answer})
    return answer


class ChatBox:
    """An ipywidgets chat box around a model; `ask(prompt)` works the same with or without the widget shown."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, temperature: float = 0.7, top_p: float = 0.9,
                 max_new_tokens: int = 128, seed: int | None = None, keep_history: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.max_new_tokens, self.seed = temperature, top_p, max_new_tokens, seed
        self.keep_history = keep_history
        self.history: list[dict] = []
        self.transcript: list[tuple[str, str]] = []
        self._widget = None

    def ask(self, prompt: str, seed: int | None = None) -> str:
        """Answer `prompt` with the current slider values; streams into the widget when it is built."""
        if self._widget is not None:
            self.temperature, self.top_p = self._temp.value, self._top_p.value
        pieces: list[str] = []

        def stream(piece: str) -> None:
            pieces.append(piece)
            if self._widget is not None:
                self._answer.value = self._render(prompt, "".join(pieces))

        answer = chat(prompt, self.model, self.tokenizer, history=self.history if self.keep_history else None,
                      temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                      seed=self.seed if seed is None else seed, stream=stream)
        self.transcript.append((prompt, answer))
        if self._widget is not None:
            self._answer.value = self._render(prompt, answer)
        return answer

    @staticmethod
    def _render(prompt: str, answer: str) -> str:
        import html

        return (f"<b>you:</b> {html.escape(prompt)}<br><b>model:</b> "
                f"<span style='white-space: pre-wrap'>{html.escape(answer)}</span>")

    def widget(self):
        """The chat box: a text input (Enter or Send), temperature / top-p sliders, the streamed answer."""
        import ipywidgets as w

        if self._widget is None:
            self._input = w.Text(placeholder="Ask something and press Enter", layout=w.Layout(width="70%"))
            self._send = w.Button(description="Send")
            self._temp = w.FloatSlider(value=self.temperature, min=0.0, max=1.5, step=0.05, description="temperature")
            self._top_p = w.FloatSlider(value=self.top_p, min=0.05, max=1.0, step=0.05, description="top-p")
            self._answer = w.HTML(value="")

            def on_send(_=None) -> None:
                text = self._input.value.strip()
                if text:
                    self._input.value = ""
                    self.ask(text)

            self._send.on_click(on_send)
            self._input.continuous_update = False
            self._input.observe(lambda change: on_send() if change["name"] == "value" and change["new"] else None,
                                names="value")
            self._widget = w.VBox([w.HBox([self._input, self._send]), w.HBox([self._temp, self._top_p]),
                                   self._answer])
        return self._widget
