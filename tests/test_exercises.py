"""The notebooks' exercises: 2-4 per chapter 01-10, each with a check cell, a solution notebook that runs the same
checks, committed check outputs that never show an answer, and checks that fail on wrong answers
(notebooks/exercise_checks.py; the solution notebooks themselves are executed by nbval once, in the handout, by
tests/test_workshop_kit.py)."""
import math
import re
import sys
from pathlib import Path

import nbformat
import pytest
import torch

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
sys.path.insert(0, str(NB_DIR))
import exercise_checks as ec  # noqa: E402

CHAPTERS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
CHECK_CALL = re.compile(r"\bec\.(check_(\d\d)_\w+)\(")
HEADING = re.compile(r"^### Exercise (\d+): \S")
NOT_ATTEMPTED_LINE = re.compile(r"^exercise (\d\d)\.(\d): not attempted yet\. Hint: .+ Worked solution: "
                                r"(\.\./|notebooks/)?solutions/\d\d_\w+\.ipynb$")  # from the notebook's folder


def exercises(nb) -> list[tuple[int, list]]:
    """(number, code cells up to the next markdown cell) for each "### Exercise k:" heading."""
    found = []
    for i, cell in enumerate(nb.cells):
        m = HEADING.match(cell.source) if cell.cell_type == "markdown" else None
        if m:
            code = []
            for later in nb.cells[i + 1:]:
                if later.cell_type == "markdown":
                    break
                code.append(later)
            found.append((int(m.group(1)), code))
    return found


def checks_called(nb) -> list[str]:
    return [m.group(1) for c in nb.cells if c.cell_type == "code" for m in CHECK_CALL.finditer(c.source)]


def test_every_chapter_is_found():
    assert [p.name[:2] for p in CHAPTERS] == [f"{i:02d}" for i in range(11)]
    assert sorted(ec.CHAPTERS.values()) == [p.stem for p in CHAPTERS]


def test_every_check_is_used_once():
    called = [name for p in CHAPTERS for name in checks_called(nbformat.read(p, as_version=4))]
    defined = sorted(name for name in vars(ec) if name.startswith("check_"))
    assert sorted(called) == defined, "each check of exercise_checks.py belongs to exactly one exercise"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_exercises_have_a_placeholder_and_a_check(path):
    nb = nbformat.read(path, as_version=4)
    found = exercises(nb)
    low = 1 if path.name.startswith("00") else 2
    assert low <= len(found) <= 4, f"{path.name}: {len(found)} exercises"
    assert [k for k, _ in found] == list(range(1, len(found) + 1)), f"{path.name}: exercises numbered 1, 2, ..."
    for k, code in found:
        assert len(code) >= 2, f"{path.name} exercise {k}: a cell for the learner's code, then a check cell"
        *work, check = code
        calls = CHECK_CALL.findall(check.source)
        assert len(calls) == 1 and calls[0][1] == path.name[:2], f"{path.name} exercise {k}: one check of this chapter"
        assert hasattr(ec, calls[0][0]), f"{calls[0][0]} is not in exercise_checks.py"
        for cell in work:  # the learner's starting point: a placeholder, never the answer
            assert not CHECK_CALL.search(cell.source)
            assert "None" in cell.source or "raise NotImplementedError" in cell.source, \
                f"{path.name} exercise {k}: the learner's cell should hold a placeholder"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_solution_notebook_runs_the_same_checks(path):
    solution = NB_DIR / "solutions" / path.name
    assert solution.is_file(), f"no solution notebook for {path.name}"
    chapter_nb, solution_nb = nbformat.read(path, as_version=4), nbformat.read(solution, as_version=4)
    assert checks_called(solution_nb) == checks_called(chapter_nb)
    assert len(exercises(solution_nb)) == len(exercises(chapter_nb))
    assert any("ec.STRICT = True" in c.source for c in solution_nb.cells), "a solution notebook must pass its checks"
    assert f"../{path.name}" in solution_nb.cells[0].source, "the header links back to the chapter"
    assert solution_nb.metadata.get("kernelspec") == chapter_nb.metadata.get("kernelspec"), \
        f"{solution.name}: its kernelspec should be its chapter's (copy the chapter's metadata)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_committed_check_outputs_show_no_answer(path):
    """Executed or not, a chapter's check cells show at most the not-attempted line of their own exercise."""
    nb = nbformat.read(path, as_version=4)
    for k, code in exercises(nb):
        for out in code[-1].get("outputs", []):
            assert out["output_type"] == "stream", f"{path.name} exercise {k}: a check shows only printed lines"
            for line in out["text"].strip().splitlines():
                m = NOT_ATTEMPTED_LINE.match(line)
                assert m and (m.group(1), int(m.group(2))) == (path.name[:2], k), \
                    f"{path.name} exercise {k}: committed output {line[:80]!r} is not the not-attempted line"


