"""The numbers the docs quote are generated (tools/doc_numbers.py, `make course-times`): the guide's totals and plan
from its estimates table, the teacher's notes' and the README's values from the committed notebook outputs."""

import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import course_times  # noqa: E402
import doc_numbers  # noqa: E402

GUIDE, ANSWERS, README = (REPO / "docs" / "teaching.md", REPO / "docs" / "answers.md", REPO / "README.md")


@pytest.mark.parametrize("doc", doc_numbers.DOCS, ids=lambda p: p.name)
def test_every_generated_number_matches_its_source(doc: Path):
    text = doc.read_text(encoding="utf-8")
    stale = [(m["key"], m["value"], doc_numbers.value_of(m["key"])) for m in doc_numbers.MARK.finditer(text)
             if m["value"] != doc_numbers.value_of(m["key"])]
    assert not stale, f"{doc.name}: (key, quoted, now) {stale}: run make course-times"


@pytest.mark.parametrize("doc, keys", [
    (GUIDE, ["est:reading:00-09", "est:exercises:00-09", "est:hours:00-09", "est:reading:04-06", "est:exercises:04-06",
             "est:total:07", "est:total:08", "run:workshop:00-09", "committed:profile:00-09"]),
    (ANSWERS, ["out:07.val_loss_before", "out:07.ppl_before", "out:07.ppl_after", "out:07.amp"]),
    (README, ["committed:profile:00-09", "committed:device:00-09", "out:07.amp", "out:07.val_loss_after", "out:08.val_loss_after"]),
], ids=["teaching.md", "answers.md", "README.md"])
def test_totals_and_quotes_are_generated_not_typed(doc: Path, keys: list[str]):
    found = {m["key"] for m in doc_numbers.MARK.finditer(doc.read_text(encoding="utf-8"))}
    assert not [k for k in keys if k not in found], f"{doc.name} types what it should quote: {set(keys) - found}"


def test_the_guide_types_no_total_of_minutes_or_hours():
    """Outside the generated tables and numbers, only the plans' session lengths and the stated paces are typed."""
    text = GUIDE.read_text(encoding="utf-8")
    for start, end in ((course_times.START, course_times.END), (course_times.ESTIMATES_START, course_times.ESTIMATES_END),
                       (course_times.REGIONS_START, course_times.REGIONS_END)):
        text = re.sub(re.escape(start) + ".*?" + re.escape(end), "", text, flags=re.S)
    typed = re.findall(r"\d+(?:\.\d+)?(?:-\d+)? ?(?:minutes?|min|hours?|h)\b", doc_numbers.MARK.sub("", text))
    lengths = {"3 hours", "7 hours", "3.5 hours", "3.5 h", "210 minutes"}  # the plans' days and sessions
    paces = {f"{course_times.MINUTES_PER_EXERCISE} minutes", f"{course_times.MINUTES_PER_REGION} minutes"}
    assert set(typed) <= lengths | paces, f"typed in docs/teaching.md: {set(typed) - lengths - paces}"
    for pace in (f"{course_times.WORDS_PER_MINUTE} words a minute", f"{course_times.CODE_LINES_PER_MINUTE} non-blank",
                 f"{course_times.MINUTES_PER_EXERCISE} minutes per exercise",
                 f"{course_times.MINUTES_PER_REGION} minutes per region",
                 f"{course_times.WRITTEN_LINES_PER_MINUTE} line of solution a minute"):
        assert pace in GUIDE.read_text(encoding="utf-8"), f"the guide states another pace than course_times: {pace}"


def executed(tmp_path: Path, name: str, printed: str, profile: str = "workshop") -> Path:
    """A notebook in tmp_path that printed `printed` after its profile line."""
    cells = [nbformat.v4.new_code_cell("describe()"), nbformat.v4.new_code_cell("run()"),
             nbformat.v4.new_markdown_cell("### Exercise 1: x\n" + "word " * 240)]
    cells[0].outputs = [nbformat.v4.new_output("stream", text=f"cpu (X), profile={profile}, torch 2.13.0\n")]
    cells[1].outputs = [nbformat.v4.new_output("stream", text=printed)]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / name)
    return tmp_path / name


