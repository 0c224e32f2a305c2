"""The lab edition (tools/handout.py, notebooks/lab_checks.py): every chapter's solution regions are marked as nbgrader
marks them and become stubs; put back, they give the chapter; each region has a check, and a planted mistake is caught
by its check with a message naming it. (The untouched lab notebooks are executed in tests/test_workshop_kit.py.)"""
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(NB_DIR))

import handout  # noqa: E402
import lab_checks  # noqa: E402
from exercise_checks import NotRightYet  # noqa: E402

CHAPTERS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
CHECK_CALL = re.compile(r"""\blab\.check\(["']([\w.]+)["']""")
STUB = re.compile(r"^([ \t]*)# YOUR CODE HERE\n\1raise NotImplementedError\(\)$", re.M)  # nbgrader's, indented


def chapter(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def stubs(nb: nbformat.NotebookNode) -> int:
    return sum(len(STUB.findall(c.source)) for c in nb.cells if c.cell_type == "code")


def put_back(lab_source: str, chapter_source: str) -> str:
    """The lab cell with the chapter's regions (markers and bodies) in place of its stubs, in order."""
    lines, regions = chapter_source.split("\n"), handout.find_regions(chapter_source)
    out, lab_lines, i = [], lab_source.split("\n"), 0
    for r in regions:
        stub = [r.indent + s for s in handout.STUB]
        while lab_lines[i:i + len(stub)] != stub:
            out.append(lab_lines[i])
            i += 1
        out += lines[r.begin:r.end + 1]
        i += len(stub)
    return "\n".join(out + lab_lines[i:])


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_regions_are_marked_and_the_lab_edition_stubs_each(path):
    nb = chapter(path)
    regions = handout.notebook_regions(nb, path.name)  # raises for a region outside an nbgrader solution cell
    lab = handout.lab_edition(chapter(path), path.name)
    assert stubs(lab) - stubs(nb) == len(regions), f"{path.name}: a stub per region"
    assert handout.notebook_regions(lab) == [], "the lab edition holds no region"
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)), f"{path.name}: nbgrader's grade_id must be unique in a notebook"
    if path.name.startswith("03"):
        assert len(regions) >= 6, [r.name for r in regions]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_region_keeps_a_docstring_and_has_a_check_cell(path):
    """The stub keeps the def and the docstring above the region (what to write); a cell after the region's cell
    calls lab.check with the region's name, which lab_checks.py knows."""
    nb = chapter(path)
    for i, cell in enumerate(nb.cells):
        regions = handout.find_regions(cell.source) if cell.cell_type == "code" else []
        lines = cell.source.split("\n")
        for r in regions:
            assert lines[r.begin - 1].rstrip().endswith('"""'), f"{path.name} {r.name}: a docstring ends above it"
            if path.name.startswith("10"):  # its regions' checks: notebooks/lora_dpo.py's, until lab_checks.py's
                later = "".join(c.source for c in nb.cells[i + 1:] if c.cell_type == "code")
                assert "ld.check_" in later, f"{path.name} {r.name}: no check cell after the region"
                continue
            assert r.name in lab_checks.CHECKS, f"{path.name} {r.name}: no check in lab_checks.py"
            later = [n for c in nb.cells[i + 1:] if c.cell_type == "code" for n in CHECK_CALL.findall(c.source)]
            assert r.name in later, f"{path.name} {r.name}: no lab.check({r.name!r}, ...) cell after the region"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_solutions_put_back_give_the_chapter(path):
    nb, lab = handout.strip_outputs(chapter(path)), handout.lab_edition(chapter(path), path.name)
    for lab_cell, chapter_cell in zip(lab.cells, nb.cells):
        lab_cell.source = put_back(lab_cell.source, chapter_cell.source)
    assert nbformat.writes(lab) == nbformat.writes(nb)


