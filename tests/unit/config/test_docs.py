"""The README and the manual in docs/ name only things that exist, and the README stays one screen.

Every repository path, ``module.path[:name]`` of this project, ``make`` target, ``grpo`` subcommand and config key
that README.md or a docs/ page names in code (inline code spans and fenced blocks) or links to is checked
against the repository itself: the files on disk, the Makefile's targets, the commands ``flows/cli.py`` registers
(read with ``ast``, so Prefect is not imported) and ``RunConfig``'s fields. The configuration reference must be
what ``scripts/gen_config_reference.py`` makes from the schema today. No mkdocs is needed (``make docs`` builds
the site).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
#: Top-level entries a named path may start with: the repository's own (not what runs, builds or venvs leave).
NOT_REPO = {".git", ".venv", ".stamps", ".cache", ".gpu", ".pytest_cache", ".hypothesis", "runs", "site", "target"}
#: Keys the docs name on purpose although RunConfig has none: removed fields (refused with the field that replaced
#: them), the misspelling an error message example shows, and a checkpoint's tensor prefix.
NOT_KEYS = {"server.enable_lora", "server.lora_rank", "rollout.max_steps", "train.max_stepz", "model.language_model"}
#: Dotted names that are no module: the entry-point group of third-party packers.
NOT_MODULES = {"grpo_core.packers"}


def _code(text: str) -> list[str]:
    """The code of a Markdown page: every fenced block and every inline code span."""
    fences = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return fences + re.findall(r"`([^`\n]+)`", rest)


def _links(text: str) -> list[str]:
    """Targets of Markdown links and images, without their ``#anchor``; web addresses left out."""
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+://|mailto:|#", t) and t.split("#", 1)[0]]


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir()} - NOT_REPO


_PATH = re.compile(r"(?<![\w./<>{}$-])(\.?[A-Za-z_][\w.-]*(?:/[\w.*{}-]+)*/?)")


def named_paths(text: str, top: set[str]) -> set[str]:
    """Repository paths a page names in code: tokens whose first part is a top-level entry of the repository
    (``configs/demo.yaml``, ``grpo_core/train/recurrent.py``, ``.ci/run``, ``Makefile``)."""
    found = set()
    for code in _code(text):
        for token in _PATH.findall(code):
            first = token.split("/", 1)[0]
            if first in top and ("/" in token or first == token) and "{" not in token:
                found.add(token.rstrip("/.,;:"))
    return found


def test_the_readme_is_one_screen():
    words = len(README.read_text().split())
    assert 0 < words <= 2000, f"README.md has {words} words; move detail into a docs/ page"


def test_every_page_is_in_the_site_navigation():
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in DOCS.glob("*.md")}
    assert len(pages) >= 10, "the manual's pages are missing from docs/"
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", mkdocs, flags=re.MULTILINE))
    assert pages == listed, (
        f"docs/ pages not in mkdocs.yml nav: {pages - listed}; nav entries with no page: {listed - pages}"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_exist(page):
    text, top = page.read_text(), _top_level()
    missing = []
    for path in sorted(named_paths(text, top)):
        if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
            missing.append(path)
    for target in _links(text):
        if not (page.parent / target).exists():
            missing.append(f"link {target}")
    assert not missing, f"{page.name} names what does not exist: {missing}"


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


_MODULE = re.compile(r"(?<![\w.])((?:grpo_core|flows|deployments|benchmarks|examples)(?:\.\w+)+)(?::([\w.]+))?")


def _bound_names(path: Path) -> set[str]:
    """Every name a module binds anywhere (defs, classes, assignments, imports; a package's ``__init__`` re-exports
    count), read from its syntax tree."""
    bound = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return bound


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_modules_and_names_exist(page):
    """``grpo_core.rollout.scoring.REWARD_ARGUMENTS``, ``examples.rewards:contains_answer``: the longest prefix is
    a module file of the repository, and the name after it is defined there."""
    wrong = []
    for code in _code(page.read_text()):
        for dotted, attr in _MODULE.findall(code):
            if dotted in NOT_MODULES:
                continue
            parts = dotted.split(".")
            cut = next((i for i in range(len(parts), 0, -1) if _module_file(".".join(parts[:i]))), 0)
            if cut == 0:
                wrong.append(dotted)
                continue
            names = ([attr.split(".")[0]] if attr else []) + parts[cut:][:1]
            bound = _bound_names(_module_file(".".join(parts[:cut])))
            for name in names:
                if name not in bound:
                    wrong.append(f"{dotted}{':' + attr if attr else ''} ({name} not defined)")
    assert not wrong, f"{page.name} names modules or names that do not exist: {wrong}"


def make_targets() -> set[str]:
    """Targets of the Makefile: ``name:`` rules (not variable assignments, not pattern or special targets)."""
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z][\w-]*(?:\s+[A-Za-z][\w-]*)*)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def grpo_commands() -> set[str]:
    """``grpo`` subcommands registered in flows/cli.py: ``train``, ``config schema``, ... (by ``ast``)."""
    tree = ast.parse((ROOT / "flows" / "cli.py").read_text())
    groups = {"app": ""}
    for node in ast.walk(tree):  # app.add_typer(config_app, name="config")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_typer":
            name = next(k.value.value for k in node.keywords if k.arg == "name")
            groups[node.args[0].id] = name + " "
    commands = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "command":
                group = groups.get(getattr(deco.func.value, "id", ""))
                if group is None:
                    continue
                name = deco.args[0].value if deco.args else node.name.replace("_", "-")
                commands.add(group + name)
    return commands


