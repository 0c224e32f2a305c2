"""Streamed text and the chat box (notebook 08_sft): characters split across byte-level tokens arrive whole, bytes
that form no character show as U+FFFD (as decoding the whole answer shows them), and the chat box answers the typed
message, re-seeded per message.
"""

from __future__ import annotations

import sys
from pathlib import Path
import pytest
import torch

from minimind_lib.generate import TextStream, chat, chat_prompt_ids, generate, generate_ids
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.tokenizer import load_tokenizer
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))  # course material
from chat_box import ChatBox  # noqa: E402

SPLIT_TEXT = "Straße café 😀 鼹鼠 龘"  # characters that the course tokenizer splits across tokens


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=tok.vocab_size)).eval()


def stream_ids(tok, ids: list[int]) -> tuple[list[str], str]:
    pieces: list[str] = []
    stream = TextStream(tok, pieces.append)
    for i in ids:
        stream(i)
    return pieces, stream.close()


def test_characters_split_across_tokens_arrive_whole(tok):
    ids = tok.encode(SPLIT_TEXT)
    split = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(split) >= 6, "the test string no longer splits characters across tokens"
    pieces, text = stream_ids(tok, ids)
    assert text == "".join(pieces) == SPLIT_TEXT
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "😀" in pieces and len(pieces) < len(ids)  # the emoji's 4 byte tokens became one piece


def test_special_tokens_add_no_text(tok):
    ids = [tok.bos_token_id, *tok.encode("你好"), tok.eos_token_id]
    assert stream_ids(tok, ids) == (["你", "好"], "你好")


def test_bytes_that_form_no_character_show_as_replacement_characters(tok):
    lead = tok.encode("鼹")[:1]  # the first token of a 3-byte character: its lead byte(s), unfinished
    assert "\ufffd" in tok.decode(lead)
    ids = lead + tok.encode("ok") + lead
    pieces, text = stream_ids(tok, ids)
    assert text == "\ufffdok\ufffd"  # the second one is flushed by close(): nothing is held back
    assert "".join(pieces) == text == tok.decode(ids)


def test_generate_returns_what_it_streamed(tok, model):
    pieces: list[str] = []
    text = generate(model, tok, "鼹鼠", max_new_tokens=40, temperature=1.0, seed=1, stream=pieces.append)
    assert "".join(pieces) == text
    assert text == generate(model, tok, "鼹鼠", max_new_tokens=40, temperature=1.0, seed=1)


def test_streamed_text_is_the_decoded_answer(tok, model):
    """What the stream shows, piece by piece, is what decoding the whole answer at once shows, U+FFFD included."""
    prompt = torch.tensor([tok.bos_token_id, *tok.encode("鼹鼠")])
    replaced = 0
    for seed in range(8):
        pieces: list[str] = []
        stream = TextStream(tok, pieces.append)
        ids = generate_ids(model, prompt, 40, temperature=1.0, seed=seed, stream=stream)[0].tolist()
        text = stream.close()
        assert "".join(pieces) == text == tok.decode(ids, skip_special_tokens=True)
        replaced += text.count("\ufffd")
    assert replaced > 0, "the untrained model no longer emits invalid bytes: this test checks nothing about them"


def test_different_prompts_give_different_answers_with_the_same_seed(tok, model):
    kw = dict(temperature=0.7, top_p=0.9, max_new_tokens=30, seed=0)
    a = chat("Hello, who are you?", model, tok, **kw)
    b = chat("Tell me a joke about computers.", model, tok, **kw)
    assert a and b and a != b
    assert chat("Hello, who are you?", model, tok, **kw) == a


def test_chat_box_answers_the_typed_message_and_reseeds_per_message(tok, model):
    box = ChatBox(model, tok, temperature=0.7, top_p=0.9, max_new_tokens=30, seed=0)
    prompts = ["Hello, who are you?", "Tell me a joke about computers.", "Hello, who are you?"]
    seen: list[torch.Tensor] = []

    def record_input(module, args, kwargs) -> None:
        seen.append(args[0] if args else kwargs["input_ids"])

    hook = model.register_forward_pre_hook(record_input, with_kwargs=True)
    try:
        answers = [box.ask(p) for p in prompts]
    finally:
        hook.remove()
    prompt_inputs = [ids[0].tolist() for ids in seen if ids.shape[1] > 1]  # the prompt pass of each message
    assert prompt_inputs == [chat_prompt_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
    assert answers[0] != answers[1] and answers[0] == answers[2]  # the seed restarts with every message
    assert box.transcript == list(zip(prompts, answers))


def test_chat_box_widget_sends_the_typed_text(tok, model):
    pytest.importorskip("ipywidgets")
    box = ChatBox(model, tok, temperature=0.7, top_p=0.9, max_new_tokens=20, seed=0)
    box.widget()
    box._input.value = "Tell me a joke about computers."  # what the browser sends when Enter is pressed
    assert box._input.value == ""  # the field is cleared for the next message
    expected = chat("Tell me a joke about computers.", model, tok, temperature=0.7, top_p=0.9, max_new_tokens=20,
                    seed=0)
    assert box.transcript == [("Tell me a joke about computers.", expected)]
    assert "you:</b> Tell me a joke about computers." in box._answer.value