def test_the_stripper_follows_nbgraders_rules():
    source = ('def f(x):\n    """Twice x."""\n    ### BEGIN SOLUTION\n    y = 2 * x\n    return y\n'
              '    ### END SOLUTION\n')
    cleared, regions = handout.clear_regions(source)
    assert cleared == "def f(x):\n    \"\"\"Twice x.\"\"\"\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    assert [(r.name, r.begin, r.end) for r in regions] == [("f", 2, 5)]
    for bad, message in (("### BEGIN SOLUTION\n### BEGIN SOLUTION\n", "inside the region opened on line 1"),
                         ("x = 1\n### BEGIN SOLUTION\n", "line 2: BEGIN SOLUTION without an END"),
                         ("### END SOLUTION\n", "line 1: END SOLUTION without a BEGIN")):
        with pytest.raises(ValueError, match=message):
            handout.clear_regions(bad, "x.ipynb, cell 3")
    unmarked = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    with pytest.raises(ValueError, match="x.ipynb, cell 0: a solution region in a cell without nbgrader"):
        handout.lab_edition(unmarked, "x.ipynb")


# Cells a planted-mistake run leaves out: measurements that take minutes and that no later check needs.
NOT_NEEDED = {"06_dynamic_batching": ("c06-23", "c06-25", "c06-26", "c06-28", "c06-30")}  # 06's sections 4 and 5


def run_chapter_until_check(path: Path, name: str, body: str | None) -> dict:
    """Execute the chapter's code cells in this process, region `name` written as `body`, up to and including the
    first cell that checks it (the cells before it run as they are); the cells' namespace."""
    import matplotlib
    matplotlib.use("Agg")
    nb, namespace, planted = chapter(path), {}, False
    for cell in (c for c in nb.cells if c.cell_type == "code" and c.get("id") not in NOT_NEEDED.get(path.stem, ())):
        regions = [r for r in handout.find_regions(cell.source) if r.name == name]
        source = cell.source
        if regions and body is not None:
            lines, r = source.split("\n"), regions[0]
            written = [r.indent + line if line else line for line in body.split("\n")]
            source, planted = "\n".join(lines[:r.begin + 1] + written + lines[r.end:]), True
        exec(compile(source, f"{path.name} cell {cell.get('id')}", "exec"), namespace)
        if name in CHECK_CALL.findall(cell.source):
            assert planted or body is None, f"region {name} not found in {path.name}"
            return namespace
    raise AssertionError(f"no check cell for {name} in {path.name}")


ATTENTION_WITHOUT_MASK = '''b, t, _ = x.shape
q, k, v = self.heads(x)
q, k = apply_rope(q, k, cos, sin)
k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))'''


CLIP_PER_TENSOR = """norms = []
for p in params:
    if p.grad is not None:
        norms.append(torch.linalg.vector_norm(p.grad))
        p.grad.mul_(torch.clamp(max_norm / (norms[-1] + 1e-6), max=1.0))
return torch.linalg.vector_norm(torch.stack(norms))"""


def with_mistake(chapter_name: str, name: str, right: str, wrong: str) -> str:
    """The body of region `name` as the chapter writes it (dedented), with `right` replaced by `wrong`."""
    for cell in chapter(NB_DIR / f"{chapter_name}.ipynb").cells:
        for r in handout.find_regions(cell.source) if cell.cell_type == "code" else []:
            if r.name == name:
                body = "\n".join(line[len(r.indent):] for line in cell.source.split("\n")[r.begin + 1:r.end])
                assert body.count(right) == 1, f"{chapter_name} {name}: {right!r} is not in the region once"
                return body.replace(right, wrong)
    raise AssertionError(f"no region {name} in {chapter_name}")


FILL_BY_REAL_TOKENS = """batches, batch, total = [], [], 0
for i in order:
    n = int(lengths[i])
    fits = max_tokens is None or total + n <= max_tokens
    if batch and not (fits and (max_batch_size is None or len(batch) < max_batch_size)):
        batches.append(batch)
        batch, total = [], 0
    batch.append(int(i))
    total += n
return batches + [batch] if batch else batches"""

