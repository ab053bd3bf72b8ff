"""Implementation of tools/apply.py: pinned vLLM release -> patched, installed, verified vLLM."""
