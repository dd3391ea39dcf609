"""The docs as a user reads and types them: README.md, every guide in docs/, bench/README.md and each example's README.

- Every relative link resolves to a file of the repository, and to one of its headings (by GitHub's anchors) where it
  names one.
- Every command of a ``bash``/``sh``/``console`` block, of a ``cmd:`` line of a ``yaml`` block and of an inline code
  span that starts with make, rlhf, dvc, accelerate, python or bash runs as typed: its make target is the Makefile's,
  its stage command and ``--options`` are the stage CLI's (read from its ``--help``), its dvc stage is dvc.yaml's, its
  ``-S key=value`` names a key of params.yaml (``+key`` a new one under a section it has, as DVC's Hydra overrides
  want), the repository files it names exist, and a script's ``--flags`` are in its argparse definitions.
- Every file path, pytest node and dotted ``ppo_core.*`` / ``stages.*`` name in the prose's code spans exists.
- Every ``python`` block parses, and what it imports from ppo_core, stages and rewards exists.

Fast: no DVC run and no training; the CLI's help runs in a subprocess once per command named. Each problem is one
line: doc:line, the command, link or name, what is wrong.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import re
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote

import pytest
from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
        *sorted((ROOT / "examples").glob("*/README.md")))
SHELL = {"bash", "sh", "shell", "console"}
OWN_PACKAGES = ("ppo_core", "stages", "rewards")
REPO_DIRS = ("bench", "configs", "docs", "examples", "ppo_core", "rewards", "stages", "tests")  # first path parts
REPO_FILES = ("Makefile", "dvc.yaml", "dvc.lock", "params.yaml", "pyproject.toml")
SEPARATORS = {"&&", "||", ";", "|", "&", "|&"}
INLINE_PROGRAMS = {"make", "rlhf", "dvc", "accelerate", "python", "bash"}  # an inline `span` starting so is a command
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", flags=re.S)
EXP_RUN_VALUES = {"-S", "--set-param", "-C", "--copy-paths", "-n", "--name", "-j", "--jobs", "-m", "--message"}


class Block(NamedTuple):
    """A fenced code block: its language, the line of its first line of code (1-based), its lines."""

    lang: str
    line: int
    lines: list[str]


def rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def where(doc: Path, line: int) -> str:
    return f"{rel(doc)}:{line}"


def split_fences(text: str) -> tuple[list[Block], str]:
    """The fenced blocks of a markdown text, and its prose: the text with every block's lines blanked (so offsets
    still give line numbers)."""
    blocks, prose, fence, current = [], [], None, None
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if fence is None:
            opening = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if opening:
                fence, current = opening.group(1), Block(opening.group(2).lower(), number + 1, [])
                prose.append("")
                continue
            prose.append(line)
        else:
            prose.append("")
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                blocks.append(current)
                fence = None
            else:
                current.lines.append(line)
    return blocks, "\n".join(prose)


def without_code_spans(prose: str) -> str:
    """Inline code spans (`x`, ``x `y` z``, across a line break too) blanked, newlines kept."""
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text, lowercased, punctuation but `-` and `_` dropped, spaces to
    `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a markdown file's headings; a repeated one gets -1, -2, ... as on GitHub."""
    _, prose = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in prose.split("\n"):
        heading = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def link_problems(doc: Path, text: str, root: Path = ROOT) -> list[str]:
    """Each relative link (and image) of the doc's prose that leads to no file under `root` (the repository), or to no
    heading of it."""
    _, prose = split_fences(text)
    prose = without_code_spans(prose)
    inline = r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*)?\)"
    reference = r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)"
    problems = []
    for match in [*re.finditer(inline, prose), *re.finditer(reference, prose, flags=re.M)]:
        target, line = match.group(1), prose.count("\n", 0, match.start()) + 1
        if re.match(r"[a-zA-Z][\w+.-]*:|//", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / unquote(path)).resolve() if path else doc
        if not file.is_relative_to(root):
            problems.append(f"{where(doc, line)}: link `{target}`: leads out of the repository ({file})")
        elif not file.exists():
            problems.append(f"{where(doc, line)}: link `{target}`: no such file {rel(file, root)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{where(doc, line)}: link `{target}`: {rel(file, root)} has no heading whose anchor "
                            f"is #{anchor}")
    return problems