def test_the_command_lists_are_read():
    """The parsers above see what the two commands of the README need (else the checks below check nothing)."""
    assert {"demo", "test", "demo-smoke", "serve", "docs"} <= make_targets()
    assert {"train", "validate", "resume", "deploy", "ui", "config schema", "config show"} <= grpo_commands()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_make_targets_and_grpo_commands_exist(page):
    targets, commands = make_targets(), grpo_commands()
    groups = {c.split()[0] for c in commands if " " in c}
    wrong = []
    for code in _code(page.read_text()):
        for target in re.findall(r"(?:^|[\s(`;&|])make\s+((?:[A-Za-z][\w-]*\s*)+)", code, flags=re.MULTILINE):
            name = target.split()[0]
            if name not in targets:
                wrong.append(f"make {name}")
        for first, second in re.findall(r"(?:^|[\s/(`])grpo\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?", code, re.MULTILINE):
            if first in groups:
                if second and f"{first} {second}" not in commands:
                    wrong.append(f"grpo {first} {second}")
            elif first not in commands:
                wrong.append(f"grpo {first}")
    assert not wrong, f"{page.name} names commands that do not exist: {wrong}"


def _config_keys() -> set[str]:
    from grpo_core.config import RunConfig

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_reference as gen
    finally:
        sys.path.pop(0)
    return {key for _, _, fields in gen.sections(RunConfig) for key, _ in fields} | {
        name for name, _, _ in gen.sections(RunConfig) if name
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_config_keys_exist(page):
    keys = _config_keys()
    sections = {k.split(".")[0] for k in keys if "." in k}
    wrong = set()
    for code in _code(page.read_text()):
        for key in re.findall(rf"(?<![\w./-])((?:{'|'.join(sections)})\.[a-z_][\w.]*[a-z0-9_])", code):
            if key not in keys and key not in NOT_KEYS and not re.search(r"\.(py|json|yaml|md)$", key):
                wrong.add(key)
    assert not wrong, f"{page.name} names config keys RunConfig does not have: {sorted(wrong)}"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_generated_from_the_schema():
    from grpo_core.config import RunConfig, TrainConfig

    gen = _load_generator()
    page = (DOCS / "configuration.md").read_text()
    assert page == gen.render(RunConfig), "docs/configuration.md is stale: run python scripts/gen_config_reference.py"
    # Independent of the generator: every field of a section is a row with its default, and a bound shows.
    for name in TrainConfig.model_fields:
        assert f"| `train.{name}` |" in page or name == "lora", name
    assert "| `train.lora.r` | int | `16` | rank | ≥ 1, ≤ 512 |" in page
    assert "| `server.port` | int | `8000` | TCP port | ≥ 0, ≤ 65535 |" in page
    assert "| `rollout.reward_timeout_s` | float \\| null | `300.0` | seconds | > 0 |" in page


def test_the_example_config_loads_and_its_rewards_score_by_hand():
    """The README's example: the config parses, names the example data and rewards, and the rewards give the values
    their definitions promise (worked by hand)."""
    from grpo_core.config import load_config

    cfg = load_config(ROOT / "examples" / "capitals.yaml")
    assert cfg.rollout.dataset == "json:examples/capitals.jsonl" and (ROOT / "examples" / "capitals.jsonl").is_file()
    assert cfg.rollout.reward_functions == ["examples.rewards:contains_answer", "examples.rewards:brevity"]
    sys.path.insert(0, str(ROOT))
    try:
        from examples.rewards import brevity, contains_answer
    finally:
        sys.path.pop(0)
    completions = [[{"role": "assistant", "content": "It is paris."}], [{"role": "assistant", "content": "Lyon"}]]
    assert contains_answer(completions, ["Paris", "Paris"]) == [1.0, 0.0]
    # 0.2 * (1 - n/32): 8 tokens -> 0.15, 32 or more -> 0
    assert brevity([[1] * 8, [1] * 40]) == [pytest.approx(0.15), 0.0]
