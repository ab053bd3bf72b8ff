#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""SM120 readiness check of the project's Triton kernels, without a GPU.

Usage::

    python tools/sm120_check.py [KERNEL_FILE ...] [--arch 120 --arch 121] [--json OUT] [--filter S]

With no KERNEL_FILE it checks every ``kernels/*.py`` that defines ``SM120_COMPILE_SPECS``.
Each such function returns the list of every kernel configuration its dispatch can choose on
SM120/SM121, each a dict::

    {
      "name": str,                      # shown in the table
      "fn": <@triton.jit function>,
      "signature": {arg: type},         # Triton types: "*bf16", "*u8", "i32", "fp32", "constexpr", ...
      "constexprs": {arg: value},       # values of the "constexpr" arguments
      "divisible_by_16": [arg, ...],    # arguments the launcher specializes as multiples of 16
      "num_warps": int, "num_stages": int,
      "maxnreg": int,                   # optional: the register cap the launch passes
    }

Every spec is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
for each ``--arch`` (default: 120 and 121). A spec fails when its shared memory (the compiled
metadata) exceeds 101,376 bytes, when ``cuobjdump --dump-resource-usage`` (the copy shipped in
Triton's wheel) reports a stack frame or local memory (register spills), or when it does not
compile. Prints a table (registers, shared bytes, stack, local) and exits 1 on any failure.

Works with Triton 3.6 and 3.8 (the two pins' versions): both take ``ASTSource(fn, signature,
constexprs, attrs)`` with ``attrs = {(arg_index,): [["tt.divisibility", 16]]}``.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED_LIMIT = 101376
ROOT = Path(__file__).resolve().parent.parent


def _cuobjdump() -> str:
    import triton

    cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cand.exists():
        return str(cand)
    raise FileNotFoundError(f"cuobjdump not found in Triton's wheel ({cand})")


def load_module(path: Path):
    """Import a kernel file by path as a module of a package named after its folder, so that its
    relative imports (``from . import mla_kv_format``) resolve as they do in kernels/ and inside
    vLLM (vllm/v1/attention/ops/), whatever the current directory or sys.path."""
    folder = path.resolve().parent
    pkg = "_sm120_check_" + re.sub(r"\W", "_", str(folder))
    if pkg not in sys.modules:
        pspec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        pspec.submodule_search_locations = [str(folder)]
        sys.modules[pkg] = importlib.util.module_from_spec(pspec)
    name = f"{pkg}.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_specs(path: Path) -> list[dict] | None:
    """Import a kernel file by path and return its SM120_COMPILE_SPECS(), or None if absent."""
    text = path.read_text()
    if "SM120_COMPILE_SPECS" not in text:
        return None
    mod = load_module(path)
    fn = getattr(mod, "SM120_COMPILE_SPECS", None)
    if fn is None:
        return None
    return list(fn())


def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        tmp = f.name
    try:
        res = subprocess.run([_cuobjdump(), "--dump-resource-usage", tmp], capture_output=True, text=True, check=True)
    finally:
        os.unlink(tmp)
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", res.stdout)
        out[key.lower()] = int(m.group(1)) if m else None
    out["raw"] = res.stdout.strip()
    return out


def compile_spec(spec: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    fn = spec["fn"]
    names = fn.arg_names
    attrs = {}
    for a in spec.get("divisible_by_16", []):
        if a not in names:
            raise KeyError(f"{spec['name']}: divisible_by_16 names unknown argument {a!r}")
        attrs[(names.index(a),)] = [["tt.divisibility", 16]]
    src_cls = triton.compiler.ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit kernel: Gluon's front end
        from triton.experimental.gluon._runtime import GluonASTSource as src_cls
    src = src_cls(fn=fn, signature=dict(spec["signature"]), constexprs=dict(spec.get("constexprs", {})), attrs=attrs)
    opts = {"num_warps": spec.get("num_warps", 4), "num_stages": spec.get("num_stages", 1)}
    if spec.get("maxnreg"):  # the launch passes maxnreg= too
        opts["maxnreg"] = spec["maxnreg"]
    if spec.get("launch_cooperative_grid"):  # a cooperative launch (the top-k's COOP select)
        opts["launch_cooperative_grid"] = True
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    meta = k.metadata
    shared = meta.shared if hasattr(meta, "shared") else meta["shared"]
    ru = _resource_usage(k.asm["cubin"])
    return {"shared": int(shared), "reg": ru["reg"], "stack": ru["stack"], "local": ru["local"],
            "seconds": round(time.time() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="kernel files (default: kernels/*.py with SM120_COMPILE_SPECS)")
    ap.add_argument("--arch", type=int, action="append", help="SM arch to compile for (repeatable; default 120 and 121)")
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--filter", help="only specs whose name contains this substring")
    ap.add_argument("--shared-limit", type=int, default=SHARED_LIMIT, help="max shared memory per block (bytes)")
    args = ap.parse_args(argv)

    import triton

    archs = args.arch or [120, 121]
    files = [Path(f) for f in args.files] if args.files else sorted((ROOT / "kernels").glob("*.py"))
    rows, failures = [], 0
    print(f"triton {triton.__version__}; archs {archs}; shared limit {args.shared_limit} B")
    for path in files:
        specs = load_specs(path)
        if specs is None:
            continue
        if not specs:
            print(f"{path.name}: SM120_COMPILE_SPECS() returned no spec")
            failures += 1
            continue
        for spec in specs:
            if args.filter and args.filter not in spec["name"]:
                continue
            for arch in archs:
                row = {"file": path.name, "name": spec["name"], "arch": arch}
                try:
                    row.update(compile_spec(spec, arch))
                    problems = []
                    if row["shared"] > args.shared_limit:
                        problems.append(f"shared {row['shared']} > {args.shared_limit}")
                    if row["stack"] is None or row["local"] is None:
                        problems.append("no resource usage from cuobjdump")
                    elif row["stack"] or row["local"]:
                        problems.append(f"spills (stack {row['stack']} B, local {row['local']} B)")
                    row["ok"] = not problems
                    row["problems"] = problems
                except Exception as e:  # compile error: a failure, reported in the table
                    row.update({"ok": False, "problems": [f"compile error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"]})
                failures += 0 if row["ok"] else 1
                rows.append(row)
                print(f"{'ok  ' if row['ok'] else 'FAIL'} sm_{arch} {path.name}:{spec['name']} "
                      f"reg={row.get('reg')} shared={row.get('shared')} stack={row.get('stack')} local={row.get('local')} "
                      f"{'; '.join(row['problems'])}", flush=True)
    print()
    print(f"{'arch':<7}{'kernel':<86}{'reg':>5}{'shared':>9}{'stack':>7}{'local':>7}  result")
    for r in rows:
        print(f"sm_{r['arch']:<4}{(r['file'] + ':' + r['name'])[:85]:<86}{str(r.get('reg')):>5}{str(r.get('shared')):>9}"
              f"{str(r.get('stack')):>7}{str(r.get('local')):>7}  {'ok' if r['ok'] else 'FAIL: ' + '; '.join(r['problems'])}")
    print(f"\n{len(rows) - failures} ok, {failures} failed (of {len(rows)} compiles)")
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "archs": archs, "rows": rows}, indent=1))
    if not rows:
        print("no spec found")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
