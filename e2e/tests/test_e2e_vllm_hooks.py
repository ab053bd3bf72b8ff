"""The one place the correctness harness reaches into vLLM: the frontend's LogprobsProcessor is
wrapped so full-vocabulary prompt log-probs stay tensors. Runs where vLLM 0.26.x is importable."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm.v1.engine.logprobs", exc_type=ImportError)

import e2e_correctness as E  # noqa: E402


def _tensors(prompt, lp, k=None):
    import torch
    from vllm.v1.outputs import LogprobsTensors

    k = lp.shape[1] if k is None else k
    top = torch.topk(lp, k, -1)
    tgt = torch.as_tensor(prompt[1:])
    ids = torch.cat([tgt[:, None], top.indices], 1).to(torch.int32)
    vals = torch.cat([lp.gather(1, tgt[:, None]), top.values], 1)
    return LogprobsTensors(ids, vals, torch.zeros(len(prompt) - 1, dtype=torch.int32))


def test_capture_keeps_full_vocab_tensors_and_passes_other_requests_through(monkeypatch):
    import torch
    from vllm.v1.engine import logprobs as lpmod

    monkeypatch.setattr(lpmod.LogprobsProcessor, "update_from_output", lpmod.LogprobsProcessor.update_from_output)
    store = E.install_prompt_logprob_capture()
    V, prompt = 16, [3, 5, 7, 1, 2]
    lp = torch.log_softmax(torch.randn(len(prompt) - 1, V), -1)

    def proc(n):
        return lpmod.LogprobsProcessor(tokenizer=None, logprobs=None, prompt_logprobs=[None], cumulative_logprob=None,
                                       num_logprobs=None, num_prompt_logprobs=n)

    p = proc(-1)
    p.update_from_output(types.SimpleNamespace(new_logprobs=None, new_prompt_logprobs_tensors=_tensors(prompt, lp)))
    assert len(store) == 1 and p.prompt_logprobs == [None]
    ids, lps = E.find_capture(store, prompt)
    assert torch.equal(E.dense_logprobs(ids, lps, V), lp)
    q = proc(2)
    q.update_from_output(types.SimpleNamespace(new_logprobs=None, new_prompt_logprobs_tensors=_tensors(prompt, lp, 2)))
    assert store == [] and len(q.prompt_logprobs) == len(prompt)
    first = q.prompt_logprobs[1]
    assert prompt[1] in first and abs(first[prompt[1]].logprob - float(lp[0, prompt[1]])) < 1e-6
