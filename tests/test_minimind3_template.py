"""MiniMind-3's chat template, string for string: 17 conversations rendered by MiniMind-3's own jinja template
(tests/data/minimind3_template_cases.json: plain, system, multi-turn, tools, tool calls in both layouts, tool turns,
reasoning, inline <think>, content None, a later system message, open_thinking) and by ours, byte-equal and with the
same token ids; then the rules behind them, on conversations of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minimind_lib.tokenizer import load_tokenizer

from test_minimind3 import minimind3_tokenizer

CASES = json.loads((Path(__file__).parent / "data" / "minimind3_template_cases.json").read_text(encoding="utf-8"))
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok3(tmp_path_factory):
    return minimind3_tokenizer(load_tokenizer(), tmp_path_factory.mktemp("tok3"))


def render(tok, case: dict, tokenize: bool = False):
    return tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                   tokenize=tokenize, tools=case["tools"], open_thinking=case["open_thinking"])


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_minimind3_template_case(tok3, case):
    assert render(tok3, case) == case["expected"]
    ids = render(tok3, case, tokenize=True)
    assert ids == tok3.encode(case["expected"])  # the markers are single ids, the text between them the same tokens
    assert tok3.decode(ids) == case["expected"]


def test_cases_cover_what_they_say():
    assert len(CASES["cases"]) == 17
    fields = {k for c in CASES["cases"] for m in c["messages"] for k in m}
    assert fields == {"role", "content", "tool_calls", "reasoning_content"}
    assert any(c["open_thinking"] for c in CASES["cases"]) and any(c["tools"] for c in CASES["cases"])


def test_leading_newlines_after_think_are_stripped_before_the_empty_test(tok3):
    call = {"name": "f", "arguments": {}}
    for content in ("<think>x</think>", "<think>x</think>\n\n\n", "<think>\nx\n</think>\n"):  # all empty after </think>
        text = tok3.apply_chat_template([{"role": "assistant", "content": content, "tool_calls": [call]}])
        assert text == '<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}' \
                       "\n</tool_call><|im_end|>\n", content
    # content left after </think> is kept, and a newline parts it from the call
    text = tok3.apply_chat_template([{"role": "assistant", "content": "<think>x</think>\nok", "tool_calls": [call]}])
    assert "\n</think>\n\nok\n<tool_call>" in text
    # without inline thoughts the content is tested as given, as MiniMind-3 does: "\n" is not empty there
    text = tok3.apply_chat_template([{"role": "assistant", "content": "\n", "tool_calls": [call]}])
    assert "</think>\n\n\n<tool_call>" in text


def test_content_none_renders_empty_in_every_role(tok3):
    for role in ("system", "user", "assistant", "tool"):
        msgs = [{"role": "user", "content": "q"}, {"role": role, "content": None}]
        assert tok3.apply_chat_template(msgs) == tok3.apply_chat_template([msgs[0], dict(msgs[1], content="")])
    assert tok3.apply_chat_template([{"role": "system", "content": None}, {"role": "user", "content": "q"}],
                                    tools=TOOLS).startswith("<|im_start|>system\n\n\n# Tools")


def test_a_later_system_message_is_an_ordinary_turn(tok3):
    tok = load_tokenizer()
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "q"}, {"role": "system", "content": "b"}]
    assert tok.apply_chat_template(msgs) == ("<|im_start|>system\na<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                                             "<|im_start|>system\nb<|im_end|>\n")
    # with tools, only the first system message goes into the tools block; a later one stays a turn
    text = tok3.apply_chat_template(msgs, tools=TOOLS)
    assert text.startswith("<|im_start|>system\na\n\n# Tools") and text.endswith("<|im_start|>system\nb<|im_end|>\n")


def test_open_thinking_on_both_templates(tok3):
    tok, msgs = load_tokenizer(), [{"role": "user", "content": "q"}]
    for t in (tok, tok3):
        assert t.apply_chat_template(msgs, add_generation_prompt=True, open_thinking=True).endswith(
            "<|im_start|>assistant\n<think>\n")
        assert t.apply_chat_template(msgs, open_thinking=True) == t.apply_chat_template(msgs)  # only the prompt
    assert tok.apply_chat_template(msgs, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "q", "reasoning_content": "r"}],
     r"messages\[0\]\['reasoning_content'\] is only allowed on an assistant turn, not on a 'user' turn"),
    ([{"role": "user", "content": "q", "tool_calls": [{"name": "f", "arguments": {}}]}],
     r"messages\[0\]\['tool_calls'\] is only allowed on an assistant turn, not on a 'user' turn"),
    ([{"role": "assistant", "content": "a", "tool_calls": {"name": "f"}}],
     r"messages\[0\]\['tool_calls'\] must be a list, got \{'name': 'f'\}"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be str, got int"),
])
def test_bad_fields_are_named(tok3, messages, match):
    with pytest.raises((ValueError, TypeError), match=match):
        tok3.apply_chat_template(messages)
