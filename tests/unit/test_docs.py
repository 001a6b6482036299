"""The docs stay true: every relative link of every Markdown file in the repository reaches a
file (and a heading, for `#anchor`s), the README included, which the docs site does not
contain (`mkdocs build --strict` checks the site's pages again, rewritten); the committed
config reference is what the schema renders; the TOML shown in the README loads."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from rlhf_async.config import load_config

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"site", "runs", "build", "dist", "node_modules"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.md")
                  if not any(part.startswith(".") or part in SKIP_DIRS or
                             part.endswith(".egg-info")
                             for part in p.relative_to(REPO).parts[:-1]))


def prose(text: str) -> str:
    """The text outside code blocks and code spans, where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slugs(text: str) -> set[str]:
    """Heading anchors as GitHub and mkdocs (Python-Markdown's toc) make them."""
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            words = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "")).strip().lower()
            out |= {words.replace(" ", "-"), re.sub(r"[-\s]+", "-", words)}
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    text = path.read_text()
    out = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text()):
            out.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return out


def test_every_relative_link_in_the_repository_resolves():
    files = markdown_files()
    assert REPO / "README.md" in files and REPO / "docs" / "index.md" in files
    broken = {str(p.relative_to(REPO)): b for p in files if (b := broken_links(p))}
    assert not broken, broken


def test_the_link_check_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title `x`\n\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#title-x) [ok](a.md#two-words) `[code](gone.md)`\n"
                    "[gone](gone.md) [bad](a.md#nope) [web](https://example.org/x.md)\n"
                    "```\n[fenced](gone.md)\n```\n")
    assert broken_links(page, tmp_path) == ["gone.md: no such file", "a.md#nope: no heading #nope in a.md"]


def _render_config_reference() -> str:
    spec = importlib.util.spec_from_file_location("gen_config_reference",
                                                  REPO / "docs" / "gen_config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render()


def test_config_reference_page_matches_the_schema():
    committed = (REPO / "docs" / "reference" / "config.md").read_text()
    assert committed == _render_config_reference(), \
        "regenerate: python docs/gen_config_reference.py"


@pytest.mark.parametrize("block", re.findall(r"^```toml\n(.*?)^```", (REPO / "README.md")
                                             .read_text(), re.S | re.M))
def test_the_readme_config_example_loads(block, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(block)
    load_config(job, [])


def test_ci_runs_the_readmes_test_command_verbatim():
    """The README's two commands for a fresh machine: the first installs and runs the built-in
    example, the second installs and runs the tests, and `.ci/run` runs exactly that one."""
    section = (REPO / "README.md").read_text().split("## Two commands for a fresh machine")[1]
    commands = re.findall(r"^```bash\n(.*?)\n```", section.split("\n## ")[0], re.S | re.M)
    assert len(commands) == 2, commands
    run, test = commands
    assert run.endswith(".venv/bin/rlhf-async run") and "-e ." in run
    assert test.endswith("-m pytest -q") and "'.[test]'" in test
    assert test in (REPO / ".ci" / "run").read_text().splitlines()
