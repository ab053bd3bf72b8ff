"""fake (e2e/tests/fake_vllm)"""
