"""The course's tokenizer: MiniMind's 6400-token byte-level BPE, built with Hugging Face `tokenizers`.

MiniMind trains it in scripts/train_tokenizer.py with exactly these pieces:
`models.BPE()`, `pre_tokenizers.ByteLevel(add_prefix_space=False)`, `decoders.ByteLevel()` and
`trainers.BpeTrainer(vocab_size=6400, special_tokens=[<|endoftext|>, <|im_start|>, <|im_end|>],
initial_alphabet=ByteLevel.alphabet())`, so the three special tokens get ids 0, 1, 2 and all 256 bytes are
in the vocabulary (any string can be encoded: no unknown tokens, ever).

A directory holds `tokenizer.json` (the `tokenizers` model) and `tokenizer_config.json` (the
`transformers` side: which token is bos/eos/pad, the chat template), the layout MiniMind ships, so
`load_tokenizer(minimind_repo / "model")` works as well as our own bundled asset.

Special-token text inside content: `encode(text)` follows MiniMind / `transformers` and turns the literal
string "<|im_end|>" into id 2 (that is how a rendered chat template becomes ids). Pass
`allow_special=False` to encode such strings as plain bytes. `apply_chat_template(..., tokenize=True)`
builds the structure from ids and encodes every message's content with `allow_special=False`, so a user
who types "<|im_end|>" cannot end their turn early; the token ids then differ from
`encode(apply_chat_template(...))` only for content that contains special-token strings.

CLI: `python -m minimind_lib.tokenizer train --data data/pretrain.jsonl data/sft.jsonl --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import numbers
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from .fileio import atomic_write_text
from .paths import ASSETS_DIR

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # in this order, so their ids are 0, 1, 2
DEFAULT_VOCAB_SIZE = 6400
DEFAULT_DIR = ASSETS_DIR / "tokenizer"
TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
ROLES = ("system", "user", "assistant")

# The chat template as Jinja, for `transformers` users (apply_chat_template below is the same thing in Python;
# tests render this string with jinja2 and compare).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _added_token_entry(content: str) -> dict:
    """One entry of added_tokens_decoder, as MiniMind writes it."""
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def default_config(hf: tokenizers.Tokenizer, model_max_length: int = 32768) -> dict:
    """tokenizer_config.json in MiniMind's layout, for a tokenizer whose special tokens are SPECIAL_TOKENS."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(hf.token_to_id(t)): _added_token_entry(t) for t in SPECIAL_TOKENS},
        "additional_special_tokens": [],
        "bos_token": IM_START,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "legacy": True,
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
    }


