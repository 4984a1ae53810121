"""The docs say what the code does (STYLE.md 19), checked for README.md, every docs/*.md and the two
benchmarks READMEs (the scripts, and the index of reports, which lists every report):

    pytest tests/unit/test_docs.py

- links: a relative link's file exists; its `#anchor` (or an in-file one) is a heading's GitHub slug;
  a section named in prose (`architecture.md, "Continuous mode"`) is a heading (or a bold paragraph
  title) there, "..." standing for any words;
- named files: a repository path (`prl/...`, `tests/...`, `tools/...`, ...; in backticks, prose or code
  blocks) exists;
- named tests: `tests/test_x.py::test_name` is defined in that file (read with ast);
- environment variables: every one in a table whose first column is a variable, and every `PRL_*` in
  backticks anywhere, is read or set in prl/, jobs/, templates/ or tools/; a default such a table quotes is
  the script's `${NAME:-default}` or the Python's `environ.get("NAME", "default")`;
- config defaults against the dataclasses of prl/config: test_docs_defaults.py, with this file's readers;

Every failure names the doc, the line and what is wrong. No network, no subprocess.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md",
        ROOT / "benchmarks/reports/README.md"]
REPO_DIRS = ("prl", "tests", "tools", "jobs", "templates", "configs", "benchmarks", "docs", ".ci")
CODE_DIRS = ("prl", "jobs", "templates", "tools")

NOT_IN_THE_REPOSITORY = {
    "prl/_home": "where `pip install .` puts jobs/, templates/ and configs/ (pyproject.toml's package-dir); "
                 "a checkout has none",
    "benchmarks/results": "the raw output of the measurements, out of git since issue 50; each report in "
                          "benchmarks/reports/ names its folder there at commit d4e8832",
}

CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
REPO_PATH = re.compile(rf"(?<![\w./$~-])(?:{'|'.join(re.escape(d) for d in REPO_DIRS)})/[^\s`'\",;()\[\]]*")
TEST_ID = re.compile(r"(?<![\w/])((?:tests/)?(?:[a-z]+/)?test_\w+\.py)::(\w+)(?:::(\w+))?")
"""`tests/unit/test_x.py::name`, or `test_x.py::name` where the tier folder is said around it."""
SECTION_REF = re.compile(r"(?<![\w/])(?:docs/)?([\w-]+\.md),\s+\"([^\"]+)\"")
ENV_NAME = re.compile(r"\$\{?([A-Z][A-Z0-9_]*[A-Z0-9])\}?(?:/.*)?|([A-Z][A-Z0-9_]*[A-Z0-9])")  # `$X/path` or `X`
PRL_ENV = re.compile(r"(?<![\w$])PRL_[A-Z0-9_]*[A-Z0-9]")


# --- reading markdown -----------------------------------------------------------------------------

@cache
def doc_lines(doc: Path) -> list[str]:
    """The doc's lines with fenced code blocks blanked out (line numbers kept)."""
    out, fence = [], None
    for line in doc.read_text(encoding="utf-8").splitlines():
        marker = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def numbered(doc: Path):
    for no, line in enumerate(doc_lines(doc), 1):
        if line:
            yield no, line


def code_spans(text: str) -> list[str]:
    return [m.group(2).strip() for m in CODE_SPAN.finditer(text)]


def without_code(text: str) -> str:
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def where(doc: Path, no: int) -> str:
    return f"{doc.relative_to(ROOT)}:{no}"


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def headings(doc: Path) -> list[tuple[int, str]]:
    return [(no, m.group(2)) for no, line in numbered(doc) if (m := HEADING.match(line))]


@cache
def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, text in headings(doc):
        slug = github_slug(text)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def section_titles(doc: Path) -> list[str]:
    """Headings, and the bold titles that open paragraphs (`**Exactness, trainer side** (...)`)."""
    bold = [m.group(1) for _, line in numbered(doc) if (m := re.match(r"\*\*([^*]+)\*\*", line))]
    return [h for _, h in headings(doc)] + bold


