"""A chat box for notebook 08_sft: a text field, temperature and top-p sliders, and an answer that streams in.

A thin ipywidgets view on `minimind_lib.generate.chat`, which does the work (the CLI's chat command and the
notebook's checks call it directly; nbval renders no widgets). `ChatBox.ask` works the same with or without the
widget shown. Course material beside the notebooks, like exercise_checks.py: user interface, not a mechanism the
course builds, so it is not part of minimind_lib.
"""

from __future__ import annotations

import html

import torch

from minimind_lib.generate import chat


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
            if self._widget is not None:  # without the leading whitespace that the final answer strips: no jump
                self._answer.value = self._render(prompt, "".join(pieces).lstrip())

        answer = chat(prompt, self.model, self.tokenizer, history=self.history if self.keep_history else None,
                      temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                      seed=self.seed if seed is None else seed, stream=stream)
        self.transcript.append((prompt, answer))
        if self._widget is not None:
            self._answer.value = self._render(prompt, answer)
        return answer

    @staticmethod
    def _render(prompt: str, answer: str) -> str:
        return (f"<b>you:</b> {html.escape(prompt)}<br><b>model:</b> "
                f"<span style='white-space: pre-wrap'>{html.escape(answer)}</span>")

    def widget(self):
        """The chat box: a text input (Enter or Send), temperature / top-p sliders, the streamed answer."""
        import ipywidgets as w  # only when a widget is shown: the CLI and tests never need it

        if self._widget is None:
            self._input = w.Text(placeholder="Ask something and press Enter", layout=w.Layout(width="70%"))
            self._send = w.Button(description="Send")
            label = {"description_width": "initial"}  # the label's own width: "temperature" is never cut
            self._temp = w.FloatSlider(value=self.temperature, min=0.0, max=1.5, step=0.05, description="temperature",
                                       style=label)
            self._top_p = w.FloatSlider(value=self.top_p, min=0.05, max=1.0, step=0.05, description="top-p", style=label)
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