def command_lines(block: Block) -> list[tuple[int, str]]:
    """(line, command) in a shell block: `\\` continuations joined, `$ ` prompts taken off, comment lines skipped; in a
    console block, only the prompted lines (the rest is output)."""
    found, pending, start = [], "", 0
    for number, line in enumerate(block.lines, start=block.line):
        if not pending:
            stripped = line.strip()
            if block.lang == "console" and not stripped.startswith("$ "):
                continue
            stripped = stripped.removeprefix("$ ")
            if not stripped or stripped.startswith("#"):
                continue
            start, line = number, stripped
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append((start, pending + line.strip()))
        pending = ""
    if pending:
        found.append((start, pending))
    return found


def inline_commands(prose: str) -> list[tuple[int, str]]:
    """(line, command) of the prose's inline code spans that are commands: they start (after `VAR=value`s) with make,
    rlhf, dvc, accelerate, python or bash, and hold no placeholder (`<stage>`, `...`). A trailing `-S` is a mention of
    the option, not a command missing its value."""
    found = []
    for span in CODE_SPAN.finditer(prose):
        code = " ".join(span.group(2).split())
        words = [word for word in code.split() if not re.match(r"[A-Za-z_]\w*=", word)]
        if words and program(words[0]) in INLINE_PROGRAMS and not re.search(r"<|\.\.\.", code):
            found.append((prose.count("\n", 0, span.start()) + 1, re.sub(r"\s(-S|--set-param)$", "", code)))
    return found


