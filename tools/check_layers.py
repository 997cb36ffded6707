#!/usr/bin/env python3
"""Checks the layering of kvlink's two library crates (docs/architecture.md, "Rooms").

- `kvlink` (src/): no module imports from a layer above it (the layers as src/lib.rs's comment
  lists them, so that the comment is the one place they are written). The events crate is re-exported as
  `kvlink::events` for users; no module of the transfer engine uses it.
- `kvlink-events` (src/kvlink-events/src/): the same rule over its own layers (its lib.rs).
- No file of the events crate is over 600 lines.
- No function of the crates and tools is over MAX_FUNCTION_LINES lines without its reason in a
  `// Long: ...` comment among the lines just above it; no Python function of the package and
  the tools over MAX_PY_FUNCTION_LINES without a `# Long: ...` comment just above it.
- `kvlink` has at most MAX_STRING_ERRORS `Result<_, String>` (errors as text; lower it as they
  become named types, never raise it), each with its reason on the line above
  (`// A String error kept: ...`); `kvlink-events` has at most MAX_EVENTS_STRING_ERRORS (its
  errors are enums in `error.rs` and `wire/errors.rs`).

Reads `crate::<module>` paths everywhere, and `super::<module>` in files directly under a crate's
root (where `super` is the crate). Exits 1, listing each offence, when one is found.
"""

import ast
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
EVENTS_DIR = "kvlink-events"
MAX_EVENTS_LINES = 600
MAX_STRING_ERRORS = 10
MAX_EVENTS_STRING_ERRORS = 0
MAX_FUNCTION_LINES = 80
MAX_PY_FUNCTION_LINES = 80
PY_FUNCTION_ROOTS = ["ffi/python/python/kvlink", "tools"]
FUNCTION_ROOTS = ["src", "ffi/c/src", "ffi/python/src", "tools/kvlink-bench/src", "tools/kvlink-events/src"]

# A crate's layers, read from the comment in its lib.rs that starts with "// Layers, top to
# bottom" and lists them on the "//   " lines after it: "a > b, c > d" puts a above b and c,
# which are above d. Equal layers may import each other only if listed in SAME_LAYER_OK.
ENGINE_SAME_LAYER_OK = {("plan", "layout"), ("grant", "layout")}


def layers_of(lib: pathlib.Path) -> dict:
    """Each module's rank (higher imports lower) from the layer comment of `lib`."""
    lines = lib.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("// Layers, top to bottom")), None)
    if start is None:
        sys.exit(f"layers: {lib.relative_to(REPO)} has no '// Layers, top to bottom' comment")
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("//"):
            break
        if line.startswith("//   "):
            body.append(line[2:])
    groups = [g for g in " ".join(body).split(">") if g.strip()]
    return {m.strip(): len(groups) - i for i, g in enumerate(groups) for m in g.split(",")}


def imports(root: pathlib.Path, path: pathlib.Path, top_level: bool) -> set:
    """The crate's modules a file names: `crate::x`, and `super::x` in a file under the root
    (names of items at the root, such as a re-exported function, are not modules)."""
    text = path.read_text()
    found = set(re.findall(r"\bcrate::([a-z_]+)", text))
    if top_level:
        found |= set(re.findall(r"\bsuper::([a-z_]+)", text))
    return {m for m in found if m == "events" or (root / f"{m}.rs").exists() or (root / m).is_dir()}


def string_errors(text: str) -> tuple:
    """How many `Result<T, String>` a file writes (nested generics and tuples read whole), and
    how many of them have no reason on the line above."""
    n = unexplained = 0
    for m in re.finditer(r"\bResult<", text):
        depth, nest, last_comma, j = 1, 0, None, m.end()
        while j < len(text) and depth:
            c = text[j]
            if c == "<":
                depth += 1
            elif c == ">" and text[j - 1] != "-":
                depth -= 1
            elif c in "([":
                nest += 1
            elif c in ")]":
                nest -= 1
            elif c == "," and depth == 1 and not nest:
                last_comma = j
            j += 1
        if last_comma is not None and text[last_comma + 1 : j - 1].strip() == "String":
            n += 1
            line_start = text.rfind("\n", 0, m.start())
            above = text[text.rfind("\n", 0, line_start) + 1 : line_start]
            unexplained += "A String error kept:" not in above
    return n, unexplained