STREAM_IGNORING_WHOLE = """rows, row, room = [], [], seq_len
for ids, labels in docs:
    stats.n_split += int(len(ids) > room)
    while len(ids):
        take = min(room, len(ids))
        row.append((ids[:take], labels[:take]))
        ids, labels, room = ids[take:], labels[take:], room - take
        if room == 0:
            rows.append(row)
            row, room = [], seq_len
return rows + [row] if row else rows"""


# Planted mistakes: chapter, region, the region's body as a learner might write it, what the check's message must
# name. A chapter owner adds a row per usual mistake of the chapter's regions (08: top-p keeping the wrong side).
PLANTED = [
    ("01_tokenizer", "get_stats", "flat = [i for ids in words for i in ids]\nreturn Counter(zip(flat, flat[1:]))",
     r"counts a pair across two words"),
    ("01_tokenizer", "merge", with_mistake("01_tokenizer", "merge", "        i += 2\n", "        i += 1\n"),
     r"merges the overlapping pairs \(7, 7\) both"),  # 'aaa' -> two new tokens: the middle 'a' used twice
    ("01_tokenizer", "train", with_mistake("01_tokenizer", "train", "min(stats, key=lambda p: (-stats[p], p))",
                                           "max(stats, key=stats.get)"), r"met first in the text"),
    ("01_tokenizer", "encode", with_mistake("01_tokenizer", "encode", 'min(zip(ids, ids[1:]), key=lambda p: '
                                            'merges.get(p, float("inf")))', "max(zip(ids, ids[1:]), key=lambda p: "
                                            "merges.get(p, -1))"), r"applied the merge learned last first"),
    ("01_tokenizer", "decode", "return ''.join(vocab[i].decode('utf-8', errors='replace') for i in ids)",
     r"decodes token by token"),
    ("02_data", "assistant_mask", with_mistake("02_data", "assistant_mask", "\nreturn mask",
                                               "\nreturn mask[1:] + [0]"),  # shifted: the model shifts by itself
     r"mask moved one position earlier"),
    ("02_data", "assistant_mask", with_mistake("02_data", "assistant_mask",  # every turn's content, not the assistant's
                                               " and ids[i + 1:i + 1 + len(header)] == header:", ":"),
     r"trains tokens of the system or user turns \(the prompt\)"),
    ("02_data", "chunk_rows", "return [ids[start:start + seq_len] for start in range(0, len(ids), seq_len)]",
     r"rows do not overlap"),
    ("02_data", "write_tokens", with_mistake("02_data", "write_tokens", ".astype(np.uint16)", ""),
     r"writes 8 bytes per token \(int64"),
    ("02_data", "pad_batch", with_mistake("02_data", "pad_batch", '"labels": torch.full((len(rows), width), -100)',
                                          '"labels": torch.full((len(rows), width), pad_id)'),
     r"label pad_id instead of -100"),
    ("03_model", "RMSNorm.forward",
     "xf = x.float()\nreturn self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))).type_as(x)",
     r"without eps"),
    ("03_model", "rotate_half", "x1, x2 = x.chunk(2, dim=-1)\nreturn torch.cat([x2, -x1], dim=-1)", r"wrong half"),
    ("03_model", "rotate_half", "return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)",
     r"neighbouring dimensions"),
    ("03_model", "Attention.forward", ATTENTION_WITHOUT_MASK, r"causal mask"),
    ("03_model", "repeat_kv", "return x.repeat(1, 1, n_rep, 1)", r"h // n_rep"),
    ("07_pretrain", "my_verdict", with_mistake("07_pretrain", "my_verdict",
                                               "val = val[val[\"tokens_seen\"] <= 1.1 * tokens[-1]]\n", ""),
     r"past 1\.1 x the band's last token count"),
    ("07_pretrain", "total_nats", with_mistake("07_pretrain", "total_nats", 'reduction="sum"', 'reduction="mean"'),
     r"mean loss per token"),
    ("07_pretrain", "bits_per_byte", "return nats / (math.log(2) * len(text))", r"divides by the characters"),
    ("08_sft", "assistant_mask_of", with_mistake("08_sft", "assistant_mask_of", "mask[k] = 1  # <|im_end|>",
                                                 "pass  # <|im_end|>"), r"<\|im_end\|> that closes a reply untrained"),
    ("08_sft", "my_generate", with_mistake("08_sft", "my_generate", "if use_cache:  # only", "if False:  # only"),
     r"runs the whole sequence again at every step"),
    ("08_sft", "keep_top_p", with_mistake("08_sft", "keep_top_p", "probs.cumsum(-1) - probs >= top_p",
                                          "probs.cumsum(-1) - probs < top_p"), r"keeps the wrong side"),
    ("08_sft", "keep_top_p", with_mistake("08_sft", "keep_top_p", "probs.cumsum(-1) - probs >= top_p",
                                          "probs.cumsum(-1) > top_p"), r"drops the token that carries the sum past p"),
    ("03_model", "init_weights", with_mistake("03_model", "init_weights", "module.weight, mean=0.0, std=0.02",
                                              "module.weight, 0.02"),  # positional: the mean, and std 1
     r"mean 0.02 and standard deviation 1"),
    ("03_model", "init_weights", with_mistake("03_model", "init_weights", "isinstance(module, (nn.Linear, "
                                              "nn.Embedding))", "hasattr(module, 'weight')"),  # gains drawn too
     r"draws the RMSNorm gains too"),
    ("04_gradient_accumulation", "lr_at",  # warmup from 0
     with_mistake("04_gradient_accumulation", "lr_at", "lr * (step + 1) / warmup_steps", "lr * step / warmup_steps"),
     r"At step 0 it gives 0"),
    ("04_gradient_accumulation", "lr_at", with_mistake("04_gradient_accumulation", "lr_at", "(step - warmup_steps) / "
                                                       "max(1, max_steps - warmup_steps)", "step / max_steps"),
     r"progress counts from step 0, not from the end of warmup"),
    ("04_gradient_accumulation", "clip_by_global_norm", CLIP_PER_TENSOR, r"clips each gradient by its own norm"),
    ("04_gradient_accumulation", "optimizer_step",  # steps on an inf/NaN gradient
     with_mistake("04_gradient_accumulation", "optimizer_step", "if math.isfinite(grad_norm):\n    optimizer.step()",
                  "optimizer.step()"), r"takes the step although the gradient norm is inf/NaN"),
    ("04_gradient_accumulation", "optimizer_step",
     with_mistake("04_gradient_accumulation", "optimizer_step", "optimizer.zero_grad(set_to_none=True)\n", ""),
     r"leaves the gradients in \.grad"),
    ("04_gradient_accumulation", "accumulate_step",  # issue 34: the naive mean per micro-batch / k under "token"
     with_mistake("04_gradient_accumulation", "accumulate_step", "loss = token_losses / n_tokens",
                  'loss = token_losses / count_trained(mb["labels"]) / len(micro_batches)'),
     r"averaging per micro-batch"),
    ("05_mixed_precision", "HandScaler.update",  # the count of good steps survives an overflow
     with_mistake("05_mixed_precision", "HandScaler.update", "self.scale_value *= self.backoff_factor\n"
                  "    self.good_steps = 0\n", "self.scale_value *= self.backoff_factor\n"),
     r"goes on counting the good steps from before it"),
    ("05_mixed_precision", "HandScaler.update",
     with_mistake("05_mixed_precision", "HandScaler.update", "if self.good_steps == self.growth_interval:",
                  "if self.good_steps > self.growth_interval:"), r"one good step late"),
    ("06_dynamic_batching", "fill_batches", FILL_BY_REAL_TOKENS, r"counts the real tokens of the rows"),
    ("06_dynamic_batching", "fill_batches", with_mistake("06_dynamic_batching", "fill_batches",
                                                         "(len(batch) + 1) * max(longest, n)", "(len(batch) + 1) * n"),
     r"multiplies by the new row's length"),
    ("06_dynamic_batching", "stream_segments", STREAM_IGNORING_WHOLE, r"With whole=True it cut a document"),
    ("06_dynamic_batching", "rows_from_segments", with_mistake("06_dynamic_batching", "rows_from_segments",
                                                               "torch.arange(n)", "torch.arange(pos, pos + n)"),
     r"position_ids count on across a document boundary"),
    ("06_dynamic_batching", "rows_from_segments", with_mistake("06_dynamic_batching", "rows_from_segments",
                                                               'out["labels"][r, pos + 1:pos + n] = labels[1:]',
                                                               'out["labels"][r, pos:pos + n] = labels'),
     r"first position of each document keeps its label"),
    ("06_dynamic_batching", "after_oom", with_mistake("06_dynamic_batching", "after_oom", "min(tokens_cap, padded) // 2",
                                                      "tokens_cap // 2"), r"halved the cap, to 500"),
    ("06_dynamic_batching", "memory_check", with_mistake("06_dynamic_batching", "memory_check",  # grows after an OOM
                                                         "\n    return None, sizes, seq_len, uncut_len", ""),
     r"grew the micro-batch while the rows were still cut"),
    ("09_beyond_one_gpu", "deal", "return [list(range(r, len(costs), n_ranks)) for r in range(n_ranks)]",
     r"round-robin"),
    ("09_beyond_one_gpu", "rank_backward", with_mistake("09_beyond_one_gpu", "rank_backward", "* world / n_global",
                                                        "* world / count_tokens(micro_batches)"),
     r"divides by the rank's own token count"),
    ("09_beyond_one_gpu", "rank_backward", with_mistake("09_beyond_one_gpu", "rank_backward", "* world / n_global",
                                                        "/ n_global"), r"does not multiply by world"),
    ("09_beyond_one_gpu", "accumulate_no_sync", with_mistake("09_beyond_one_gpu", "accumulate_no_sync",
                                                             "last = i == len(micro_batches) - 1", "last = True"),
     r"Every micro-batch's backward all-reduces \(no no_sync\(\)\)"),
    ("09_beyond_one_gpu", "accumulate_no_sync", with_mistake("09_beyond_one_gpu", "accumulate_no_sync",
                                                             "last = i == len(micro_batches) - 1", "last = i == 0"),
     r"all-reduce happens in the first micro-batch's backward"),
]


