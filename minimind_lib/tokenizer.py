"""The course's tokenizer, built in notebook 01_tokenizer: MiniMind's 6400-token byte-level BPE,
with `tokenizers`.

Trained and saved as MiniMind's scripts/train_tokenizer.py does (ByteLevel; ids 0, 1, 2 =
<|endoftext|>, <|im_start|>, <|im_end|>), so `load_tokenizer(minimind_repo / "model")` loads
MiniMind's own (MiniMind-3's template too: tools, tool turns, <think>). `encode` reads a typed
"<|im_end|>" as id 2, like `transformers`; allow_special=False and chat content keep it text (typed
markers cannot end a turn)."""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from .bpe import UNICODE_TO_BYTE
from .fileio import atomic_write_text
from .paths import ASSETS_DIR

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # in this order, so their ids are 0, 1, 2
PIECE_CHARS = 2**18  # a longer text is encoded in pieces (Tokenizer.pieces): ~400 bytes a token
# the chat roles (corpus.py validates SFT records against these)
ROLES = ("system", "user", "assistant", "tool")
# tokenizer_config.json keys naming special tokens
ROLE_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
DEFAULT_VOCAB_SIZE = 6400
DEFAULT_DIR = ASSETS_DIR / "tokenizer"
TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"

# The chat template as Jinja, for `transformers` users: chat_pieces' rules
# (tests/test_chat_template_jinja.py compares)
CHAT_TEMPLATE = (ASSETS_DIR / "chat_template.jinja").read_text(encoding="utf-8")
TOOLS_TURN = ('# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou '
              'are provided with '
              'function signatures within <tools></tools> XML '
              'tags:\n<tools>{tools}\n</tools>\n\nFor each function '
              'call, return a json object with function name and arguments within '
              '<tool_call></tool_call> XML '
              'tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
              '<args-json-object>}\n</tool_call>')


def default_config(hf: tokenizers.Tokenizer, model_max_length: int = 32768) -> dict:
    """tokenizer_config.json in MiniMind's layout, for a tokenizer whose special tokens are
    SPECIAL_TOKENS."""
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}
    return {"add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": {str(hf.token_to_id(t)): {"content": t, **entry}
                                     for t in SPECIAL_TOKENS},
            "additional_special_tokens": [], "bos_token": IM_START,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END, "legacy": True, "model_max_length": model_max_length,
            "pad_token": ENDOFTEXT,
            "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": ENDOFTEXT,
            "chat_template": CHAT_TEMPLATE}


def token_ids(hf: tokenizers.Tokenizer, config: dict, where: Path) -> dict[str, int]:
    """Ids of the config's bos/eos/pad/unk tokens and of SPECIAL_TOKENS, each checked against
    tokenizer.json, as is every entry of its added_tokens_decoder (ids are read, not assumed)."""
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ValueError(f"{where}: added_tokens_decoder must be an object, got "
                         f"{type(decoder).__name__}")
    for key, entry in decoder.items():
        if isinstance(entry, dict):
            content = entry.get("content")
        else:
            content = None
        if not isinstance(content, str) or not str(key).isdigit():
            raise ValueError(f"{where}: bad added_tokens_decoder entry {key!r}: {entry!r}")
        if hf.token_to_id(content) != int(key):
            raise ValueError(f"{where}: added_tokens_decoder says {content!r} has id {key} "
                             f"but {TOKENIZER_FILE} gives it id {hf.token_to_id(content)}")
    ids = {}
    for key in ROLE_KEYS:
        if key not in config:
            raise ValueError(f"{where}: missing key {key!r}")
        value = config[key]  # a string, or a dict with 'content' as `transformers` writes it
        if isinstance(value, dict):
            name = value.get("content")
        else:
            name = value
        if not isinstance(name, str):
            raise ValueError(f"{where}: key {key!r} must be a token string, got {value!r}")
        ids[key] = hf.token_to_id(name)
        if ids[key] is None:
            raise ValueError(f"{where}: {key}={name!r} is not a token of {TOKENIZER_FILE}")
    for name in SPECIAL_TOKENS:
        ids[name] = hf.token_to_id(name)
        if ids[name] is None:
            raise ValueError(f"{where}: the tokenizer has no {name!r} token (MiniMind needs "
                             f"{SPECIAL_TOKENS})")
    return ids


def check_text(text: str, where: str = "text") -> None:
    """Refuse what has no UTF-8 bytes: a non-string, or a string with a lone surrogate."""
    if not isinstance(text, str):
        raise TypeError(f"{where} must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode: {text[e.start]!r} at index {e.start} is a "
                         "lone "
                         "surrogate, which has no UTF-8 bytes") from None