def long_functions(path: pathlib.Path) -> list:
    """`(name, line, length)` of each function over MAX_FUNCTION_LINES lines with no
    `// Long:` reason among the comment, doc and attribute lines right above it."""
    lines = path.read_text().split("\n")
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(pub(\([^)]*\))? )?(async )?(unsafe )?(extern \"C\" )?fn (\w+)", line)
        if not m:
            continue
        indent, j = m.group(1), i
        while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")):
            j += 1
        if j == len(lines) or lines[j].rstrip().endswith(";"):
            continue
        end = next((k for k in range(j + 1, len(lines)) if lines[k] == indent + "}"), j)
        k = i - 1
        while k >= 0 and lines[k].strip().startswith(("//", "#[")):
            k -= 1
        reasoned = any("// Long:" in lines[x] for x in range(k + 1, i))
        if end - i + 1 > MAX_FUNCTION_LINES and not reasoned:
            out.append((m.group(7), i + 1, end - i + 1))
    return out


def long_py_functions(path: pathlib.Path) -> list:
    """`(name, line, length)` of each Python function over MAX_PY_FUNCTION_LINES lines with no
    `# Long:` reason among the comment and decorator lines right above it."""
    text = path.read_text()
    lines = text.split("\n")
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        n = (node.end_lineno or node.lineno) - node.lineno + 1
        k = first - 1
        while k >= 0 and lines[k].strip().startswith("#"):
            k -= 1
        reasoned = any("# Long:" in lines[x] for x in range(k + 1, first))
        if n > MAX_PY_FUNCTION_LINES and not reasoned:
            out.append((node.name, node.lineno, n))
    return out


def check_crate(root, layers, same_ok, skip_dir=None):
    bad, files = [], 0
    for path in sorted(root.rglob("*.rs")):
        rel = path.relative_to(root)
        if skip_dir and rel.parts[0] == skip_dir:
            continue
        files += 1
        module = rel.parts[0].removesuffix(".rs")
        if module == "lib":
            continue
        for target in sorted(imports(root, path, len(rel.parts) == 1) - {module}):
            if target == "events":
                bad.append(f"{rel}: crate::events (the transfer engine does not use kvlink-events)")
            elif target not in layers or module not in layers:
                bad.append(f"{rel}: {target} (module not in the layer table)")
            elif layers[target] > layers[module] or (
                layers[target] == layers[module] and (module, target) not in same_ok
            ):
                bad.append(f"{rel}: {target} ({module} may not import from {target})")
        if skip_dir and re.search(r"\bkvlink_events\b", path.read_text()):
            bad.append(f"{rel}: kvlink_events (only lib.rs re-exports it)")
    return bad, files


src = REPO / "src"
events_root = src / EVENTS_DIR / "src"
bad, engine_files = check_crate(src, layers_of(src / "lib.rs"), ENGINE_SAME_LAYER_OK, skip_dir=EVENTS_DIR)
events_bad, events_files = check_crate(events_root, layers_of(events_root / "lib.rs"), set())
bad += [f"{EVENTS_DIR}/src/{b}" for b in events_bad]
string_results = events_string_results = 0
for p in sorted(src.rglob("*.rs")):
    n, unexplained = string_errors(p.read_text())
    if EVENTS_DIR in p.parts:
        events_string_results += n
        continue
    string_results += n
    if unexplained:
        bad.append(f"{p.relative_to(src)}: {unexplained} Result<_, String> without a reason above")
if string_results > MAX_STRING_ERRORS:
    bad.append(f"{string_results} Result<_, String> in kvlink (at most {MAX_STRING_ERRORS})")
if events_string_results > MAX_EVENTS_STRING_ERRORS:
    bad.append(f"{events_string_results} Result<_, String> in kvlink-events (at most {MAX_EVENTS_STRING_ERRORS})")
for r in FUNCTION_ROOTS:
    for path in sorted((REPO / r).rglob("*.rs")):
        for name, line, n in long_functions(path):
            bad.append(f"{path.relative_to(REPO)}:{line}: fn {name} is {n} lines (a `// Long:` reason, or split it)")
for r in PY_FUNCTION_ROOTS:
    for path in sorted((REPO / r).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for name, line, n in long_py_functions(path):
            bad.append(f"{path.relative_to(REPO)}:{line}: def {name} is {n} lines (a `# Long:` reason, or split it)")
for path in sorted((src / EVENTS_DIR).rglob("*.rs")):
    lines = len(path.read_text().splitlines())
    if lines > MAX_EVENTS_LINES:
        bad.append(f"{path.relative_to(src)}: {lines} lines (at most {MAX_EVENTS_LINES})")
if bad:
    print("layers: offences:", *bad, sep="\n  ")
    sys.exit(1)
print(
    f"layers: ok (kvlink {engine_files} files, kvlink-events {events_files} files; "
    f"{string_results} Result<_, String> of at most {MAX_STRING_ERRORS}; "
    f"kvlink-events {events_string_results} of at most {MAX_EVENTS_STRING_ERRORS})"
)