def tables(doc: Path):
    """(line of the header, header cells, [(line, cells)] of the body) of every pipe table."""
    rows: list[tuple[int, list[str]]] = []
    for no, line in [*numbered(doc), (0, "")]:
        if line.lstrip().startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            rows.append((no, cells))
            continue
        if len(rows) >= 2 and set("".join(rows[1][1])) <= set("-: "):
            yield rows[0][0], rows[0][1], rows[2:]
        rows = []


# --- links, anchors, sections ----------------------------------------------------------------------

def test_relative_links_and_anchors_resolve():
    wrong = []
    for doc in DOCS:
        for no, line in numbered(doc):
            for target in LINK.findall(without_code(line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                if not dest.exists():
                    wrong.append(f"{where(doc, no)}: link to {target}: no such file {dest.relative_to(ROOT)}")
                elif anchor and anchor not in anchors(dest):
                    wrong.append(f"{where(doc, no)}: link to {target}: {dest.relative_to(ROOT)} has no heading "
                                 f"with the anchor #{anchor}")
    assert not wrong, "\n".join(wrong)


def test_the_index_of_reports_lists_every_report():
    index = (ROOT / "benchmarks/reports/README.md").read_text()
    reports = sorted(p.name for p in (ROOT / "benchmarks/reports").glob("*.md") if p.name != "README.md")
    missing = [name for name in reports if f"]({name})" not in index]
    assert reports and not missing, f"benchmarks/reports/README.md does not list {missing}"


def test_sections_named_in_prose_are_headings():
    wrong = []
    for doc in DOCS:
        text = "\n".join(doc_lines(doc))
        for m in SECTION_REF.finditer(text):
            dest = doc.parent / m.group(1) if (doc.parent / m.group(1)).exists() else ROOT / "docs" / m.group(1)
            no = text.count("\n", 0, m.start()) + 1
            if not dest.exists():
                wrong.append(f"{where(doc, no)}: names {m.group(1)}, which does not exist")
                continue
            title = re.compile(".*".join(map(re.escape, re.split(r"\s*\.\.\.\s*", " ".join(m.group(2).split())))),
                               re.IGNORECASE)
            if not any(title.match(h) for h in section_titles(dest)):
                wrong.append(f"{where(doc, no)}: {dest.relative_to(ROOT)} has no heading or bold paragraph "
                             f"title {m.group(2)!r}")
    assert not wrong, "\n".join(wrong)


def test_github_slug():
    assert github_slug("The loss (`trainer.loss`, `prl/trainer/loss.py`)") == "the-loss-trainerloss-prltrainerlosspy"
    assert github_slug("Checks before anything is written or queued") == "checks-before-anything-is-written-or-queued"
    assert github_slug("Sampling: temperature only") == "sampling-temperature-only"


# --- files and tests the docs name -----------------------------------------------------------------

def repo_path_exists(token: str) -> bool:
    """A path as the docs write it (less a `::test` or `#anchor`); `<placeholder>` and `*` match any name part."""
    pattern = re.sub(r"<[^>]+>", "*", re.split(r"::|#", token)[0]).rstrip(".:")
    if any(pattern == p or pattern.startswith(p + "/") for p in NOT_IN_THE_REPOSITORY):
        return True
    return any(ROOT.glob(pattern.rstrip("/"))) if "*" in pattern else (ROOT / pattern).exists()


def test_repository_paths_the_docs_name_exist():
    """In backticks, in prose and in code blocks alike."""
    wrong = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            wrong += [f"{where(doc, no)}: names {p}, which is not in the repository"
                      for p in REPO_PATH.findall(line) if not repo_path_exists(p)]
    assert not wrong, "\n".join(wrong)


def test_the_allow_list_of_paths_holds_only_what_is_absent():
    for path, reason in NOT_IN_THE_REPOSITORY.items():
        assert not (ROOT / path).exists(), f"{path} exists now: remove it from NOT_IN_THE_REPOSITORY ({reason})"


@cache
def defined_tests(test_file: Path) -> dict[str, set[str]]:
    """Module-level function and class names -> the method names of each class (empty for functions)."""
    tree = ast.parse(test_file.read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def named_test_file(named: str) -> Path | None:
    """The test file a doc names: by its path (`tests/unit/test_x.py`), or by its name alone where
    exactly one tier folder holds it."""
    if "/" in named:
        path = ROOT / (named if named.startswith("tests/") else f"tests/{named}")
        return path if path.exists() else None
    found = sorted((ROOT / "tests").glob(f"*/{named}"))
    return found[0] if len(found) == 1 else None


def test_named_tests_exist():
    wrong = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for file, name, method in TEST_ID.findall(line):
                path = named_test_file(file)
                if path is None:
                    wrong.append(f"{where(doc, no)}: names {file}, which is in no tier folder of tests/")
                elif name not in defined_tests(path) or (method and method not in defined_tests(path)[name]):
                    wrong.append(f"{where(doc, no)}: {file} defines no {name}{'::' + method if method else ''}")
    assert not wrong, "\n".join(wrong)


# --- environment variables -------------------------------------------------------------------------

@cache
def code_text() -> str:
    files = [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".j2", ".sh")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


@cache
def variables_read_or_set() -> set[str]:
    """Names as `"NAME"` (os.environ), `$NAME`/`${NAME` (shell) or `NAME=` (export, env in shell)."""
    found = re.findall(r"[\"']([A-Z][A-Z0-9_]*)[\"']|\$\{?([A-Z][A-Z0-9_]*)|\b([A-Z][A-Z0-9_]*)=", code_text())
    return {name for names in found for name in names if name}


def env_tables():
    """(doc, line, cells, default column or None) of every row of a table whose first column is a variable."""
    for doc in DOCS:
        for _, header, body in tables(doc):
            if "variable" in header[0].lower():
                default = next((i for i, h in enumerate(header) if "default" in h.lower()), None)
                for no, cells in body:
                    yield doc, no, cells, default


def test_environment_variables_in_the_docs_are_used():
    named: list[tuple[Path, int, str]] = []
    for doc, no, cells, _ in env_tables():
        named += [(doc, no, m.group(1) or m.group(2)) for span in code_spans(" | ".join(cells))
                  if (m := ENV_NAME.fullmatch(span))]
    for doc in DOCS:
        for no, line in numbered(doc):
            named += [(doc, no, name) for span in code_spans(line) for name in PRL_ENV.findall(span)]
    assert named
    wrong = [f"{where(doc, no)}: ${name} is read or set nowhere in {', '.join(CODE_DIRS)}"
             for doc, no, name in named if name not in variables_read_or_set()]
    assert not wrong, "\n".join(wrong)


def test_environment_defaults_in_tables_are_the_code_defaults():
    wrong, checked = [], 0
    for doc, no, cells, column in env_tables():
        if column is None or not (names := [n for s in code_spans(cells[0]) if (n := ENV_NAME.fullmatch(s))]):
            continue
        name = names[0].group(1) or names[0].group(2)
        said = code_spans(cells[column])[0] if code_spans(cells[column]) else cells[column]
        said = "" if said == "empty" else said
        code = re.findall(rf"\$\{{{name}:-([^}}$]*)\}}", code_text())
        code += re.findall(rf"environ\.get\(\"{name}\", \"([^\"]*)\"\)", code_text())
        checked += bool(code)
        wrong += [f"{where(doc, no)}: says ${name} defaults to {said!r}; the code: {c!r}" for c in code if c != said]
    assert not wrong, "\n".join(wrong)
    assert checked, "no environment default was checked: has the table's form changed?"


# --- no secret on a command line ------------------------------------------------------------------

SECRET_VALUE = re.compile(
    r"\$\(\s*(?:cat\s+|<)[^)]*(?:secret|key|token)[^)]*\)"  # $(cat RUN/secret), $(<RUN/secret)
    r"|`cat\s+[^`]*(?:secret|key|token)[^`]*`"  # `cat RUN/secret`
    r"|\$\{?\w*(?:SECRET|KEY|TOKEN)\w*\}?"  # $API_KEY, ${HF_TOKEN}
    r"|Bearer\s+(?!%s|\.\.\.|<)[^\s'\"]+",  # Bearer $X, Bearer KEY (a key typed into the command)
    re.IGNORECASE)
"""What puts a secret's value into a command: a file or variable expanded there, or the key itself."""
BUILTINS = {"printf", "echo", "read", "export", "local", "declare", ":"}
"""bash builtins: what they get is in no process's argv (/proc/PID/cmdline)."""
SEGMENT = re.compile(r"[<>]\(|\)|\|\|?|&&|;")
"""Where one simple command ends and another begins (pipes, lists, process substitutions)."""


def commands(doc: Path):
    """(line number, text) of every command the doc shows: each fenced code block line (continued
    lines joined) and each inline code span."""
    fence, pending = None, None
    for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        marker = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None:
            if marker:
                fence = marker.group(1)
            else:
                yield from ((no, span) for span in code_spans(line))
            continue
        if line.strip().startswith(fence):
            fence = None
            continue
        pending = (pending[0], pending[1] + " " + line) if pending else (no, line)
        if not line.rstrip().endswith("\\"):
            yield pending
            pending = None


def secret_in_argv(command: str) -> bool:
    """Whether `command` hands a secret to a program's argv: a secret value (SECRET_VALUE) in a simple
    command that is not a bash builtin (printf in `-H @<(printf ...)` is fine, curl's own -H is not)."""
    marked = SECRET_VALUE.sub("\0", command)
    for segment in SEGMENT.split(marked):
        words = segment.replace("@", " ").split()
        if "\0" in segment and (not words or words[0] not in BUILTINS):
            return True
    return False


@pytest.mark.parametrize("command", [
    """curl -X POST http://HOST:PORT/update_weights -H "Authorization: Bearer $(cat RUN/secret)" -d '{}'""",
    "curl -H 'Authorization: Bearer KEY' http://HOST:PORT/v1/models",
    'wget --header="Authorization: Bearer $(< $RUN/secret)" http://h:1/metrics',
    'http :8000/v1/models "Authorization: Bearer $TOKEN"',
    "python client.py --api-key $(cat RUN/secret) --url http://h:1",
    "curl -H \"Authorization: Bearer `cat RUN/secret`\" http://h:1/load",
    "prl eval RUN --key ${MY_API_KEY}",
])
def test_a_secret_in_a_programs_argv_is_found(command):
    assert secret_in_argv(command)


@pytest.mark.parametrize("command", [
    """curl -X POST http://HOST:PORT/prl/generate -H @<(printf 'Authorization: Bearer %s\\n' "$(<RUN/secret)") -d '{}'""",
    """printf 'Authorization: Bearer %s\\n' "$(<RUN/secret)" | curl -H @- http://h:1/v1/models""",
    "export WANDB_API_KEY=$(<~/.wandb_key)",
    "`Authorization: Bearer ...`",
    "curl http://HOST:PORT/health",
])
def test_a_secret_only_builtins_see_is_not(command):
    assert not secret_in_argv(command)


def test_no_doc_puts_a_secret_on_a_command_line():
    """A doc's command may not put a secret into a program's argv, which /proc/PID/cmdline shows every
    user of the machine (docs/inference.md, `POST /update_weights`: the form that keeps it out)."""
    found = [f"{where(doc, no)}: {text.strip()[:120]}" for doc in DOCS for no, text in commands(doc)
             if secret_in_argv(text)]
    assert not found, "a secret in a program's argv:\n" + "\n".join(found)