@pytest.mark.parametrize("chapter_name, name, body, names_it", PLANTED, ids=lambda v: str(v)[:24])
def test_a_planted_mistake_is_caught_and_named(chapter_name, name, body, names_it, monkeypatch):
    monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
    with pytest.raises(NotRightYet) as caught:
        run_chapter_until_check(NB_DIR / f"{chapter_name}.ipynb", name, body)
    message = str(caught.value)
    assert message.startswith(f"{name}: not right yet: ") and re.search(names_it, message), message
    assert re.search(r"differs first at index \(\d+(, \d+)*,?\): yours .*, the library's ", message), message
    assert "Hint: " in message


def test_a_stub_says_not_written_and_the_notebook_goes_on(capsys, monkeypatch):
    """Region by region, a stub's check prints the not-written line with a hint and returns a working version."""
    monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
    regions = handout.notebook_regions(chapter(NB_DIR / "03_model.ipynb"))
    run_chapter_until_check(NB_DIR / "03_model.ipynb", regions[-1].name, None)  # the chapter: every check passes
    assert capsys.readouterr().out.count(": passed (equal to minimind_lib's") == len(regions)
    stub = "raise NotImplementedError()"
    run_chapter_until_check(NB_DIR / "03_model.ipynb", "RMSNorm.forward", stub)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RMSNorm.forward: "))
    assert line.startswith("RMSNorm.forward: not written yet. Hint: ") and "minimind_lib's version" in line
    assert "rsqrt" not in line and "xf" not in line  # the hint never gives the code


