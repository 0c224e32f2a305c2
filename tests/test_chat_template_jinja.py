"""The course's chat template as Jinja (minimind_lib/assets/chat_template.jinja), rendered by `transformers`: the 17
MiniMind-3 conversations byte-equal to MiniMind-3's own strings, and any conversation equal to the course's Python
(tools, tool turns, tool_calls, reasoning, inline <think>, content None, open_thinking), with the same token ids.

Tokenizer directories are written by Tokenizer.save into tmp_path and loaded from there; nothing is downloaded."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # local directories only
transformers = pytest.importorskip("transformers")

from minimind_lib.tokenizer import CHAT_TEMPLATE, DEFAULT_DIR, Tokenizer, load_tokenizer  # noqa: E402

from test_minimind3 import minimind3_tokenizer  # noqa: E402

CASES = json.loads((Path(__file__).parent / "data" / "minimind3_template_cases.json").read_text(encoding="utf-8"))
THINK_OFF, THINK_ON = "{%- set think = false %}", "{%- set think = true %}"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "加法 <a & b>", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
GENERAL = [  # conversations of their own, beside the 17 cases
    [{"role": "user", "content": "Hello, how are you today?"}],
    [{"role": "system", "content": "You are MiniMind."}, {"role": "user", "content": "你好！"},
     {"role": "assistant", "content": "Hello 😀"}, {"role": "user", "content": "  and another,\nplease  "}],
    [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2", "reasoning_content": "\nadd\n\n"},
     {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nsum\n</think>\n\n4"}],
    [{"role": "system", "content": None}, {"role": "user", "content": "17+25?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}},
         {"name": "add", "arguments": {"a": 1, "b": "二"}}]},
     {"role": "tool", "content": "42"}, {"role": "tool", "content": None},
     {"role": "assistant", "content": "\n\n42.", "reasoning_content": "The tool said 42."},
     {"role": "system", "content": "a later system message"}, {"role": "tool", "content": "{\"ok\": true}"}],
]


def hf_pair(tok: Tokenizer, directory: Path):
    """The course's tokenizer, reloaded from the directory its save() wrote, and transformers' from the same files."""
    tok.save(directory)
    return Tokenizer.load(directory), transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The bundled tokenizer: <think> blocks only where reasoning is given."""
    return hf_pair(load_tokenizer(), tmp_path_factory.mktemp("course"))


@pytest.fixture(scope="module")
def minimind3(tmp_path_factory):
    """MiniMind-3's layout (think/tool markers as added tokens) with the template's think switch on."""
    tok3 = minimind3_tokenizer(load_tokenizer(), tmp_path_factory.mktemp("tok3"))
    tok = Tokenizer(tok3.hf, dict(tok3.config, chat_template=CHAT_TEMPLATE.replace(THINK_OFF, THINK_ON)))
    return hf_pair(tok, tmp_path_factory.mktemp("minimind3"))


def both(pair, messages, tokenize=False, **kwargs) -> tuple:
    """(the course's rendering, transformers' rendering) of one conversation: text, or token ids."""
    ours, hf = pair
    theirs = hf.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    return ours.apply_chat_template(messages, tokenize=tokenize, **kwargs), theirs["input_ids"] if tokenize else theirs


def case_args(case: dict) -> dict:
    return {"add_generation_prompt": case["add_generation_prompt"], "tools": case["tools"],
            "open_thinking": case["open_thinking"]}


def test_the_asset_holds_the_template_and_its_switch_survives_save(course, minimind3):
    assert load_tokenizer().chat_template == CHAT_TEMPLATE == json.loads(
        (DEFAULT_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert CHAT_TEMPLATE.count(THINK_OFF) == 1 and THINK_ON not in CHAT_TEMPLATE
    assert not course[0].think and minimind3[0].think  # the switch survives save and load


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_minimind3_case_renders_byte_equal_in_transformers(minimind3, case):
    ours, theirs = both(minimind3, case["messages"], **case_args(case))
    assert theirs == case["expected"] == ours
    ours_ids, theirs_ids = both(minimind3, case["messages"], tokenize=True, **case_args(case))
    assert theirs_ids == ours_ids


@pytest.mark.parametrize("mode", ["course", "minimind3"])
def test_general_conversations_render_as_the_course_does(request, mode):
    pair = request.getfixturevalue(mode)
    conversations = [*GENERAL, *(c["messages"] for c in CASES["cases"])]
    for messages in conversations:
        for kwargs in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "open_thinking": True},
                       {"tools": TOOLS}, {"tools": TOOLS, "add_generation_prompt": True}):
            ours, theirs = both(pair, messages, **kwargs)
            assert theirs == ours, (messages, kwargs)
            ours_ids, theirs_ids = both(pair, messages, tokenize=True, **kwargs)
            assert theirs_ids == ours_ids, (messages, kwargs)
    # the course's own rules, seen in transformers' string
    text = pair[1].apply_chat_template(GENERAL[3], tokenize=False, tools=TOOLS)
    assert text.count("<|im_start|>system") == 2 and text.count("<|im_start|>user\n<tool_response>") == 2
    assert "<tool_response>\n42\n</tool_response>\n<tool_response>\n\n</tool_response><|im_end|>" in text
    assert ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 17, \"b\": 25}}\n</tool_call>\n<tool_call>\n"
            "{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": \"二\"}}\n</tool_call><|im_end|>") in text
    assert "<think>\nThe tool said 42.\n</think>\n\n42.<|im_end|>" in text
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>" in text) == (mode == "minimind3")


@pytest.mark.parametrize("mode", ["course", "minimind3"])
def test_random_conversations_render_as_the_course_does(request, mode):
    """Seeded random conversations: every role, content None, newlines around <think>, both tool_call layouts."""
    pair, rng = request.getfixturevalue(mode), random.Random(0)
    texts = ["", "\n", "\n\nx", "a\n", "你好 😀", "<think>\nr\n</think>\n\nans", "<think>r</think>", "x</think>\ny",
             "<think>a</think>b</think>c", "q'\"{{x}}\\n", None]

    def message(role: str) -> dict:
        m = {"role": role, "content": rng.choice(texts)}
        if role == "assistant" and rng.random() < 0.5:
            m["reasoning_content"] = rng.choice(["", "\n", "r", "\nr\n\n", None])
        if role == "assistant" and rng.random() < 0.5:
            calls = [{"name": "add", "arguments": rng.choice([{"a": 1, "b": [2.5, None]}, {}, '{"a": 1}'])}
                     for _ in range(rng.randint(0, 2))]
            m["tool_calls"] = [{"type": "function", "function": c} if rng.random() < 0.5 else c for c in calls]
        return m

    for _ in range(60):
        messages = [message(rng.choice(["system", "user", "assistant", "tool"])) for _ in range(rng.randint(1, 5))]
        kwargs = {"tools": rng.choice([None, [], TOOLS]), "add_generation_prompt": rng.random() < 0.5,
                  "open_thinking": rng.random() < 0.3}
        ours, theirs = both(pair, messages, **kwargs)
        assert theirs == ours, (messages, kwargs)