def test_a_quote_follows_the_committed_output(tmp_path: Path):
    executed(tmp_path, "07_pretrain.ipynb", "validation loss 8.773 -> 5.379 (perplexity 6,461 -> 216.8)\n")
    doc = tmp_path / "notes.md"
    doc.write_text("ends at perplexity <!--n:out:07.ppl_after-->223<!--/n--> (bf16)\n")
    assert doc_numbers.render(doc.read_text(), notebook_dir=tmp_path) == \
        "ends at perplexity <!--n:out:07.ppl_after-->216.8<!--/n--> (bf16)\n"
    executed(tmp_path, "07_pretrain.ipynb", "validation loss 8.773 -> 5.6 (perplexity 6,461 -> 270.4)\n")
    assert "-->270.4<!--" in doc_numbers.render(doc.read_text(), notebook_dir=tmp_path)  # re-executed: new value


def test_check_fails_on_a_stale_file_and_passes_once_rewritten(tmp_path: Path):
    doc = tmp_path / "notes.md"
    doc.write_text("<!--n:committed:profile:00-09-->no-such-profile<!--/n--> outputs\n")  # read from this repository
    assert doc_numbers.main(["--check", str(doc)]) == 1 and "no-such" in doc.read_text()  # --check writes nothing
    assert doc_numbers.main([str(doc)]) == 0
    assert doc_numbers.main(["--check", str(doc)]) == 0
    assert doc.read_text() == f"<!--n:committed:profile:00-09-->{doc_numbers.value_of('committed:profile:00-09')}<!--/n--> outputs\n"


def test_estimate_sums_and_a_plan_that_does_not_fit(tmp_path: Path):
    for n in ("00", "01", "02"):  # 240 words at 120 a minute + 1 code line = 2 min of reading, 1 exercise = 10 min
        executed(tmp_path, f"{n}_x.ipynb", "")
    value = lambda key: doc_numbers.value_of(key, notebook_dir=tmp_path)  # noqa: E731
    assert [value(k) for k in ("est:reading:all", "est:exercises:00-01", "est:total:02", "est:hours:all")] == \
        ["6", "20", "12", "0.6"]
    assert value("est:total:00,01+exercises:02<=34") == "34"
    with pytest.raises(SystemExit, match=r"plan.md:2: est:total:00-02<=35: total:00-02 need 36 min .* change the plan"):
        doc_numbers.render("a\n<!--n:est:total:00-02<=35-->36<!--/n-->\n", "plan.md", notebook_dir=tmp_path)
    with pytest.raises(SystemExit, match=r"plan.md:1: .*'07'"):
        doc_numbers.render("<!--n:est:total:07-->1<!--/n-->", "plan.md", notebook_dir=tmp_path)


def test_bad_keys_and_mixed_profiles_are_named(tmp_path: Path):
    executed(tmp_path, "00_a.ipynb", "")
    executed(tmp_path, "01_b.ipynb", "", profile="smoke")
    with pytest.raises(SystemExit, match=r"doc.md:1: committed:profile: .*different profiles.*'00': 'workshop'"):
        doc_numbers.render("<!--n:committed:profile-->x<!--/n-->", "doc.md", notebook_dir=tmp_path)
    with pytest.raises(SystemExit, match=r"doc.md:1: out:nope is not in"):
        doc_numbers.render("<!--n:out:nope-->x<!--/n-->", "doc.md", notebook_dir=tmp_path)
    with pytest.raises(SystemExit, match=r"doc.md:1: 'size:all': a key starts with one of est:, run:, out:"):
        doc_numbers.render("<!--n:size:all-->x<!--/n-->", "doc.md", notebook_dir=tmp_path)


def test_an_optional_part_is_estimated_apart(tmp_path: Path):
    """Cells from a "## Part N (optional)" heading on are left out of the reading minutes and the plans' sums."""
    cells = [nbformat.v4.new_markdown_cell("word " * 1200),  # 10 minutes at 120 words a minute
             nbformat.v4.new_markdown_cell("## Part 2 (optional): more\n" + "word " * 2395)]  # 2,400 words: 20
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "03_x.ipynb")
    row = course_times.estimates(tmp_path)["03"]
    assert (row["words"], row["reading"], row["optional"]) == (3600, 10, 20)
    assert doc_numbers.estimate_value("total:03", tmp_path) == "10"
    assert doc_numbers.estimate_value("optional:03", tmp_path) == "20"
    assert "| 10 | 20 |" in course_times.estimate_table(tmp_path)