def simple_commands(line: str) -> list[list[str]]:
    """A command line split into its simple commands (on `&&`, `||`, `;`, `|`, `&`), each a list of words as the shell
    reads them (quotes removed, comments and redirections dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words, tokens = [], [], list(lexer)
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in SEPARATORS:
            commands.append(words)
            words = []
        elif token in ("(", ")"):
            continue
        elif set(token) <= set("<>&"):
            skip = True  # a redirection: its target too, and the descriptor before it (2>&1)
            if words and words[-1].isdigit():
                words.pop()
        else:
            words.append(token)
    return [words for words in [*commands, words] if words]


@functools.cache
def cli_help(command: str = "") -> str:
    """The stage CLI's `--help` (of one command, or the top level), as `python -m stages` prints it."""
    done = subprocess.run([sys.executable, "-m", "stages", *([command] if command else []), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"`python -m stages {command} --help` failed (exit status {done.returncode}): {last}")
    return done.stdout


@functools.cache
def cli_commands() -> frozenset[str]:
    text = cli_help()
    listing = text.split("Commands:", 1)[1] if "Commands:" in text else ""
    return frozenset(re.findall(r"^ {2}([\w-]+)", listing, flags=re.M))


def cli_options(command: str = "") -> frozenset[str]:
    return frozenset(re.findall(r"(?<![\w-])--[a-z][\w-]*", cli_help(command))) | {"--help"}


def cli_problems(words: list[str]) -> list[str]:
    """What is wrong with `rlhf` / `python -m stages` followed by these words."""
    if not words:
        return []
    try:
        if words[0].startswith("-"):
            command, options = "", words
        else:
            command, options = words[0], words[1:]
            if command not in cli_commands():
                return [f"`{command}` is not a command of the stage CLI ({', '.join(sorted(cli_commands()))})"]
        known = cli_options(command)
    except RuntimeError as err:
        return [str(err)]
    return [f"{option} is not an option of `{command or 'the stage CLI'}` (its --help: {', '.join(sorted(known))})"
            for option in (word.split("=", 1)[0] for word in options if word.startswith("--")) if option not in known]


@functools.cache
def make_targets(makefile: Path) -> frozenset[str]:
    targets = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        rule = re.match(r"([^\s:=#$][^:=#]*?)\s*:(?!=)\s*(.*)", line)
        if rule:
            targets |= set((rule.group(2) if rule.group(1) == ".PHONY" else rule.group(1)).split())
    return frozenset(targets)


@functools.cache
def yaml_file(path: Path):
    return YAML(typ="safe").load(path)


def dvc_stage_problems(target: str, cwd: Path) -> list[str]:
    dvcyaml = cwd / "dvc.yaml"
    if not dvcyaml.exists():
        return [f"no dvc.yaml in {rel(cwd)} for the stage `{target}`"]
    name = target.split(":", 1)[1] if ":" in target else target
    names = yaml_file(dvcyaml).get("stages", {})
    if name not in names:
        return [f"`{name}` is not a stage of {rel(dvcyaml)} ({', '.join(names)})"]
    return []


def param_problems(assignment: str, cwd: Path) -> list[str]:
    """What is wrong with a `-S` override: `key=value` sets a key the params file has, `+key=value` adds one to a
    section it has, `~key` removes one."""
    params_file, override = cwd / "params.yaml", assignment
    if re.match(r"[\w./-]+\.(yaml|yml|json|toml|py):", override):
        file, override = override.split(":", 1)
        params_file = cwd / file
    key = override.split("=", 1)[0]
    if "=" not in override and not key.startswith("~"):
        return [f"-S {assignment}: not key=value"]
    if not params_file.exists():
        return [f"-S {assignment}: no {rel(params_file)}"]
    new, path = key.startswith("+"), key.lstrip("+~").split(".")
    node = yaml_file(params_file)
    for depth, part in enumerate(path[:-1] if new else path):
        if not isinstance(node, dict) or part not in node:
            return [f"-S {assignment}: {'.'.join(path[:depth + 1])} is not a key of {rel(params_file)}"]
        node = node[part]
    if new and not isinstance(node, dict):
        return [f"-S {assignment}: {'.'.join(path[:-1])} is not a section of {rel(params_file)}"]
    if new and path[-1] in node:
        return [f"-S {assignment}: {rel(params_file)} has {'.'.join(path)} already; `+` adds a new key (drop it)"]
    return []


def dvc_problems(words: list[str], cwd: Path) -> list[str]:
    """What is wrong with `dvc` followed by these words: the stages of `repro`, `exp run` and `checkout`, and the
    params of `exp run -S`."""
    if words[:1] == ["repro"] or words[:1] == ["checkout"]:
        return [p for word in words[1:] if not word.startswith("-") for p in dvc_stage_problems(word, cwd)]
    if words[:2] != ["exp", "run"]:
        return []
    problems, rest = [], iter(words[2:])
    for word in rest:
        option, _, value = word.partition("=") if word.startswith("--") else (word, "", "")
        if option in EXP_RUN_VALUES:
            value = value or next(rest, "")
            if option in ("-S", "--set-param"):
                problems += param_problems(value, cwd)
            elif option in ("-C", "--copy-paths") and not (cwd / value).exists():
                problems.append(f"-C {value}: no such file")
        elif not word.startswith("-"):
            problems += dvc_stage_problems(word, cwd)
    return problems


def looks_like_repo_path(word: str) -> bool:
    if re.search(r"[<>*?${}\[\]]", word) or word.startswith(("-", "/", "~", ".venv")):
        return False
    first = Path(word).parts[0] if Path(word).parts else ""
    return word in REPO_FILES or ("/" in word and first in REPO_DIRS)


@functools.cache
def ignored_patterns() -> tuple[str, ...]:
    lines = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines() if (ROOT / ".gitignore").exists() else []
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith(("#", "!")))


def is_output(path: Path) -> bool:
    """Whether a path lies where git ignores what is written (`data/`, `bench/results/`, ...): a run's output, which a
    fresh clone does not have, so the docs may name it."""
    parts = path.resolve().relative_to(ROOT).parts if path.resolve().is_relative_to(ROOT) else ()
    for pattern in ignored_patterns():
        bare = pattern.strip("/")
        anchored = pattern.startswith("/") or "/" in bare  # git: a slash but at the end ties it to the repository
        for depth in range(1, len(parts) + 1):
            if fnmatch("/".join(parts[:depth]), bare) or (not anchored and fnmatch(parts[depth - 1], bare)):
                return True
    return False