FUNCTION_REGIONS = [r.name for n in ("01_tokenizer", "02_data", "04_gradient_accumulation", "06_dynamic_batching",
                                      "09_beyond_one_gpu")
                    for r in handout.notebook_regions(chapter(NB_DIR / f"{n}.ipynb"))]


def test_the_cells_left_out_of_planted_runs_exist():
    for stem, ids in NOT_NEEDED.items():
        assert set(ids) <= {c.get("id") for c in chapter(NB_DIR / f"{stem}.ipynb").cells}, stem


@pytest.mark.parametrize("name", FUNCTION_REGIONS)
def test_a_stub_goes_on_with_a_version_that_passes_the_check(name, capsys):
    """01's, 02's, 04's, 06's and 09's regions are functions: a stub's check says "not written yet" and returns the
    library's version (or its rule, written in lab_checks.py where the library has no such function), which passes
    the same check."""
    def stub(*args, **kwargs):
        raise NotImplementedError()

    fallback = lab_checks.check(name, stub)
    assert capsys.readouterr().out.startswith(f"{name}: not written yet. Hint: ")
    assert lab_checks.check(name, fallback) is fallback
    assert capsys.readouterr().out.startswith(f"{name}: passed (equal to minimind_lib's on fresh random inputs)")


def test_a_stub_scaler_update_goes_on_with_torchs_rule(capsys, monkeypatch):
    """05's region is a method: with a stub, the check returns the chapter's HandScaler with torch.amp.GradScaler's
    update rule, which passes the same check (and so runs the scaler demonstration that follows it)."""
    monkeypatch.setenv("MINIMIND_PROFILE", "smoke")
    stub = "raise NotImplementedError()"
    cells = run_chapter_until_check(NB_DIR / "05_mixed_precision.ipynb", "HandScaler.update", stub)
    assert "HandScaler.update: not written yet. Hint: " in capsys.readouterr().out
    assert lab_checks.check("HandScaler.update", cells["HandScaler"]) is cells["HandScaler"]
    assert capsys.readouterr().out.startswith("HandScaler.update: passed (equal to minimind_lib's")


