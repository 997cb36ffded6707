#!/usr/bin/env python3
"""Checks that no module of src/ imports from a layer above it (docs/architecture.md, "Rooms").

Reads every `crate::<module>` path in src/ and compares the importing module's layer with the
imported one's. `events` stands apart: it may import only itself, and nothing imports it.
Exits 1, listing each offending file and path, when a module reaches upwards.
"""
import pathlib
import re
import sys

# Higher imports lower, never the reverse. Equal layers may import each other only if listed
# in SAME_LAYER_OK.
LAYERS = {
    "engine": 9,
    "session": 8,
    "state": 7,
    "control": 6,
    "config": 5.5,
    "transport": 5,
    "completion": 4,
    "plan": 3,
    "layout": 3,
    "grant": 3,
    "conn_limit": 0,
    "memory": 2,
    "error": 1.5,
    "log_limit": 0,
    "auth": 1.6,
    "gpu": 1,
    "shm": 0.5,
    "ids": 0,
    "tp": 0,
    "inbox": 0,
    "verify": 10,
    "fuzzing": 10,
}
# Test harnesses above both the transfer engine and events: they may import from either.
HARNESSES = {"fuzzing"}
SAME_LAYER_OK = {("plan", "layout"), ("grant", "layout")}

root = pathlib.Path(__file__).resolve().parent.parent / "src"
bad = []
for path in sorted(root.rglob("*.rs")):
    rel = path.relative_to(root)
    module = rel.parts[0].removesuffix(".rs")
    if module == "lib":
        continue
    for target in sorted(set(re.findall(r"crate::([a-z_]+)", path.read_text()))):
        if target == module:
            continue
        if module in HARNESSES:
            continue
        if "events" in (module, target):
            bad.append(f"{rel}: crate::{target} (events shares nothing with the transfer engine)")
            continue
        if target not in LAYERS or module not in LAYERS:
            bad.append(f"{rel}: crate::{target} (module not in the layer table)")
            continue
        mine, theirs = LAYERS[module], LAYERS[target]
        if theirs > mine or (theirs == mine and (module, target) not in SAME_LAYER_OK):
            bad.append(f"{rel}: crate::{target} ({module} may not import from {target})")
if bad:
    print("layers: modules importing from a layer above them:", *bad, sep="\n  ")
    sys.exit(1)
print(f"layers: ok ({sum(1 for _ in root.rglob('*.rs'))} files)")
