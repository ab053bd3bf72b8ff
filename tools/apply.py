#!/usr/bin/env python3
"""tools/apply.py: pinned vLLM release -> patched, installed, verified vLLM.

Run `python3 tools/apply.py --help`. The implementation is in tools/overlay_tool/.
"""
import os
import sys

if sys.version_info < (3, 11):
    sys.exit("tools/apply.py needs Python >= 3.11 (tomllib)")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    from overlay_tool.cli import main
except ModuleNotFoundError as e:  # a missing dependency of the tool itself
    sys.exit(f"error: {e.name} is missing: pip install -e . (pyproject.toml lists GitPython, wheel, packaging, tqdm, pip)")

if __name__ == "__main__":
    sys.exit(main())