def _raises_not_implemented(*args, **kwargs):
    raise NotImplementedError


@torch.no_grad()
def _losses(model, micro_batches):
    from minimind_lib.data import trained_tokens
    from minimind_lib.model import lm_loss
    return [(float(lm_loss(model(mb["input_ids"]).logits, mb["labels"], reduction="sum")), trained_tokens(mb["labels"]))
            for mb in micro_batches]


def _naive_loss(model, micro_batches):  # 04.1's answer: the mean of the micro-batches' mean token losses
    return sum(s / n for s, n in _losses(model, micro_batches)) / len(micro_batches)


def _token_weighted_loss(model, micro_batches):  # 04.3's answer: every trained token of the step weighs the same
    losses = _losses(model, micro_batches)
    return sum(s for s, _ in losses) / sum(n for _, n in losses)


LIGHT_CASES = {  # check, placeholder, wrong answer, right answer, text the placeholder's output must not show
    "00.2": (ec.check_00_memory_fraction, _raises_not_implemented, lambda card: 0.3, lambda card: 24 / card, "24 /"),
    "02.3": (ec.check_02_memmap_bytes, _raises_not_implemented, lambda t, n: 2 * t + 8 * n,
             lambda t, n: 2 * t + 8 * (n + 1) + 128, "128 +"),
    "03.1": (ec.check_03_block_params, _raises_not_implemented,
             lambda c: 4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.intermediate_size,
             lambda c: 2 * c.hidden_size ** 2 + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
             + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size, "2 * c"),
    "04.2": (ec.check_04_token_weights, _raises_not_implemented, lambda counts, norm: [1 / sum(counts)] * len(counts),
             lambda counts, norm: ([1 / (len(counts) * n) for n in counts] if norm == "naive"
                                   else [1 / sum(counts)] * len(counts)), "len(counts)"),
    "05.1": (ec.check_05_rounding_error, _raises_not_implemented, lambda x, dt: 2.0 ** -8,
             lambda x, dt: float(((x.to(dt).float() - x).abs() / x.abs()).max()), "2^-8"),
    "05.3": (ec.check_05_t4, None, ("bf16", False), ("fp16", True), "fp16"),
    "08.2": (ec.check_08_masked_loss, _raises_not_implemented, lambda logits, labels: logits.mean(),
             lambda logits, labels: torch.nn.functional.cross_entropy(
                 logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100),
             "[:, :-1]"),
    "09.1": (ec.check_09_rank_loss, _raises_not_implemented, lambda s, n, w: s / n, lambda s, n, w: s / n * w, "* w"),
    "09.4": (ec.check_09_unmatched_broadcasts, _raises_not_implemented, lambda f: f[0] - f[1],
             lambda f: f[0] - min(f), "min("),
    "04.1": (ec.check_04_naive_loss, _raises_not_implemented, _token_weighted_loss, _naive_loss, "mean of"),
    "04.3": (ec.check_04_exact_loss, _raises_not_implemented, _naive_loss, _token_weighted_loss, "sum("),
}


def _lora_trainable(c, rank, targets):  # 10.1's answer: rank x (in + out) for each adapted projection, per block
    h, f, q, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + f, "up_proj": h + f,
             "down_proj": f + h}
    return c.num_hidden_layers * rank * sum(sizes[t] for t in targets)


def _kl(p, q):
    lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


LIGHT_CASES.update({
    "10.1": (ec.check_10_lora_trainable, _raises_not_implemented,
             lambda c, rank, targets: c.num_hidden_layers * len(targets) * rank * 2 * c.hidden_size,  # all square
             _lora_trainable, "sum("),
    "10.2": (ec.check_10_margin_for, _raises_not_implemented, lambda loss, beta: -math.log(math.expm1(loss)),
             lambda loss, beta: -math.log(math.expm1(loss)) / beta, "expm1"),
    "10.3": (ec.check_10_reply_kl, _raises_not_implemented, lambda p, q: _kl(q, p), _kl, "log_softmax(-1)"),
})


def _call(check, answer):
    return check(*answer) if isinstance(answer, tuple) else check(answer)