def check_messages(messages: Sequence[dict]) -> None:
    """Refuse a conversation the chat template cannot render, naming the message and key at fault
    (content None and a later system message are fine: MiniMind-3 renders them as empty content and
    as an ordinary turn)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                        f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with keys 'role' and 'content', got "
                             f"{m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]['role']={m['role']!r} is not one of {ROLES}")
        if m["content"] is not None:
            check_text(m["content"], f"messages[{i}]['content']")
        check_turn_extras(m, f"messages[{i}]")


def check_turn_extras(turn: dict, where: str) -> None:
    """Refuse malformed MiniMind-3 fields of a turn: reasoning_content (text), tool_calls (a list),
    both an assistant's."""
    for key in ("reasoning_content", "tool_calls"):
        if turn.get(key) is not None and turn["role"] != "assistant":  # the template would drop it
            raise ValueError(f"{where}[{key!r}] is only allowed on an assistant turn, not on a "
                             f"{turn['role']!r} turn")
    reasoning = turn.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}['reasoning_content'] must be a string, got "
                         f"{type(reasoning).__name__}")
    check_text(reasoning or "", f"{where}['reasoning_content']")
    calls = turn.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ValueError(f"{where}['tool_calls'] must be a list, got {calls!r:.80}")
    for k, call in enumerate(calls or []):
        if isinstance(call, dict):
            call = call.get("function", call)
        else:
            call = call
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments"), (str, dict))):
            raise ValueError(f"{where}['tool_calls'][{k}] must be "
                             f"{{'name': str, 'arguments': str or object}}")


def chat_pieces(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                add_generation_prompt: bool = False,
                think: bool = False, open_thinking: bool = False) -> list[tuple[str, bool]]:
    """The chat template as (text, is_content) pieces: ChatML, plus MiniMind-3's tools block, tool
    turns (inside a user turn), <tool_call>s and <think> blocks (on every assistant turn when think,
    else only where reasoning is given). open_thinking: the generation prompt opens a <think> block.
    """
    out = []
    if tools:  # the first system message, if any, goes inside the tools block
        system = [p for m in messages[:1] if m["role"] == "system" for p in ((m["content"] or "",
                                                                              True), ("\n\n",
                                                                                      False))]
        body = TOOLS_TURN.replace("{tools}", "".join("\n" + json.dumps(t, ensure_ascii=False)
                                                     for t in tools))
        out += [(f"{IM_START}system\n", False), *system, (body + f"{IM_END}\n", False)]
        messages = messages[1:] if system else messages
    for i, m in enumerate(messages):
        role, content, reasoning = m["role"], m["content"] or "", m.get("reasoning_content")
        if role == "tool":  # consecutive tool results share one user turn
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append((f"{IM_START}user", False))
            out += [("\n<tool_response>\n", False), (content, True), ("\n</tool_response>", False)]
            if i + 1 == len(messages) or messages[i + 1]["role"] != "tool":
                out.append((f"{IM_END}\n", False))
            continue
        out.append((f"{IM_START}{role}\n", False))
        thinks = role == "assistant" and bool(think or reasoning)
        if thinks:
            # inline thoughts, as MiniMind-3 reads them
            if reasoning is None and "</think>" in content:
                reasoning, content = (
                    content.split("</think>")[0].split("<think>")[-1],
                    content.split("</think>")[-1],
                )
                # before the test for empty content below, as MiniMind-3 does
                content = content.lstrip("\n")
            out += [("<think>\n", False), ((reasoning or "").strip("\n"), True), ("\n</think>\n\n",
                                                                                  False)]
        shown = content  # the test for an empty content below reads it unstripped
        if thinks:
            shown = content.lstrip("\n")
        out.append((shown, True))
        for k, call in enumerate(m.get("tool_calls") or []):
            call = call.get("function", call)  # OpenAI nests {"function": {"name", "arguments"}}
            a = call["arguments"]
            if isinstance(a, str):
                args = a
            else:
                args = json.dumps(a, ensure_ascii=False)
            out += [("\n" if k or content else "", False), ('<tool_call>\n{"name": "', False),
                    (call["name"], True),
                    ('", "arguments": ', False), (args, True), ("}\n</tool_call>", False)]
        out.append((f"{IM_END}\n", False))
    if open_thinking:
        thought = "<think>\n"
    else:
        thought = "<think>\n\n</think>\n\n" if think else ""
    return out + ([(f"{IM_START}assistant\n" + thought, False)] if add_generation_prompt else [])


