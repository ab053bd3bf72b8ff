#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Regenerate the README's sparse-MLA tables from the benchmark results files.

Each table sits between marker comments in README.md::

    <!-- sparse-mla-decode:begin -->  ...  <!-- sparse-mla-decode:end -->
    <!-- sparse-mla-prefill:begin --> ...  <!-- sparse-mla-prefill:end -->

and is rendered from ``bench/results/sparse_decode_h200.json`` / ``sparse_prefill_h200.json``
(written by ``bench/sparse_mla_decode.py``) with the commands that produced them. Nothing else of
the README changes.

    python bench/readme_tables.py            # rewrite the tables in README.md
    python bench/readme_tables.py --check    # exit 1 when README.md is not up to date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sparse_mla_decode import DECODE_STEM, PREFILL_STEM, decode_table, prefill_table  # noqa: E402

RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
SECTIONS = ("sparse-mla-decode", "sparse-mla-decode-tp", "sparse-mla-prefill", "sparse-mla-prefill-h100")
# TP8 / TP4 head counts (8, 16) after the v2 dispatch, run on the card the session was lent (an
# H100 on 2026-12-06); kept apart from the H200 table above so no ratio mixes cards.
TP_DECODE_STEM = "sparse_decode_h100_tp"
# the prefill case after the v2 dispatch, same card rule (its FLASHMLA_SPARSE arm ran on that card)
PREFILL_H100_STEM = "sparse_prefill_h100"


def _commands(result: dict) -> list[str]:
    runs = result.get("runs") or [result]
    return [f"`{r['command']}`" for r in runs if r.get("command")]


def render_decode(result: dict | None, formats: tuple[str, ...] = ("fp8_ds_mla",)) -> list[str]:
    if result is None:
        return ["(no decode results yet: `python bench/sparse_mla_decode.py` writes them)"]
    recs = [r for r in result["records"] if r["kv_format"] in formats]
    lines = [f"{result['device']}, topk {result.get('topk', 2048)}, copy bandwidth "
             f"{result.get('copy_bw_GBps', 0):.0f} GB/s; us per call under CUDA-graph replay, host us = median "
             f"wall time of one eager call; from " + ", ".join(_commands(result)) + ":", ""]
    lines += decode_table(recs)
    if any(r.get("sm120_proxy") for r in recs):
        lines += ["", "SM120 proxy on the same GPU (`DISABLE_MMA_V3=1`: mma.sync like SM120; SM120 dispatch forced):", ""]
        lines += decode_table(recs, proxy=True)
    return lines


def render_prefill(result: dict | None) -> list[str]:
    if result is None:
        return ["(no prefill results yet: `python bench/sparse_mla_decode.py --prefill` writes them)"]
    lines = [f"{result['device']}, one request, {result['records'][0]['tokens'] if result['records'] else 0} query "
             f"rows, topk {result.get('topk', 2048)}; us per call (CUDA events, eager); from "
             + ", ".join(_commands(result)) + ":", ""]
    lines += prefill_table(result["records"])
    if any(r.get("sm120_proxy") for r in result["records"]):
        lines += ["", "SM120 proxy:", ""] + prefill_table(result["records"], proxy=True)
    return lines


def replace_section(text: str, name: str, body: list[str]) -> str:
    """``text`` with the lines between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by
    ``body``. Raises ValueError when the markers are missing, repeated or out of order."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"README needs exactly one {begin} and one {end}")
    i, j = text.index(begin), text.index(end)
    if j < i:
        raise ValueError(f"{end} comes before {begin}")
    return text[:i + len(begin)] + "\n" + "\n".join(body) + "\n" + text[j:]


def load(stem: str, results: Path = RESULTS) -> dict | None:
    p = results / f"{stem}.json"
    return json.loads(p.read_text()) if p.exists() else None


def render_readme(text: str, results: Path = RESULTS) -> str:
    text = replace_section(text, "sparse-mla-decode", render_decode(load(DECODE_STEM, results)))
    text = replace_section(text, "sparse-mla-decode-tp", render_decode(load(TP_DECODE_STEM, results),
                                                                        ("fp8_ds_mla", "bfloat16", "fp8")))
    text = replace_section(text, "sparse-mla-prefill", render_prefill(load(PREFILL_STEM, results)))
    return replace_section(text, "sparse-mla-prefill-h100", render_prefill(load(PREFILL_H100_STEM, results)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate the README's sparse-MLA tables from bench/results.")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from the regenerated text")
    ap.add_argument("--readme", default=str(README))
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text()
    new = render_readme(old, Path(args.results))
    if args.check:
        if new != old:
            print(f"{path} is out of date: run python bench/readme_tables.py")
            return 1
        return 0
    if new != old:
        path.write_text(new)
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
