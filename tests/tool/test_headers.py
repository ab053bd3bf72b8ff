"""Patch headers and file names (property tests)."""
from __future__ import annotations

import re

from hypothesis import given, strategies as st

from overlay_tool.patches import parse_message, patch_file_name, validate_header

GOOD = """[Attention] Route short prefills

Because the impl has no forward_mha.

Concern: attention-routing
Forwarded: https://github.com/vllm-project/vllm/pull/1
Last-Update: 2026-12-02
"""


def test_valid_header():
    h = parse_message(GOOD)
    assert h.subject == "[Attention] Route short prefills" and h.tags == ["Attention"]
    assert h.description == "Because the impl has no forward_mha."
    assert validate_header(h, "p") == []


def test_each_missing_field_is_named():
    for field, msg in [("Concern", "Concern"), ("Last-Update", "Last-Update"), ("Forwarded", "upstream status")]:
        text = "\n".join(line for line in GOOD.splitlines() if not line.startswith(field + ":"))
        problems = validate_header(parse_message(text), "p")
        assert any(msg in x for x in problems), (field, problems)
    bad = GOOD.replace("2026-12-02", "2026-13-02")
    assert any("is not a YYYY-MM-DD date" in x for x in validate_header(parse_message(bad), "p"))
    bad = GOOD.replace("Because the impl has no forward_mha.\n\n", "")
    assert any("no description" in x for x in validate_header(parse_message(bad), "p"))


@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=200), st.integers(1, 9999))
def test_patch_file_names_are_safe_and_stable(subject, n):
    name = patch_file_name(n, subject)
    assert name == patch_file_name(n, subject)
    assert re.fullmatch(r"\d{4}-[A-Za-z0-9._-]+\.patch", name) and len(name) <= 69
    assert ".." not in name and "/" not in name


@given(st.lists(st.from_regex(r"[A-Za-z][A-Za-z ]{0,30}[a-z]", fullmatch=True), min_size=1, max_size=3))
def test_description_paragraphs_round_trip(paras):
    text = "[Kernel] X\n\n" + "\n\n".join(paras) + "\n\nConcern: k\nForwarded: no\nLast-Update: 2026-01-02\n"
    h = parse_message(text)
    assert h.description == "\n\n".join(paras)
    assert h.fields == {"Concern": ["k"], "Forwarded": ["no"], "Last-Update": ["2026-01-02"]}