@pytest.mark.parametrize("name", sorted(LIGHT_CASES))
def test_check_says_not_attempted_fails_wrong_and_passes_right(name, capsys, monkeypatch):
    check, placeholder, wrong, right, secret = LIGHT_CASES[name]
    _call(check, (placeholder, placeholder) if check is ec.check_05_t4 else placeholder)
    shown = capsys.readouterr().out
    assert NOT_ATTEMPTED_LINE.match(shown.strip()) and f"exercise {name}:" in shown
    assert secret not in shown, "the not-attempted line must not show the answer"
    with pytest.raises(AssertionError, match=f"exercise {name}: not right yet: .* Hint: "):
        _call(check, wrong)
    _call(check, right)
    assert capsys.readouterr().out.strip() == f"exercise {name}: passed"
    monkeypatch.setattr(ec, "STRICT", True)  # the solution notebooks: an unattempted exercise fails
    with pytest.raises(AssertionError, match="not attempted yet"):
        _call(check, (placeholder, placeholder) if check is ec.check_05_t4 else placeholder)


def test_a_wrong_answer_shows_its_message_not_the_check_source():
    with pytest.raises(ec.NotRightYet) as caught:
        ec.check_00_memory_fraction(0.5)
    rendered = "\n".join(caught.value._render_traceback_())
    assert "not right yet" in rendered and "Hint:" in rendered
    assert "exercise_checks.py" not in rendered and "digest(" not in rendered  # no source lines, no file


def test_an_answer_of_the_wrong_arity_or_type_gets_the_hint():
    with pytest.raises(ec.NotRightYet, match=r"02.3: not right yet: checking your answer raised TypeError: .* Hint: "):
        ec.check_02_memmap_bytes(lambda n_tokens: n_tokens)  # one argument where two are passed
    with pytest.raises(ec.NotRightYet, match="00.2: not right yet: .*float"):
        ec.check_00_memory_fraction(lambda card_gib: "0.3")


def test_in_jupyter_a_wrong_answer_prints_no_traceback(tmp_path):
    """Run a wrong answer in a real kernel: its error output is the message alone (the check's lines give answers)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    cell = nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(ec.__file__.rsplit('/', 1)[0])!r})\n"
                                     "import exercise_checks as ec\nec.check_00_memory_fraction(0.5)")
    nb = nbformat.v4.new_notebook(cells=[cell])
    with pytest.raises(CellExecutionError):
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    error = next(o for o in nb.cells[0].outputs if o.output_type == "error")
    shown = "\n".join(error.traceback)
    assert error.ename == "NotRightYet" and "Hint:" in shown
    assert "exercise_checks.py" not in shown and "assert " not in shown, shown


@pytest.mark.parametrize("profile", ["smoke", "workshop", "cpu", "gpu"])
def test_04_tells_the_naive_and_the_exact_loss_apart_in_every_profile(profile, monkeypatch, capsys):
    """The 04.1 and 04.3 checks draw a step of their own (the same whatever the profile), where the two losses differ
    by more than 1: each rejects the other's answer. (In the smoke profile's section-4 step they differ by 1.7e-6.)"""
    monkeypatch.setenv("MINIMIND_PROFILE", profile)
    with pytest.raises(ec.NotRightYet, match="04.1: not right yet: that is the token-weighted loss"):
        ec.check_04_naive_loss(_token_weighted_loss)
    with pytest.raises(ec.NotRightYet, match="04.3: not right yet: that is the naive loss"):
        ec.check_04_exact_loss(_naive_loss)
    ec.check_04_naive_loss(_naive_loss)
    ec.check_04_exact_loss(_token_weighted_loss)
    assert capsys.readouterr().out.splitlines() == ["exercise 04.1: passed", "exercise 04.3: passed"]
    model, micro = ec.hard_and_easy_step()
    assert abs(_naive_loss(model, micro) - _token_weighted_loss(model, micro)) > 1.0


@pytest.mark.parametrize("name", ["00.2", "02.3", "04.1", "04.3", "05.1", "09.4"])
def test_a_table_of_the_answers_it_saw_does_not_pass_again(name, capsys):
    """These checks once compared a small value or a function's outputs on fixed inputs with a digest, which trying
    values reversed in a second (00.2 -> 0.3, 09.4 -> 2). Now they draw their inputs afresh at every call: a function
    that answers only the inputs of an earlier passing call (a table of answers) fails the next one."""
    check, _, _, right, _ = LIGHT_CASES[name]
    seen = {}

    def recording(*args):
        seen[repr(args)] = right(*args)
        return seen[repr(args)]

    _call(check, recording)
    assert capsys.readouterr().out.strip() == f"exercise {name}: passed"
    with pytest.raises(ec.NotRightYet, match=f"exercise {name}: not right yet: "):
        _call(check, lambda *args: seen[repr(args)])