class Tokenizer:
    """A byte-level BPE tokenizer (a `tokenizers.Tokenizer`) plus MiniMind's special tokens and chat
    template."""

    def __init__(self, hf: tokenizers.Tokenizer, config: dict | None = None,
                 source: str | Path | None = None):
        self.hf = hf
        if source is not None:
            self.source = Path(source)
        else:
            self.source = None
        if config is not None:
            self.config = dict(config)
        else:
            self.config = default_config(hf)
        if self.source is not None:
            where = self.source / CONFIG_FILE
        else:
            where = Path("<tokenizer_config>")
        ids = token_ids(hf, self.config, where)
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = (
            ids[k] for k in ROLE_KEYS
        )
        self.endoftext_id, self.im_start_id, self.im_end_id = (ids[name] for name in SPECIAL_TOKENS)
        self.chat_template: str = self.config.get("chat_template", CHAT_TEMPLATE)
        # <think> on every assistant turn: the course's template says so ('set think = true');
        # MiniMind-3's has </think>
        mode = re.search(r"\{%- set think = (true|false) %\}", self.chat_template)
        self.think = mode[1] == "true" if mode else "</think>" in self.chat_template
        markers = {t.content for t in hf.get_added_tokens_decoder().values()} | set(SPECIAL_TOKENS)
        self._special_re = re.compile(
            f"({'|'.join(map(re.escape, sorted(markers, key=len, reverse=True)))})"
        )
        self._longest_marker = max(map(len, markers))
        # A twin that encodes special-token strings as plain text (chat content): no shared flag to
        # switch, no race
        self._plain = tokenizers.Tokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
              show_progress: bool = False) -> Tokenizer:
        """MiniMind's byte-level BPE trained on texts (deterministic: same texts, same
        tokenizer.json)."""
        if vocab_size <= len(SPECIAL_TOKENS) + 256:
            raise ValueError(f"vocab_size={vocab_size} leaves no room for merges: it must exceed "
                             f"{len(SPECIAL_TOKENS) + 256} (3 special tokens + 256 bytes)")
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      show_progress=show_progress,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(texts, trainer=trainer)
        hf.decoder = decoders.ByteLevel()
        got = hf.get_vocab_size(with_added_tokens=True)
        if got != vocab_size:
            raise ValueError(f"the corpus is too small for vocab_size={vocab_size}: BPE ran out of "
                             "pairs to "
                             f"merge at {got} tokens; give it more text or ask for "
                             f"vocab_size<={got}")
        # MiniMind's train_tokenizer.py too
        assert [hf.token_to_id(name) for name in SPECIAL_TOKENS] == [0, 1, 2]
        return cls(hf)

    @classmethod
    def load(cls, directory: str | Path | None = None) -> Tokenizer:
        """Read a tokenizer directory (ours or MiniMind's; default: minimind_lib/assets/tokenizer,
        the committed 6400-token asset), each error naming the file at fault."""
        directory = Path(DEFAULT_DIR if directory is None else directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist (it should "
                                    "hold "
                                    f"{TOKENIZER_FILE} and {CONFIG_FILE})")
        tok_path, cfg_path = directory / TOKENIZER_FILE, directory / CONFIG_FILE
        for p in (tok_path, cfg_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} not found: a tokenizer directory needs "
                                        f"{TOKENIZER_FILE} and "
                                        f"{CONFIG_FILE}")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception with a serde message
            raise ValueError(f"{tok_path}: not a valid tokenizers file ({e})") from None
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: invalid JSON at line {e.lineno} column {e.colno}: "
                             f"{e.msg}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_path}: must hold a JSON object, got {type(config).__name__}")
        return cls(hf, config, source=directory)

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json and tokenizer_config.json (MiniMind's layout) into directory;
        returns it."""
        directory = Path(directory)  # atomic_write_text creates it
        atomic_write_text(directory / TOKENIZER_FILE, self.hf.to_str(pretty=True))
        config = dict(self.config, chat_template=self.chat_template)
        atomic_write_text(directory / CONFIG_FILE, json.dumps(config, ensure_ascii=False,
                                                              indent=4) + "\n")
        return directory

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (6400 for MiniMind)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        source = None
        if self.source:
            source = str(self.source)
        return f"Tokenizer(vocab_size={self.vocab_size}, source={source!r})"

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (in ByteLevel's printable form, e.g. 'Ġthe'), or None."""
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The token string of an id (ByteLevel form)."""
        token = self.hf.id_to_token(int(token_id))
        if token is None:
            raise ValueError(
                f"token id {token_id} is out of range for vocab_size={self.vocab_size}"
            )
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a (non-special) token stands for."""
        return bytes(UNICODE_TO_BYTE[c] for c in self.id_to_token(token_id))

    def encode(self, text: str, add_special_tokens: bool = False,
               allow_special: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens wraps them as [bos] + ids + [eos] (MiniMind's
        pretrain sample)."""
        check_text(text)
        ids = (self.hf if allow_special else self._plain).encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False,
                     allow_special: bool = True) -> list[list[int]]:
        """encode() for many texts at once (in parallel, inside `tokenizers`)."""
        texts = list(texts)
        for i, text in enumerate(texts):
            check_text(text, f"texts[{i}]")
        ids = [
            e.ids
            for e in (self.hf if allow_special else self._plain).encode_batch(
                texts, add_special_tokens=False
            )
        ]
        if add_special_tokens:
            return [[self.bos_token_id, *i, self.eos_token_id] for i in ids]
        return ids

    def pieces(self, text: str, size: int = PIECE_CHARS) -> list[str]:
        """`text` in pieces of about `size` characters, cut where the encoder splits it anyway (at a
        special token, or where its pre-tokenizer starts a word): their ids, joined, are the whole
        text's, and the encoder's memory stays bounded."""
        cuts = [0]
        while len(text) - cuts[-1] > size:
            cuts.append(self._cut(text, cuts[-1], size))
        return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]

    def _cut(self, text: str, start: int, size: int) -> int:
        """The last place after `start` in text[start:start + size] where the encoder splits anyway
        (the window doubles while it holds none). The pre-tokenizer's matches are the same from any
        place where one of them starts, so the window's are the whole text's but for its last."""
        end = start + size
        marks = [m for m in self._special_re.finditer(text, start, end + self._longest_marker)
                 if m.start() < end]
        if marks:  # special tokens are split out before the pre-tokenizer runs: cut before or after
            if marks[-1].start() > start:
                return marks[-1].start()
            return marks[-1].end()
        words = []
        if self.hf.pre_tokenizer is not None:
            words = self.hf.pre_tokenizer.pre_tokenize_str(text[start:end])
        if len(words) > 1:  # the last word may run past the window: cut where it starts
            return start + words[-1][1][0]
        if end >= len(text):
            return len(text)
        return self._cut(text, start, 2 * size)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (accepts lists, tensors, arrays); out-of-range ids are an error, never
        dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        else:
            ids = list(ids)
        if ids and isinstance(ids[0], list):
            raise ValueError("decode takes one sequence of ids; decode a batch row by row")
        for i, t in enumerate(ids):
            if (
                isinstance(t, bool)
                or not isinstance(t, numbers.Integral)
                or not 0 <= t < self.vocab_size
            ):
                raise ValueError(f"ids[{i}]={t!r} is not a token id (vocab_size={self.vocab_size})")
        return self.hf.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False,
                            tools: Sequence[dict] | None = None,
                            open_thinking: bool = False) -> str | list[int]:
        """ChatML: '<|im_start|>role\\ncontent<|im_end|>\\n' per message, + MiniMind-3's fields (see
        chat_pieces)."""
        check_messages(messages)
        pieces = chat_pieces(messages, tools, add_generation_prompt, self.think, open_thinking)
        if tokenize:
            return self._chat_ids(pieces)
        return "".join(text for text, _ in pieces)

    def _chat_ids(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Ids of the pieces: markers are special ids, the text between them (content: always text)
        encoded at once."""
        ids, text = [], ""
        for piece, is_content in pieces:
            parts = [piece]
            if not is_content:
                parts = self._special_re.split(piece)
            for j, part in enumerate(parts):
                if j % 2:  # a special marker: flush the text before it
                    ids += [*self._plain.encode(text, add_special_tokens=False).ids,
                            self.hf.token_to_id(part)]
                    text = ""
                else:
                    text += part
        return ids + self._plain.encode(text, add_special_tokens=False).ids


load_tokenizer = Tokenizer.load  # load_tokenizer(directory=None): the name callers use


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer whose vocabulary differs from the model's (ids would index the wrong
    embeddings)."""
    if tokenizer.vocab_size != vocab_size:
        src = f" (loaded from {tokenizer.source})" if tokenizer.source else ""
        raise ValueError(f"tokenizer vocab_size={tokenizer.vocab_size}{src} does not match the "
                         "model's "
                         f"vocab_size={vocab_size}; use the tokenizer the model was trained with, "
                         "or build the "
                         f"model with vocab_size={tokenizer.vocab_size}")
