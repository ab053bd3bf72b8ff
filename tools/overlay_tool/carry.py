"""export-pr's test carrying and measured results: the project's tests of a concern rewritten into
vLLM's layout (imports from vLLM's paths, project fixtures carried along), and the numbers PR.md
quotes, read from bench/results at export time (overlay/CONCERNS.toml; docs/CONVENTIONS.md)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from .errors import UsageError
from .project import OverlayFile

# Fixtures of the project's tests/kernels/conftest.py a carried test may use: carried along into
# the file itself (vLLM's tests/kernels/attention/conftest.py is vLLM's own, so no conftest travels).
# `seed` is taken from that conftest as written (conftest_fixture: its source, decorator included,
# plus the imports it reads); `interpreter` answers from the environment, as the project's
# tests/triton_interpreter.py does (INTERPRET below).
CONFTEST = "tests/kernels/conftest.py"
DERIVED_FIXTURES = ("seed",)
CARRIED_FIXTURES = {
    "interpreter": '''
@pytest.fixture
def interpreter() -> bool:
    """True when Triton kernels run in its interpreter (TRITON_INTERPRET=1)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
''',
}
# Project test helper modules a carried test may import at top level (`from tests.kernels.X import a, b`):
# vLLM's tree has no such module, so the helper's code (its definitions and the imports they need)
# is carried into the test file itself in place of that import.
CARRIED_HELPER_MODULES = {"tests.kernels.fake_compiled": "tests/kernels/fake_compiled.py"}
# What a name the conftest imports is in vLLM's tree: `import X` stays; these come from the project's
# tests/triton_interpreter.py there and are plain modules in vLLM's tree.
_INTERPRETER_MODULES = {"torch": "import torch"}


def conftest_fixture(root: Path, name: str, conftest: str = CONFTEST) -> tuple[str, list[str]]:
    """Fixture `name` of the project's conftest as written there (decorators included) and the import
    lines of the module-level names it reads (UsageError: a name vLLM's tree would not have)."""
    path = root / conftest
    text = path.read_text()
    tree = ast.parse(text)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None or not any("fixture" in ast.unparse(d) for d in fn.decorator_list):
        raise UsageError(f"{conftest} has no fixture '{name}' to carry")
    lines = text.splitlines(keepends=True)
    first = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
    source = "".join(lines[first - 1:fn.end_lineno])
    imports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                imports[(a.asname or a.name).split(".")[0]] = f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(node, ast.ImportFrom) and node.module == "tests.triton_interpreter":
            for a in node.names:
                if a.name in _INTERPRETER_MODULES:
                    imports[a.asname or a.name] = _INTERPRETER_MODULES[a.name]
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs} | {
        n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    used = sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local)
    import builtins

    free = [u for u in used if not hasattr(builtins, u)]
    missing = [u for u in free if u not in imports]
    if missing:
        raise UsageError(f"{conftest}: fixture '{name}' reads {', '.join(missing)}, which vLLM's tree would not have")
    return source, [imports[u] for u in free]


def fixture_helper(root: Path, name: str, text: str) -> str:
    """The code carried into a test file for project fixture `name`."""
    if name not in DERIVED_FIXTURES:
        return CARRIED_FIXTURES[name]
    source, imports = conftest_fixture(root, name)
    need = [i for i in imports if not re.search(rf"(?m)^{re.escape(i)}$", text)]
    return "".join(f"{i}  # noqa: E402\n" for i in need) + ("\n\n" if need else "") + source


# Names of the project's tests/triton_interpreter.py a carried test may import, and what they are in
# vLLM's tree (no interpreter set-up there: compiled kernels on the GPU unless TRITON_INTERPRET=1).
CARRIED_INTERPRETER = {
    "_HAS_CUDA": "torch.cuda.is_available()",
    "INTERPRET": 'os.environ.get("TRITON_INTERPRET") == "1"',
    "DEVICE": '"cuda" if (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1") else "cpu"',
}
# The project's sys.path set-up for kernels/ (dropped: in vLLM's tree the kernels are vLLM modules)
SYS_PATH_LINES = re.compile(
    r'(?m)^_ROOT = os\.path\.dirname\(os\.path\.dirname\(os\.path\.dirname\(os\.path\.abspath\(__file__\)\)\)\)\n'
    r'|^sys\.path\.insert\(0, (_ROOT|os\.path\.join\(_ROOT, "kernels"\))\)\n')
GPU_MARK = '@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")'
SPDX_VLLM = "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"


def helper_code(root: Path, path: str) -> tuple[list[str], str]:
    """(import lines, definitions) of a project test helper module: its statements as written,
    decorators included, without its docstring and `from __future__` imports."""
    text = (root / path).read_text()
    lines = text.splitlines()
    imports, body = [], []
    for node in ast.parse(text).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        seg = "\n".join(lines[start - 1:node.end_lineno])
        (imports if isinstance(node, (ast.Import, ast.ImportFrom)) else body).append(seg)
    return imports, "\n\n\n".join(body)


def module_map(files: list[OverlayFile]) -> dict[str, str]:
    """kernels.X -> the module apply puts kernels/X.py at (e.g. vllm.v1.attention.ops.X)."""
    out = {}
    for f in files:
        if f.source.startswith("kernels/") and f.source.endswith(".py") and f.dest.endswith(".py"):
            out["kernels." + f.source[len("kernels/"):-3].replace("/", ".")] = f.dest[:-3].replace("/", ".")
    return out


def _project_fixtures(root: Path, src: str) -> set[str]:
    """Fixture names the project's conftest.py files above `src` define."""
    names: set[str] = set()
    d = (root / src).parent
    while True:
        c = d / "conftest.py"
        if c.is_file():
            for node in ast.walk(ast.parse(c.read_text())):
                if isinstance(node, ast.FunctionDef) and any(
                    "fixture" in ast.unparse(dec) for dec in node.decorator_list
                ):
                    names.add(node.name)
        if d == root or d == d.parent:
            break
        d = d.parent
    return names


def carry_test(root: Path, src: str, dest: str, all_modules: dict[str, str], own_modules: set[str]) -> bytes:
    """The text of project test `src` as vLLM would keep it at `dest`; UsageError names what
    cannot run inside vLLM's tree (move the file to not_carried then)."""
    path = root / src
    if not path.is_file():
        raise UsageError(f"overlay/CONCERNS.toml: test {src} does not exist")
    text = path.read_text()
    problems: list[str] = []
    used: set[str] = set()

    def target(mod: str) -> str:
        used.add(mod)
        return all_modules[mod]

    def sub_from(m: re.Match) -> str:  # from kernels.X import a, b
        mod = m.group(2)
        if mod not in all_modules:
            return m.group(0)
        return f"{m.group(1)}from {target(mod)} import"

    def sub_import(m: re.Match) -> str:  # import kernels.X as S
        mod = m.group(2)
        if mod not in all_modules:
            return m.group(0)
        return f"{m.group(1)}import {target(mod)}{m.group(3)}"

    def sub_pkg(m: re.Match) -> str:  # from kernels import X, Y as Z
        names = [n.strip() for n in m.group(2).strip("() ").split(",") if n.strip()]
        mods = ["kernels." + n.split(" as ")[0].strip() for n in names]
        if not all(x in all_modules for x in mods):
            return m.group(0)
        pkgs = {target(x).rsplit(".", 1)[0] for x in mods}
        if len(pkgs) != 1:
            problems.append(f"'{m.group(0).strip()}' imports from more than one vLLM package")
            return m.group(0)
        return f"{m.group(1)}from {pkgs.pop()} import {', '.join(names)}"

    text = re.sub(r"(?m)^([ \t]*)from (kernels\.[\w.]+) import", sub_from, text)
    text = re.sub(r"(?m)^([ \t]*)import (kernels\.[\w.]+)( as \w+)?$", sub_import, text)
    text = re.sub(r"(?m)^([ \t]*)from kernels import (\([^)]*\)|[^\n]+)$", sub_pkg, text)
    text = re.sub(r"\bpytest\.mark\.gpu\b", GPU_MARK[1:], text)
    stem_mod = {m.rsplit(".", 1)[-1]: m for m in all_modules}

    def sub_bare(m: re.Match) -> str:  # import triton_x as X (kernels/ on the project's sys.path)
        if m.group(2) not in stem_mod:
            return m.group(0)
        return f"{m.group(1)}import {target(stem_mod[m.group(2)])}{m.group(3)}"

    def sub_interp(m: re.Match) -> str:  # from tests.triton_interpreter import _HAS_CUDA as HAS_CUDA, INTERPRET
        out = []
        for n in [x.strip() for x in m.group(2).split(",")]:
            name, _, alias = n.partition(" as ")
            if name.strip() not in CARRIED_INTERPRETER:
                return m.group(0)
            out.append(f"{m.group(1)}{(alias or name).strip()} = {CARRIED_INTERPRETER[name.strip()]}")
        if "os.environ" in "".join(out) and not re.search(r"(?m)^import os\b", text):
            out.insert(0, f"{m.group(1)}import os")
        return f"{m.group(1)}# (the GLM-5 overlay's tests/triton_interpreter.py, carried)\n" + "\n".join(out)

    def sub_helper(m: re.Match) -> str:  # from tests.kernels.fake_compiled import FakeCompiled (top level)
        path = CARRIED_HELPER_MODULES.get(m.group(1))
        if path is None:
            return m.group(0)
        imports, body = helper_code(root, path)
        need = [i for i in imports if not re.search(rf"(?m)^{re.escape(i)}[ \t]*(#.*)?$", text)]
        return "\n".join([f"# (the GLM-5 overlay's {path}, carried)"] + need + ["", "", body, "", ""])

    text = re.sub(r"(?m)^from (tests\.[\w.]+) import [\w ,]+?[ \t]*(#.*)?$", sub_helper, text)
    text = re.sub(r"(?m)^([ \t]*)import (\w+)( as \w+)?(?=[ \t]*(#.*)?$)", sub_bare, text)
    text = re.sub(r"(?m)^([ \t]*)from tests\.triton_interpreter import ([\w ,]+?)[ \t]*(#.*)?$", sub_interp, text)
    text = SYS_PATH_LINES.sub("", text)
    if "sys." not in text:
        text = re.sub(r"(?m)^import sys\b.*\n", "", text)

    for mod in sorted(used - own_modules):
        problems.append(f"imports {mod}, which is not in this concern's series")
    stems = set(stem_mod)
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if re.match(r"(from|import) (tests|kernels)\b", s):
            problems.append(f"line {n}: '{s}' is a project module vLLM's tree does not have")
        elif re.match(r"import (\w+)", s) and re.match(r"import (\w+)", s).group(1) in stems:
            problems.append(f"line {n}: '{s}' imports a kernel by its bare name (the project's sys.path)")
        elif re.search(r"""(?<!["'])["'](kernels|tools|tests)(["']|/[\w./-]*["'])""", s) and not s.startswith("#"):
            problems.append(f"line {n}: '{s}' names a path of the project's checkout")
        elif "sys.path" in s and not s.startswith("#"):
            problems.append(f"line {n}: '{s}' changes sys.path for the project's layout")
    if "pytest.mark.gpu" in text:
        problems.append("uses the project's 'gpu' marker in a form export-pr does not rewrite")
    tree = ast.parse(text)
    params = {a.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
              for a in node.args.args}
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    from_conftest = (params & _project_fixtures(root, src)) - defined
    missing = sorted(from_conftest - set(CARRIED_FIXTURES) - set(DERIVED_FIXTURES))
    if missing:
        problems.append(f"uses the project's fixtures {', '.join(missing)} (no carried helper for them)")
    if problems:
        raise UsageError(f"overlay/CONCERNS.toml: test {src} -> {dest} cannot run inside vLLM's tree "
                         "(move it to not_carried with the reason):\n  " + "\n  ".join(problems))
    helpers = [fixture_helper(root, f, text) for f in sorted(from_conftest)]
    if GPU_MARK[1:] in text or helpers or "torch.cuda.is_available()" in text:
        if not re.search(r"(?m)^import torch$", text):
            problems.append("needs 'import torch' for the carried GPU marker or fixtures")
        if helpers and not re.search(r"(?m)^import pytest$", text):
            problems.append("needs 'import pytest' for the carried fixtures")
        if problems:
            raise UsageError(f"overlay/CONCERNS.toml: test {src} -> {dest}: " + "; ".join(problems))
    if helpers:
        text = text.rstrip("\n") + "\n\n\n# Carried from the GLM-5 overlay's tests/kernels/conftest.py.\n" + "\n\n".join(h.strip("\n") + "\n" for h in helpers)
    if "SPDX-License-Identifier" in text.split("\n", 1)[0] and SPDX_VLLM not in text:
        first, rest = text.split("\n", 1)
        text = f"{first}\n{SPDX_VLLM}\n{rest}"
    return text.encode()


# ------------------------------------------------------------------ measured results
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.2f}"
    return str(v)


def results_section(root: Path, results) -> list[str]:
    """PR.md lines quoting each [[concern.C.results]] entry, read from its file now."""
    L: list[str] = []
    for r in results:
        rel = r["file"]
        try:
            d = json.loads((root / rel).read_text())
        except FileNotFoundError:
            raise UsageError(f"overlay/CONCERNS.toml: results file {rel} does not exist") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"{rel}: not valid JSON: {e}") from None
        label = r.get("label") or rel
        if r["kind"] == "pytest":
            env = d.get("environment", {})
            where = ", ".join(f"{k} {env[k]}" for k in ("gpu", "torch", "triton") if k in env)
            L.append(f"- {label} (`{rel}`, project commit {d.get('commit', '?')}; {where}):")
            # per mode (e2e/gpu_tests.py) or per backend (e2e/upstream_tests.py)
            modes = d.get("modes") or d.get("backends") or {"run": {"counts": d.get("totals", {})}}
            for mode, m in modes.items():
                c = m.get("counts", {})
                part = " (from a run stopped at its deadline: not every case finished)" if m.get("complete") is False else ""
                L.append(f"  - `{mode}`: " + ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if k in c)
                         + part)
            if d.get("command"):
                L.append(f"  - command: `{d['command']}`")
            continue
        keys, values, cond = list(r["keys"]), list(r["values"]), dict(r.get("where", {}))
        recs = [x for x in d.get("records", []) if all(x.get(k) == v for k, v in cond.items())]
        if not recs:
            raise UsageError(f"{rel}: no records match {cond} (overlay/CONCERNS.toml results)")
        sel = "" if not cond else " where " + ", ".join(f"{k} = {v}" for k, v in cond.items())
        L.append(f"- {label} (`{rel}`, {d.get('device', '?')}, {len(recs)} record(s){sel}; command `{d.get('command', '?')}`):")
        L.append("")
        L.append("  | " + " | ".join(keys + values) + " |")
        L.append("  |" + "---|" * (len(keys) + len(values)))
        for x in recs:
            L.append("  | " + " | ".join(_fmt(x.get(k, "")) for k in keys + values) + " |")
        L.append("")
    return L
