"""The documentation works as written: README.md, CONTRIBUTING.md, CHANGELOG.md and docs/**/*.md.

Every ```python block runs (each in a fresh temporary working directory), every relative link and image
points at a file that exists (and an anchor into a Markdown file at one of its headings), and README.md
stays a short guide. A block that cannot run here (a GPU, TRL, the shipped real model) is fenced ```py
instead (CONTRIBUTING.md, "Documentation is tested").
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 260

FENCED = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
PYTHON = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


BLOCKS = [(name(page), i, code) for page in PAGES for i, code in enumerate(PYTHON.findall(page.read_text()))]


def test_readme_has_examples():
    assert sum(page == "README.md" for page, _, _ in BLOCKS) >= 2
    assert len({page for page, _, _ in BLOCKS}) >= 3  # the docs' blocks are collected too


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{page}-{i}" for page, i, _ in BLOCKS])
def test_python_block_runs(page, index, code, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what an example writes (a run directory) goes there
    exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": "docs"})


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to dashes."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", FENCED.sub("", path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(page: Path) -> list[str]:
    text = FENCED.sub("", page.read_text())
    text = re.sub(r"``.*?``|`[^`\n]*`", "", text)  # code spans are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_point_at_files(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {name(file)} has no heading with anchor #{anchor}")
    assert not broken, f"{name(page)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    """A page a user cannot find from README.md (directly, or through pages it links) is lost."""
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.is_file():
            continue
        reached.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in links(page) if t.partition("#")[0]]
    missing = [name(p) for p in PAGES if p.resolve() not in reached]
    assert not missing, f"not linked from README.md or the pages it links: {missing}"


def test_readme_is_a_short_guide():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )
    text = README.read_text()
    assert text.index("bash scripts/demo.sh") < text.index("bash scripts/test.sh") < text.index("```python")


def commands(page: Path) -> list[str]:
    """The `fastes ...` command lines of a page's bash blocks (after torchrun, `-m fastes.cli` too)."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                match = re.search(r"(?:^|\s|/)(?:fastes|-m fastes\.cli)\s+(\w.*)", part)
                if match and not part.lstrip().startswith(("pip", "python -m pytest")):
                    found.append(re.sub(r"\[(--[^\]]*)\]", r"\1", match.group(1)).strip())  # [--opt]: kept
    return found


COMMANDS = [(name(page), line) for page in PAGES for line in commands(page)]


@pytest.mark.parametrize("page,line", COMMANDS, ids=[f"{p}: fastes {c}" for p, c in COMMANDS])
def test_command_lines_parse(page, line):
    """Every `fastes` command a page shows is accepted by the command line's parser (flags and values)."""
    import shlex

    from fastes.cli import _normalise_flags, build_parser

    argv = shlex.split(line)
    if "--help" in argv:
        argv.remove("--help")
    build_parser().parse_args(_normalise_flags(argv))  # argparse exits (status 2) on a bad flag or value
