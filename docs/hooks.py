"""MkDocs hooks: pages that live elsewhere in the repository join the site where they are.

ARCHITECTURE.md, deploy/README.md, bench/README.md and the examples' READMEs stay where a
reader of the repository finds them and are published from there, not copied. Every page
links by repository paths (`../bench/README.md` from docs/, `../docs/howto/vllm.md` from
bench/), so a link works on a repository browser too; here each is rewritten to the page it
became (then mkdocs checks it, `--strict`)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]

# site page <- repository file
FROM_REPO = {
    "architecture.md": "ARCHITECTURE.md",
    "deploy.md": "deploy/README.md",
    "benchmarks/index.md": "bench/README.md",
    "examples/calculator_agent.md": "examples/calculator_agent/README.md",
    "examples/reasoning_gym.md": "examples/reasoning_gym/README.md",
    "examples/verifiers_env.md": "examples/verifiers_env/README.md",
    "examples/openenv_guess.md": "examples/openenv_guess/README.md",
}
PAGE_OF = {source: page for page, source in FROM_REPO.items()}
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def on_files(files: Files, config: Any) -> Files:
    for page, source in FROM_REPO.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / source)))
    return files


def site_page(repo_path: str) -> str | None:
    """The site page a repository file became, if it is one."""
    if repo_path in PAGE_OF:
        return PAGE_OF[repo_path]
    return repo_path.removeprefix("docs/") if repo_path.startswith("docs/") else None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = page.file.src_uri
    source = FROM_REPO.get(here, f"docs/{here}")

    def to_site(m: re.Match[str]) -> str:
        target = m.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return m.group(0)
        page_path = site_page(posixpath.normpath(posixpath.join(posixpath.dirname(source),
                                                                target)))
        if page_path is None:
            return m.group(0)
        rel = posixpath.relpath(page_path, posixpath.dirname(here) or ".")
        return f"{m.group(1)}{rel}{m.group(3) or ''}{m.group(4)}"

    return LINK.sub(to_site, markdown)