def path_problems(words: list[str], cwd: Path) -> list[str]:
    problems = []
    for word in words:
        for part in (word, word.split("=", 1)[1] if word.startswith("--") and "=" in word else ""):
            part = part.split("::", 1)[0]  # a pytest node id
            if part and looks_like_repo_path(part) and not (cwd / part).exists() and not is_output(cwd / part):
                problems.append(f"{part}: no such file in {rel(cwd)}")
    return problems


def local_sources(script: Path) -> list[str]:
    """A script's source and those of the modules beside it that it imports, transitively (bench scripts share their
    argparse definitions in bench/common.py)."""
    sources, seen, todo = [], set(), [script]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        sources.append(path.read_text(encoding="utf-8"))
        todo += [script.parent / f"{name}.py" for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", sources[-1],
                                                                      flags=re.M)]
    return sources


def script_problems(script: Path, flags: list[str]) -> list[str]:
    """A repository script's `--flags`, each one its argparse definitions (or those of a module beside it) name."""
    if script.suffix != ".py" or not script.exists():
        return []
    defined = {flag for source in local_sources(script) for flag in re.findall(r"[\"'](--[\w-]+)[\"']", source)}
    defined.add("--help")
    return [f"{flag} is not an option of {rel(script)} (it defines {', '.join(sorted(defined))})"
            for flag in (word.split("=", 1)[0] for word in flags if word.startswith("--")) if flag not in defined]


def program(word: str) -> str:
    name = Path(word).name
    return "python" if re.fullmatch(r"python[\d.]*", name) else name


