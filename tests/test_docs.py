"""The README and docs/ as a reader meets them: the README's snippets and its own-CSV
command run as written, every relative link and anchor resolves, the README stays short and
its contents list matches its sections; and the docstring examples of the core modules run."""

import doctest
import re
import shlex
import shutil
from pathlib import Path
from typing import Dict, List

import pytest

import torchrec_cowclip.embedding.row_gradients as row_gradients
import torchrec_cowclip.optim.functional as functional
import torchrec_cowclip.optim.reference as reference
import torchrec_cowclip.train.scaling as scaling

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "data" / "README.md"]
README_MAX_LINES = 500


def _blocks(text: str, language: str) -> List[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _section(text: str, heading: str) -> str:
    """The README's section under ``## heading``, up to the next one."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_readme_usage_snippet_runs():
    snippet = next(b for b in _blocks(README.read_text(), "python") if "kt = ebc(kjt)" in b)
    namespace: dict = {}
    exec(compile(snippet, str(README), "exec"), namespace)  # noqa: S102 - our own README
    stats = namespace["ebc"].clip_stats()
    assert stats["t0"].rows_updated == 3 and stats["t0"].steps == 1  # rows 1, 2, 3 of f0


def test_the_compile_snippet_of_the_triton_notes_runs():
    """docs/triton.md's model compiled whole: its step updates the tables."""
    import torch

    snippet = next(
        b
        for b in _blocks((REPO / "docs" / "triton.md").read_text(), "python")
        if "torch.compile(" in b
    )
    namespace: dict = {}
    torch._dynamo.reset()
    exec(compile(snippet, "docs/triton.md", "exec"), namespace)  # noqa: S102 - our own docs
    stats = namespace["model"].embedding_collection.clip_stats()
    assert all(s.steps == 1 for s in stats.values()) and stats["emb_f0"].rows_updated == 2


def test_the_torch_export_snippet_of_the_serving_notes_runs(tmp_path, monkeypatch):
    """docs/serving.md's own model exported whole: saved, loaded, equal to eager."""
    snippet = next(
        b
        for b in _blocks((REPO / "docs" / "serving.md").read_text(), "python")
        if "torch.export.export(" in b
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "docs/serving.md", "exec"), namespace)  # noqa: S102 - our own docs
    assert "ebc.embedding_bags.t0.weight" in namespace["program"].state_dict


def test_readme_own_csv_command_prints_what_it_shows_and_the_model_snippet_scores(
    tmp_path, monkeypatch, capsys
):
    """ "Train on your own CSV"'s command, run as written from a clone (in a scratch copy),
    starts with the lines the README shows; "Use the trained model"'s commands then
    score, evaluate and export the run, and its snippet loads the run and scores the file."""
    from torchrec_cowclip.cli import main

    text = README.read_text()
    own_csv = _section(text, "Train on your own CSV")
    command = shlex.split(_blocks(own_csv, "bash")[0].replace("\\\n", " "))
    assert command[:2] == [".venv/bin/torchrec-cowclip", "train"]
    (tmp_path / "tests" / "data").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "data" / "clicks_sample.csv", tmp_path / "tests" / "data")
    monkeypatch.chdir(tmp_path)
    assert main(command[1:] + ["--no-progress"]) == 0
    err = capsys.readouterr().err
    shown = _blocks(own_csv, "text")[0].splitlines()
    for line in shown:
        if line.startswith("epoch "):  # timings and float sums: not compared
            continue
        assert line.removesuffix(" ...") in err, f"README shows {line!r}; the run printed:\n{err}"
    use = _section(text, "Use the trained model")
    for line in _blocks(use, "bash")[0].splitlines():  # predict, evaluate, export
        scoring = shlex.split(line)
        assert scoring[0] == ".venv/bin/torchrec-cowclip", line
        assert main(scoring[1:]) == 0, line
    assert (tmp_path / "runs" / "clicks-scores.csv").is_file()
    assert (tmp_path / "runs" / "clicks-serving" / "model.pt2").is_file()
    snippet = _blocks(use, "python")[0]
    namespace: dict = {}
    exec(compile(snippet, str(README), "exec"), namespace)  # noqa: S102 - our own README
    clicks = namespace["clicks"]
    assert clicks.shape == (2000,) and bool(((clicks > 0) & (clicks < 1)).all())


def test_readme_is_short_and_its_contents_list_its_sections():
    text = README.read_text()
    assert text.count("\n") < README_MAX_LINES, (
        f"README.md has {text.count(chr(10))} lines; keep it under {README_MAX_LINES} and "
        "move detail into docs/"
    )
    sections = [h for h in re.findall(r"^## (.+)$", text, re.M) if h != "Contents"]
    listed = re.findall(r"^\d+\. \[(.+?)\]\(#([^)]+)\)$", _section(text, "Contents"), re.M)
    assert [title for title, _ in listed] == sections
    assert [anchor for _, anchor in listed] == [github_anchor(s) for s in sections]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> List[str]:
    """Every heading's anchor on ``page`` (repeated headings get -1, -2, ... as on GitHub)."""
    seen: Dict[str, int] = {}
    out = []
    for heading in re.findall(r"^#{1,6} (.+)$", _outside_code(page.read_text()), re.M):
        anchor = github_anchor(heading)
        if anchor in seen:
            seen[anchor] += 1
            anchor = f"{anchor}-{seen[anchor]}"
        else:
            seen[anchor] = 0
        out.append(anchor)
    return out


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert broken == [], f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize(
    "module",
    [functional, reference, row_gradients, scaling],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
