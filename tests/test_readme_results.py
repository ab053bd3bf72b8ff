"""The README's result tables are the result files' numbers: every cell of the DSA indexer and
end-to-end correctness tables is checked against bench/results/*.json (to the precision printed),
so a re-run that changes a file without the README, or a hand-edited number, fails here. (The
sparse MLA tables are generated from their files by bench/readme_tables.py, whose --check runs in
tests/bench.)"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table as (header cells, body rows)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            head = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            out.append((head, rows))
        else:
            i += 1
    return out


def _table(starts: list[str]):
    for head, rows in _tables((REPO / "README.md").read_text()):
        if head[: len(starts)] == starts:
            return head, rows
    pytest.fail(f"README has no table starting with columns {starts}")


def _same(cell: str, value: float) -> bool:
    """Does the printed cell show `value` (rounded as printed)?"""
    cell = cell.replace(",", "")
    if re.fullmatch(r"-?\d+(\.\d+)?e[-+]\d+", cell):
        return math.isclose(float(cell), value, rel_tol=0.051)
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return abs(float(cell) - value) <= 0.5 * 10 ** -decimals + 1e-9


def _check_row(where: str, cells: dict[str, str], values: dict[str, float]) -> list[str]:
    return [f"{where} {col}: README {cells[col]}, file {values[col]!r}"
            for col in values if not _same(cells[col], values[col])]


def test_indexer_table_matches_the_results_file():
    head, rows = _table(["context", "T", "Triton logits+top-k"])
    # the README rows are the bench's standard shapes (logits as wide as the context); the --extra
    # shapes with wider logits (max_model_len > context) are in the results file's own table
    recs = {(r["context"], r["tokens"]): r for r in json.loads((RESULTS / "indexer_h200.json").read_text())["records"]
            if r.get("max_model_len", r["context"]) == r["context"]}
    bad = []
    for row in rows:
        c = dict(zip(head, row))
        r = recs.get((int(c["context"]), int(c["T"])))
        if r is None:
            bad.append(f"row {row[:2]} is not in indexer_h200.json")
            continue
        ours_bw, dg_bw = re.fullmatch(r"(\d+) \((\d+)\)", c["logits % copy BW (DG)"]).groups()
        c = {**c, "ours_bw": ours_bw, "dg_bw": dg_bw}
        bad += _check_row(f"ctx={c['context']} T={c['T']}", c, {
            "Triton logits+top-k": r["us"], "logits": r["logits_us"], "top-k": r["topk_us"],
            "DeepGEMM logits": r["deepgemm_us"], "persistent_topk": r["persistent_topk_us"],
            "DG+PT (same graph)": r["deepgemm_plus_topk_us"], "ratio": r["ratio_vs_deepgemm"],
            "vs vLLM": r["ratio_vs_vllm_choice"], "ours_bw": r["logits_pct_copy_bw"],
            "dg_bw": r["deepgemm_logits_pct_copy_bw"], "PyTorch": r["torch_us"]})
    assert rows and not bad, "\n".join(bad)


def test_e2e_correctness_table_matches_the_results_file():
    head, rows = _table(["backend", "KV cache", "top-1 agreement"])
    recs = {(r["backend"], r["kv_cache_dtype"].split()[0]): r
            for r in json.loads((RESULTS / "e2e_correctness_h200.json").read_text())["records"]}
    bad = []
    for row in rows:
        c = dict(zip(head, row))
        backend = c["backend"].split()[0]
        key = ("HF_TRANSFORMERS_BF16", "bf16") if backend == "HF" else (backend, c["KV cache"].split()[0])
        r = recs.get(key)
        if r is None:
            bad.append(f"row {row[:2]} is not in e2e_correctness_h200.json")
            continue
        bad += _check_row(f"{key}", c, {"top-1 agreement": r["top1_agree"], "mean KL(ref, vLLM)": r["mean_kl"],
                                         "bootstrap SE": r["mean_kl_se"]})
    assert rows and not bad, "\n".join(bad)


def test_a_changed_number_is_caught():
    assert _same("0.47", 0.4665) and not _same("0.48", 0.4665)
    assert _same("5,409", 5409.4) and not _same("5,409", 5411.0)
    assert _same("4.4e-03", 0.004377) and not _same("4.4e-03", 0.0050)


def test_gpu_tests_line_matches_the_results_file():
    """The README's "Last result" of the GPU tests is the file's: commit and per-mode counts."""
    text = " ".join((REPO / "README.md").read_text().split())
    m = re.search(r"Last result \(`bench/results/gpu_tests_h200\.json`, commit (\w+)\): (\d+) passed, (\d+) failed, "
                  r"(\d+) skipped", text)
    assert m, "README has no 'Last result (`bench/results/gpu_tests_h200.json`, commit ...)' line"
    doc = json.loads((RESULTS / "gpu_tests_h200.json").read_text())
    assert doc["commit"].startswith(m.group(1))
    for mode, res in doc["modes"].items():
        c = res["counts"]
        assert (c["passed"], c["failed"], c["skipped"]) == tuple(int(x) for x in m.groups()[1:]), mode
    stopped = any(res.get("timed_out") for res in doc["modes"].values())
    assert doc["ok"] == (m.group(3) == "0" and not stopped)
    if stopped:  # a run cut off at its deadline says so, and names the run of the rest, which passed
        after = text[m.end():m.end() + 2000]
        assert "deadline" in after, "a run stopped at its deadline must say so"
        r = re.search(r"`bench/results/(gpu_tests_h200_\w+\.json)`[^:]*: (\d+) passed, (\d+) failed", after)
        assert r, "a stopped run must name the results file of the tests it did not reach"
        rest = json.loads((RESULTS / r.group(1)).read_text())
        assert rest["commit"] == doc["commit"] and rest["ok"]
        for mode, res in rest["modes"].items():
            assert (res["counts"]["passed"], res["counts"]["failed"]) == (int(r.group(2)), int(r.group(3))), mode


def test_upstream_tests_line_matches_the_results_file():
    """The README's "Last result" of vLLM's own sparse MLA test is the file's: commit and the counts
    of each backend (or "not run yet" while the file does not exist)."""
    text = " ".join((REPO / "README.md").read_text().split())
    name = "upstream_sparse_mla_tests_h200.json"
    path = RESULTS / name
    if not path.exists():
        assert f"Last result (`bench/results/{name}`): not run yet" in text, \
            f"README must say the upstream test was not run yet while bench/results/{name} does not exist"
        return
    m = re.search(rf"Last result \(`bench/results/{re.escape(name)}`, commit (\w+)\): ([^.]*)\.", text)
    assert m, f"README has no 'Last result (`bench/results/{name}`, commit ...): <backend> N passed, N failed, N skipped; ...' line"
    doc = json.loads(path.read_text())
    assert doc["commit"].startswith(m.group(1))
    shown = {b: tuple(int(x) for x in n) for b, *n in
             re.findall(r"(\w+) (\d+) passed, (\d+) failed, (\d+) skipped", m.group(2))}
    have = {b: (r["counts"]["passed"], r["counts"]["failed"], r["counts"]["skipped"]) for b, r in doc["backends"].items()}
    assert shown == have, f"README {shown} vs file {have}"