def _token_name(value, key: str, path: Path) -> str:
    """A special token's text from a config value (a string, or a dict with 'content' as transformers writes)."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, str):
        return value
    raise ValueError(f"{path}: key {key!r} must be a token string, got {value!r}")


class Tokenizer:
    """A byte-level BPE tokenizer (a `tokenizers.Tokenizer`) plus MiniMind's special tokens and chat template."""

    def __init__(self, hf: tokenizers.Tokenizer, config: dict | None = None, source: str | Path | None = None):
        self.hf = hf
        self.source = Path(source) if source is not None else None
        self.config = dict(config) if config is not None else default_config(hf)
        where = self.source / CONFIG_FILE if self.source is not None else Path("<tokenizer_config>")
        self._check_added_tokens(where)
        ids = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if key not in self.config:
                raise ValueError(f"{where}: missing key {key!r}")
            name = _token_name(self.config[key], key, where)
            tid = hf.token_to_id(name)
            if tid is None:
                raise ValueError(f"{where}: {key}={name!r} is not a token of {TOKENIZER_FILE}")
            ids[key] = tid
        self.bos_token_id: int = ids["bos_token"]
        self.eos_token_id: int = ids["eos_token"]
        self.pad_token_id: int = ids["pad_token"]
        self.unk_token_id: int = ids["unk_token"]
        self.special_ids: dict[str, int] = {}
        for name in SPECIAL_TOKENS:
            tid = hf.token_to_id(name)
            if tid is None:
                raise ValueError(f"{where}: the tokenizer has no {name!r} token (MiniMind needs {SPECIAL_TOKENS})")
            self.special_ids[name] = tid
        self.endoftext_id: int = self.special_ids[ENDOFTEXT]
        self.im_start_id: int = self.special_ids[IM_START]
        self.im_end_id: int = self.special_ids[IM_END]
        self.chat_template: str = self.config.get("chat_template", CHAT_TEMPLATE)
        # A twin that encodes special-token strings as plain text (used for chat content): separate object,
        # so toggling never races with another caller.
        self._plain = tokenizers.Tokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True

    def _check_added_tokens(self, where: Path) -> None:
        """Verify that added_tokens_decoder in the config agrees with tokenizer.json (ids are read, not assumed)."""
        decoder = self.config.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise ValueError(f"{where}: added_tokens_decoder must be an object, got {type(decoder).__name__}")
        for key, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not isinstance(content, str) or not str(key).isdigit():
                raise ValueError(f"{where}: bad added_tokens_decoder entry {key!r}: {entry!r}")
            actual = self.hf.token_to_id(content)
            if actual != int(key):
                raise ValueError(f"{where}: added_tokens_decoder says {content!r} has id {key} "
                                 f"but {TOKENIZER_FILE} gives it id {actual}")

    # ---------------------------------------------------------------- sizes and lookups
    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (6400 for MiniMind)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={str(self.source) if self.source else None!r})"

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (in ByteLevel's printable form, e.g. 'Ġthe'), or None."""
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The token string of an id (ByteLevel form)."""
        token = self.hf.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token id {token_id} is out of range for vocab_size={self.vocab_size}")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a (non-special) token stands for."""
        return bytes(_UNICODE_TO_BYTE[c] for c in self.id_to_token(token_id))

    # ---------------------------------------------------------------- encode / decode
    @staticmethod
    def _check_text(text, index: int | None = None) -> None:
        where = "text" if index is None else f"texts[{index}]"
        if not isinstance(text, str):
            raise TypeError(f"{where} must be str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} is not valid Unicode: {text[e.start]!r} at index {e.start} is a lone "
                             "surrogate, which has no UTF-8 bytes") from None

    def encode(self, text: str, add_special_tokens: bool = False, allow_special: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens wraps them as [bos] + ids + [eos] (MiniMind's pretrain sample)."""
        self._check_text(text)
        ids = (self.hf if allow_special else self._plain).encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False,
                     allow_special: bool = True) -> list[list[int]]:
        """encode() for many texts at once (in parallel, inside `tokenizers`)."""
        texts = list(texts)
        for i, t in enumerate(texts):
            self._check_text(t, i)
        encs = (self.hf if allow_special else self._plain).encode_batch(texts, add_special_tokens=False)
        if add_special_tokens:
            return [[self.bos_token_id, *e.ids, self.eos_token_id] for e in encs]
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (accepts lists, tensors, arrays); out-of-range ids are an error, never dropped."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):
            raise ValueError("decode takes one sequence of ids; use decode_batch for a batch")
        n = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < n:
                raise ValueError(f"ids[{i}]={t!r} is not a token id (vocab_size={n})")
        return self.hf.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() for each sequence of a batch."""
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    # ---------------------------------------------------------------- chat template
    @staticmethod
    def _check_messages(messages) -> None:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with keys 'role' and 'content', got {m!r}")
            if m["role"] not in ROLES:
                raise ValueError(f"messages[{i}]['role']={m['role']!r} is not one of {ROLES}")
            if m["role"] == "system" and i != 0:
                raise ValueError(f"messages[{i}] is a system message; only messages[0] may be one")
            if not isinstance(m["content"], str):
                raise ValueError(f"messages[{i}]['content'] must be str, got {type(m['content']).__name__}")

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str | list[int]:
        """ChatML: '<|im_start|>role\\ncontent<|im_end|>\\n' per message (+ '<|im_start|>assistant\\n')."""
        self._check_messages(messages)
        if not tokenize:
            text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
            return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
        # Structure from ids, content as plain text: special-token strings typed by a user stay text.
        newline = self._plain.encode("\n", add_special_tokens=False).ids
        ids: list[int] = []
        for m in messages:
            self._check_text(m["content"])
            ids += [self.im_start_id, *self._plain.encode(f"{m['role']}\n{m['content']}").ids, self.im_end_id, *newline]
        if add_generation_prompt:
            ids += [self.im_start_id, *self._plain.encode("assistant\n").ids]
        return ids

    # ---------------------------------------------------------------- save / load / train
    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json and tokenizer_config.json (MiniMind's layout) into directory; returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / TOKENIZER_FILE, self.hf.to_str(pretty=True))
        config = dict(self.config, chat_template=self.chat_template)
        atomic_write_text(directory / CONFIG_FILE, json.dumps(config, ensure_ascii=False, indent=4) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path | None = None) -> "Tokenizer":
        """Read a tokenizer directory (ours or MiniMind's); default: the bundled asset."""
        directory = Path(DEFAULT_DIR if directory is None else directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist (it should hold "
                                    f"{TOKENIZER_FILE} and {CONFIG_FILE})")
        tok_path, cfg_path = directory / TOKENIZER_FILE, directory / CONFIG_FILE
        for p in (tok_path, cfg_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} not found: a tokenizer directory needs {TOKENIZER_FILE} and {CONFIG_FILE}")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception with a serde message
            raise ValueError(f"{tok_path}: not a valid tokenizers file ({e})") from None
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_path}: must hold a JSON object, got {type(config).__name__}")
        return cls(hf, config, source=directory)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
              show_progress: bool = False) -> "Tokenizer":
        """Train MiniMind's byte-level BPE on texts (deterministic: same texts, same tokenizer.json)."""
        min_size = len(SPECIAL_TOKENS) + 256
        if vocab_size <= min_size:
            raise ValueError(f"vocab_size={vocab_size} leaves no room for merges: it must exceed "
                             f"{min_size} (3 special tokens + 256 bytes)")
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      show_progress=show_progress,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(texts, trainer=trainer)
        hf.decoder = decoders.ByteLevel()
        got = hf.get_vocab_size(with_added_tokens=True)
        if got != vocab_size:
            raise ValueError(f"the corpus is too small for vocab_size={vocab_size}: BPE ran out of pairs to "
                             f"merge at {got} tokens; give it more text or ask for vocab_size<={got}")
        for i, name in enumerate(SPECIAL_TOKENS):  # MiniMind's train_tokenizer.py asserts the same
            assert hf.token_to_id(name) == i, (name, hf.token_to_id(name))
        return cls(hf)


def load_tokenizer(directory: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer directory (default: minimind_lib/assets/tokenizer, the committed 6400-token asset)."""
    return Tokenizer.load(directory)


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer whose vocabulary differs from the model's (ids would index the wrong embeddings)."""
    if tokenizer.vocab_size != vocab_size:
        src = f" (loaded from {tokenizer.source})" if tokenizer.source else ""
        raise ValueError(f"tokenizer vocab_size={tokenizer.vocab_size}{src} does not match the model's "
                         f"vocab_size={vocab_size}; use the tokenizer the model was trained with, or build the "
                         f"model with vocab_size={tokenizer.vocab_size}")


# ---------------------------------------------------------------- training data from jsonl
def iter_jsonl_texts(paths: Sequence[str | Path], max_samples: int | None = None,
                     stats: dict | None = None) -> Iterator[str]:
    """Texts of MiniMind jsonl files: each pretrain {"text"} and each message content of SFT {"conversations"}.

    Reads at most max_samples lines per file. Blank lines are skipped and counted in stats["blank_lines"];
    anything else malformed is an error naming file and line.
    """
    stats = {} if stats is None else stats
    for key in ("lines", "texts", "chars", "blank_lines"):
        stats.setdefault(key, 0)
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"training data file {path} not found")
        with path.open(encoding="utf-8") as f:
            n = 0
            for lineno, line in enumerate(f, 1):
                if max_samples is not None and n >= max_samples:
                    break
                if not line.strip():
                    stats["blank_lines"] += 1
                    continue
                n += 1
                stats["lines"] += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
                if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                    pieces = [obj["text"]]
                elif isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
                    pieces = []
                    for j, m in enumerate(obj["conversations"]):
                        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                            raise ValueError(f"{path}:{lineno}: conversations[{j}] needs a string 'content', got {m!r:.80}")
                        pieces.append(m["content"])
                else:
                    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                    raise ValueError(f"{path}:{lineno}: expected a 'text' string or a 'conversations' list, got {keys}")
                for p in pieces:
                    stats["texts"] += 1
                    stats["chars"] += len(p)
                    yield p


def train_from_jsonl(paths: Sequence[str | Path], vocab_size: int = DEFAULT_VOCAB_SIZE,
                     max_samples: int | None = None, show_progress: bool = False) -> tuple[Tokenizer, dict]:
    """Train on MiniMind jsonl files; returns the tokenizer and stats (texts, chars, seconds, files)."""
    stats: dict = {"files": [str(p) for p in paths], "max_samples": max_samples}
    texts = list(iter_jsonl_texts(paths, max_samples, stats))  # read first, so that the timing is training only
    t0 = time.perf_counter()
    tok = Tokenizer.train(texts, vocab_size=vocab_size, show_progress=show_progress)
    stats["train_seconds"] = time.perf_counter() - t0
    stats["vocab_size"] = tok.vocab_size
    return tok, stats


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to printable characters (ByteLevel's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI: `train` a tokenizer from jsonl files, or `info` about a tokenizer directory."""
    parser = argparse.ArgumentParser(prog="python -m minimind_lib.tokenizer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="train MiniMind's byte-level BPE on jsonl files")
    p_train.add_argument("--data", nargs="+", required=True, help="jsonl files ({'text'} or {'conversations'} lines)")
    p_train.add_argument("--out", required=True, help="output directory (tokenizer.json + tokenizer_config.json)")
    p_train.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p_train.add_argument("--max-samples", type=int, default=None, help="read at most this many lines per file")
    p_info = sub.add_parser("info", help="print facts about a tokenizer directory")
    p_info.add_argument("dir", nargs="?", default=None)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "train":
            tok, stats = train_from_jsonl(args.data, args.vocab_size, args.max_samples)
            tok.save(args.out)
            print(json.dumps({"out": str(args.out), **stats}, ensure_ascii=False))
        else:
            tok = load_tokenizer(args.dir)
            print(json.dumps({"dir": str(tok.source), "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id,
                              "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                              "special_ids": tok.special_ids}, ensure_ascii=False))
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