def words_problems(words: list[str], cwd: Path) -> tuple[list[str], Path]:
    """What is wrong with one simple command run in `cwd`, and the directory the next command runs in."""
    while words and re.match(r"[A-Za-z_]\w*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return [], cwd
    problems = path_problems(words, cwd)
    name, args = program(words[0]), words[1:]
    if name == "cd":
        target = cwd / args[0] if args else ROOT
        return ([] if target.is_dir() else [f"cd {args[0]}: no such directory"]), target.resolve()
    if name == "make":
        if not (cwd / "Makefile").exists():
            return [*problems, f"no Makefile in {rel(cwd)}"], cwd
        targets = make_targets(cwd / "Makefile")
        problems += [f"`{word}` is not a target of the Makefile ({', '.join(sorted(targets))})"
                     for word in args if not word.startswith("-") and "=" not in word and word not in targets]
    elif name == "rlhf":
        problems += cli_problems(args)
    elif name == "dvc":
        problems += dvc_problems(args, cwd)
    elif "-m" in words and words.index("-m") + 1 < len(words):  # python -m X, accelerate launch ... -m X
        module_at = words.index("-m") + 1
        module, rest = words[module_at], words[module_at + 1:]
        if module == "stages":
            problems += cli_problems(rest)
        elif module == "dvc":
            problems += dvc_problems(rest, cwd)
    elif name in ("python", "bash", "sh") and args and not args[0].startswith("-"):
        problems += script_problems(cwd / args[0], args[1:])
    return problems, cwd


def command_problems(doc: Path, text: str) -> list[str]:
    """Each command of the doc's shell blocks (and `cmd:` lines of its yaml blocks, and its inline code spans that are
    commands) that would not run as typed."""
    blocks, prose = split_fences(text)
    sessions = []  # each a list of (line, command) typed in one shell, which starts at the repository's root
    for block in blocks:
        if block.lang in SHELL:
            sessions.append(command_lines(block))
        elif block.lang in ("yaml", "yml"):
            sessions.append([(number, line.split("cmd:", 1)[1].strip()) for number, line in
                             enumerate(block.lines, start=block.line) if line.strip().startswith("cmd:")])
    sessions += [[command] for command in inline_commands(prose)]  # each inline span on its own
    problems = []
    for session in sessions:
        cwd = ROOT
        for number, line in session:
            try:
                commands = simple_commands(line)
            except ValueError as err:
                problems.append(f"{where(doc, number)}: `{line}`: not a shell command line ({err})")
                continue
            for words in commands:
                found, cwd = words_problems(words, cwd)
                problems += [f"{where(doc, number)}: `{shlex.join(words)}`: {problem}" for problem in found]
    return problems


def import_problems(module: str, names: list[str]) -> list[str]:
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        return [f"no module {module} ({err})"]
    problems = []
    for name in names:
        if name == "*" or hasattr(imported, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            problems.append(f"{module} has no name {name}")
    return problems


def python_problems(doc: Path, text: str) -> list[str]:
    """Each python block that does not parse, and each of its imports from ppo_core, stages or rewards that names
    what does not exist."""
    blocks, _ = split_fences(text)
    problems = []
    for block in (block for block in blocks if block.lang in ("python", "py")):
        try:
            tree = ast.parse("\n".join(block.lines))
        except SyntaxError as err:
            problems.append(f"{where(doc, block.line + (err.lineno or 1) - 1)}: python block: does not parse "
                            f"({err.msg})")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wanted = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [(node.module, [alias.name for alias in node.names])]
            else:
                continue
            line = ast.get_source_segment("\n".join(block.lines), node) or ""
            for module, names in wanted:
                if module.split(".")[0] in OWN_PACKAGES:
                    problems += [f"{where(doc, block.line + node.lineno - 1)}: `{line}`: {problem}"
                                 for problem in import_problems(module, names)]
    return problems


def dotted_problem(name: str) -> str | None:
    """What is missing of a dotted name (`ppo_core.algo.kl_control.KLPlacement`): the longest module that imports, then
    each attribute."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    else:
        return f"no module {parts[0]}"
    for depth in range(split, len(parts)):
        if not hasattr(found, parts[depth]):
            return f"{'.'.join(parts[:depth])} has no name {parts[depth]}"
        found = getattr(found, parts[depth])
    return None


def named_code_problems(doc: Path, text: str) -> list[str]:
    """Each file of the repository and each name of ppo_core or stages that the prose's code spans name and that does
    not exist: a path (relative to the repository or to the doc), a pytest node (`tests/x.py::test_y`), a dotted name
    (`stages.shared.numerics.LOCK_KERNELS`). Outputs (where git ignores what is written: `data/`, `bench/results/`)
    and user code (`rewards.*`) are not checked."""
    _, prose = split_fences(text)
    problems = []
    for span in CODE_SPAN.finditer(prose):
        code, line = " ".join(span.group(2).split()), prose.count("\n", 0, span.start()) + 1
        for word in re.findall(r"[\w./:-]+", code):
            path, _, node = word.rstrip(".:").partition("::")
            if not looks_like_repo_path(path) or any(is_output(base / path) for base in (ROOT, doc.parent)):
                continue
            file = next((base / path for base in (ROOT, doc.parent) if (base / path).exists()), None)
            if file is None:
                problems.append(f"{where(doc, line)}: `{word}`: no such file")
            elif node and not re.search(rf"^\s*(async\s+)?def {re.escape(node.split('[')[0])}\(",
                                        file.read_text(encoding="utf-8"), flags=re.M):
                problems.append(f"{where(doc, line)}: `{word}`: {path} has no test {node}")
        for name in re.findall(r"(?<![\w./])((?:ppo_core|stages)(?:\.\w+)+)", code):
            problem = dotted_problem(name)
            if problem:
                problems.append(f"{where(doc, line)}: `{name}`: {problem}")
    return problems


def doc_id(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


def test_the_docs_are_there():
    assert (ROOT / "docs").is_dir() and len(DOCS) > 3, DOCS
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 250, "the README is a front page"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_links_resolve(doc):
    problems = link_problems(doc, doc.read_text(encoding="utf-8"))
    assert not problems, "\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_commands_run_as_typed(doc):
    problems = command_problems(doc, doc.read_text(encoding="utf-8"))
    assert not problems, "\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_the_files_and_names_in_code_spans_exist(doc):
    problems = named_code_problems(doc, doc.read_text(encoding="utf-8"))
    assert not problems, "\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_python_blocks_parse_and_import(doc):
    problems = python_problems(doc, doc.read_text(encoding="utf-8"))
    assert not problems, "\n" + "\n".join(problems)


# The checker itself: it must fail on what a user would trip over.
FAKE = ROOT / "docs" / "fake.md"


def fenced(lang: str, body: str) -> str:
    return f"Some prose.\n\n```{lang}\n{body}\n```\n"


def test_slugs_are_github_s():
    assert slug("`ppo_core`: the legacy PPOTrainer loop") == "ppo_core-the-legacy-ppotrainer-loop"
    assert slug("A real model's size on one GPU: Qwen2.5-0.5B's shape on an H100") == (
        "a-real-models-size-on-one-gpu-qwen25-05bs-shape-on-an-h100")
    assert slug("Critic-free estimators: GRPO, Dr. GRPO, RLOO, REINFORCE++") == (
        "critic-free-estimators-grpo-dr-grpo-rloo-reinforce")
    assert slug("Resume and `dvc exp run`") == "resume-and-dvc-exp-run"


def test_a_bad_link_is_found(tmp_path):
    other = tmp_path / "other.md"
    other.write_text("# Title\n\n## Same\n\n## Same\n\n```bash\n# not a heading\n```\n")
    doc = tmp_path / "doc.md"
    text = ("[ok](other.md#same-1) [bad](other.md#not-a-heading) [code](other.md#not-a-heading-either)\n"
            "[missing](nosuch.md) and a wrapped [link\ntext](other.md#title), `[not](a-link.md)`, "
            "[web](https://example.com/x.md)\n")
    found = link_problems(doc, text, root=tmp_path)
    assert any("other.md#not-a-heading`" in p and "has no heading" in p for p in found), found
    assert any("nosuch.md" in p and "no such file" in p for p in found), found
    assert all("#same-1" not in p and "#title" not in p and "a-link.md" not in p and "example" not in p for p in found)
    assert [p.split(": ", 1)[0] for p in found] == [f"{doc}:1"] * 2 + [f"{doc}:2"], found


def test_a_bad_link_in_the_repository_is_found():
    found = link_problems(FAKE, "[a](pipeline.md#watching-a-run) [b](pipeline.md#watching-a-walk) [c](../../x.md)")
    assert len(found) == 2 and "docs/fake.md:1: link `pipeline.md#watching-a-walk`" in found[0], found
    assert "leads out of the repository" in found[1], found


def test_a_bad_make_target_is_found():
    found = command_problems(FAKE, fenced("bash", "make run    # fine\nmake test && make rnu"))
    assert len(found) == 1 and found[0].startswith("docs/fake.md:5: `make rnu`: `rnu` is not a target"), found


def test_bad_stage_commands_and_options_are_found():
    text = fenced("bash", "rlhf ppo --help\nrlhf ppo --parms x.yaml\npython3 -m stages ppp\n"
                          ".venv/bin/python -m stages report --experiments\nrlhf --versoin\n"
                          "accelerate launch --num_processes 2 -m stages ppo --debug")
    found = command_problems(FAKE, text)
    assert len(found) == 3, found
    assert "docs/fake.md:5: `rlhf ppo --parms x.yaml`: --parms is not an option of `ppo`" in found[0], found
    assert "docs/fake.md:6:" in found[1] and "`ppp` is not a command" in found[1], found
    assert "docs/fake.md:8:" in found[2] and "--versoin" in found[2], found


def test_bad_dvc_stages_and_params_are_found():
    text = fenced("bash", "dvc repro ppx\ndvc exp run -S ppo.learnin_rate=1 -S '+ppo.policy_loss_kwargs.cap=2'\n"
                          "dvc exp run --queue -S 'ppo.learning_rate=0.1,0.2' && dvc queue start\n"
                          "dvc exp run -S +ppo.learning_rate=1 -S +nosuch.key=1 evaluate\n"
                          "cd examples/sentiment\ndvc exp run -S ppo.num_generations=4 fetch")
    found = command_problems(FAKE, text)
    assert len(found) == 4, found
    assert "`ppx` is not a stage of dvc.yaml" in found[0], found
    assert "ppo.learnin_rate is not a key of params.yaml" in found[1], found
    assert "has ppo.learning_rate already" in found[2] and "nosuch is not a key of params.yaml" in found[3], found


def test_bad_paths_and_script_flags_are_found():
    text = fenced("console", "$ python bench/nosuch.py\nan output line bench/nosuch.py\n"
                             "$ .venv/bin/python bench/compare.py --shapes tiny --nosuch 1\n"
                             "$ .venv/bin/python -m pytest tests/test_docs.py::test_links_resolve tests/nosuch.py")
    found = command_problems(FAKE, text)
    assert len(found) == 3, found
    assert "bench/nosuch.py: no such file" in found[0] and "--nosuch is not an option of bench/compare.py" in found[1]
    assert "tests/nosuch.py: no such file" in found[2], found


def test_continuations_and_comments():
    text = fenced("bash", "# make nosuch: a comment\nmake run \\\n    rnu   # a comment: make nosuch")
    found = command_problems(FAKE, text)
    assert len(found) == 1 and "docs/fake.md:5: `make run rnu`: `rnu` is not a target" in found[0], found


def test_bad_python_blocks_are_found():
    text = fenced("python", "from ppo_core import PPOConfig, NoSuchName\nimport ppo_core.nosuch\nimport torch") + \
        fenced("python", "def broken(:\n    pass")
    found = python_problems(FAKE, text)
    assert len(found) == 3, found
    assert found[0] == "docs/fake.md:4: `from ppo_core import PPOConfig, NoSuchName`: ppo_core has no name NoSuchName"
    assert found[1].startswith("docs/fake.md:5: `import ppo_core.nosuch`: no module ppo_core.nosuch"), found
    assert found[2].startswith("docs/fake.md:11: python block: does not parse"), found


def test_inline_commands_are_checked_too():
    text = ("Run `make rnu`, or `dvc exp run -S` (a mention), `dvc checkout <stage>` (a placeholder), `make\n"
            "test`, ``rlhf ppo --parms x`` and `DS_ACCELERATOR=cpu accelerate launch --config_file configs/no.yaml\n"
            "-m stages ppo`; `pip install x` is not ours to check.\n")
    found = command_problems(FAKE, text)
    assert len(found) == 3, found
    assert found[0].startswith("docs/fake.md:1: `make rnu`: `rnu` is not a target"), found
    assert found[1].startswith("docs/fake.md:2: `rlhf ppo --parms x`: --parms is not an option"), found
    assert found[2].startswith("docs/fake.md:2: `") and "configs/no.yaml: no such file" in found[2], found


def test_stale_paths_and_names_in_code_spans_are_found():
    text = ("`ppo_core/config.py` and `ppo_core/nosuch.py`, `tests/test_docs.py::test_links_resolve` and\n"
            "`tests/test_docs.py::test_nothing`, `ppo_core.algo.kl_control.KLPlacement` `ppo_core.runtime.zero.nope`,\n"
            "`stages.numerics_old`, `data/ppo/x`, `bench/results/x.md`, `rewards.mine`, `report.png`.\n")
    found = named_code_problems(FAKE, text)
    assert len(found) == 4, found
    assert found[0] == "docs/fake.md:1: `ppo_core/nosuch.py`: no such file", found
    assert found[1] == "docs/fake.md:2: `tests/test_docs.py::test_nothing`: tests/test_docs.py has no test test_nothing"
    assert found[2] == "docs/fake.md:2: `ppo_core.runtime.zero.nope`: ppo_core.runtime.zero has no name nope", found
    assert found[3] == "docs/fake.md:3: `stages.numerics_old`: stages has no name numerics_old", found