# 09: its arithmetic regions come after a 2-process torchrun job; their planted mistakes run in the chapter cut to its
# set-up cells (before its first section) and the cells from the region to its check, which need nothing else.
PLANTED_AFTER_THE_RUN = [
    ("09_beyond_one_gpu", "per_rank_bytes", with_mistake("09_beyond_one_gpu", "per_rank_bytes", "**rest, \"autocast",
                                                         "**{k: b / world for k, b in rest.items()}, \"autocast"),
     r"divides the activations by world"),
    ("09_beyond_one_gpu", "per_rank_bytes", with_mistake("09_beyond_one_gpu", "per_rank_bytes",
                                                         '{**one_gpu, "DDP gradient buckets": 4 * est["n_params"]}',
                                                         "one_gpu"), r"leaves out DDP's gradient buckets"),
]


def region_alone(tmp_path: Path, chapter_name: str, name: str) -> Path:
    """The chapter cut to its set-up cells and the cells from region `name`'s on, written into tmp_path."""
    nb = chapter(NB_DIR / f"{chapter_name}.ipynb")
    first_section = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## "))
    start = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and
                 any(r.name == name for r in handout.find_regions(c.source)))
    nb.cells = nb.cells[:first_section] + nb.cells[start:]
    nbformat.write(nb, tmp_path / f"{chapter_name}.ipynb")
    return tmp_path / f"{chapter_name}.ipynb"


@pytest.mark.parametrize("chapter_name, name, body, names_it", PLANTED_AFTER_THE_RUN, ids=lambda v: str(v)[:24])
def test_a_planted_mistake_after_the_run_is_caught_and_named(chapter_name, name, body, names_it, tmp_path,
                                                               monkeypatch):
    region_alone(tmp_path, chapter_name, name)
    monkeypatch.setattr(sys.modules[__name__], "NB_DIR", tmp_path)  # the test above then runs the cut chapter
    test_a_planted_mistake_is_caught_and_named(chapter_name, name, body, names_it, monkeypatch)