def test_lab_regions_are_estimated_by_the_stated_rule(tmp_path: Path):
    """Each region: the fixed minutes plus its non-blank, non-comment solution lines at the writing pace."""
    body = "def f(x):\n    \"\"\"Doc.\"\"\"\n    ### BEGIN SOLUTION\n    # a comment\n    y = x + 1\n\n    return y\n" \
           "    ### END SOLUTION\n"
    cell = nbformat.v4.new_code_cell(body, metadata={"nbgrader": {"solution": True, "grade_id": "f"}})
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "04_x.ipynb")
    row = course_times.estimates(tmp_path)["04"]
    minutes = round((course_times.MINUTES_PER_REGION + 2 / course_times.WRITTEN_LINES_PER_MINUTE)
                    * (1 + course_times.FIX_AND_RERUN))  # the fix-and-rerun allowance
    assert row["regions"] == [{"name": "f", "lines": 2, "minutes": minutes}] and row["lab_minutes"] == minutes
    assert doc_numbers.estimate_value("lab:04", tmp_path) == str(minutes)
    assert doc_numbers.estimate_value("regions:04", tmp_path) == "1"
    assert doc_numbers.region_value("04:f", tmp_path) == str(minutes)
    with pytest.raises(KeyError, match="not among notebook 04's regions"):
        doc_numbers.region_value("04:g", tmp_path)
    assert f"| `04_x` | `f` | 2 | {minutes} |" in course_times.regions_table(tmp_path)


def test_a_slot_sums_its_sections_regions_and_exercises(tmp_path: Path):
    body = 'def f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n'
    cells = [nbformat.v4.new_markdown_cell("intro " * 120), nbformat.v4.new_markdown_cell("## 1. One\n" + "w " * 238),
             nbformat.v4.new_code_cell(body, metadata={"nbgrader": {"solution": True, "grade_id": "f"}}),
             nbformat.v4.new_markdown_cell("## 2. Two\n" + "w " * 598),
             nbformat.v4.new_markdown_cell("### Exercise 1: x")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "04_x.ipynb")
    row = course_times.estimates(tmp_path)["04"]
    assert row["sections"] == {"0": 1, "1": 2, "2": 5}  # 120, 240 (+ the region's 3 code lines) and 600 words
    region = row["regions"][0]["minutes"]
    value = lambda key: doc_numbers.value_of(key, notebook_dir=tmp_path)  # noqa: E731
    assert value("slot:04:read=1,2") == "7" and value("slot:04:read=all") == str(row["reading"])
    assert value("slot:04:read=2+regions=f+exercises=1<=30") == str(5 + region + course_times.MINUTES_PER_EXERCISE)
    with pytest.raises(ValueError, match="more than the 9 min of their slot"):
        value("slot:04:read=2+regions=f<=9")
    with pytest.raises(KeyError, match=r"read \['3'\] not among notebook 04's"):
        value("slot:04:read=3")


def test_the_plans_fit_their_slots_by_the_guides_own_sums():
    """Every slot of the 3-hour plan where learners read, write or do exercises is generated as a sum whose limit is
    the slot's length; every session of the 2-day plans carries its 210-minute limit (render refuses an overflow)."""
    text = GUIDE.read_text(encoding="utf-8")
    three_hours = text.split("## A 3-hour workshop", 1)[1].split("\n## ", 1)[0]
    for row in re.findall(r"^\| (\d):(\d\d)-(\d):(\d\d) \| `0[456]_\w+` \|(.*)$", three_hours, re.M):
        length = (int(row[2]) * 60 + int(row[3])) - (int(row[0]) * 60 + int(row[1]))
        assert re.search(rf"<!--n:slot:[^>]*<={length}-->", row[4]), row
    for plan in ("## A 2-day course", "**In the 2-day plan**"):
        rows = [line for line in text.split(plan, 1)[1].split("\n\n| day |", 1)[1].split("\n\n")[0].splitlines()
                if re.match(r"\| [12] \|", line)]
        assert len(rows) == 2 and all(len(re.findall(r"<=210-->", row)) == 2 for row in rows), rows
    for m in doc_numbers.MARK.finditer(text):
        doc_numbers.value_of(m["key"])  # raises for a slot its parts overflow
