"""A fake vLLM for the CPU tests of e2e/e2e_throughput.py (never installed anywhere else).

It imitates what the throughput worker uses of vLLM 0.26.0's offline API: ``LLM(**kw)`` with
``llm.llm_engine.add_request / step / has_unfinished_requests``, ``RequestOutput`` objects with
``metrics`` (a RequestStateStats-like object: first/last token and scheduled timestamps, only when
``disable_log_stats`` is False, as in vLLM), ``num_cached_tokens`` and DELTA token lists, prefix
caching by 64-token blocks, chunked prefill, and a VIRTUAL engine clock: a step lasts
(1 + 0.02 x decode batch) ms + 2 us per prefill token. Knobs (environment):

* FAKE_VLLM_SLOW_PASS=k: the k-th pass (requests added while the engine was idle) runs its steps 3x
  slower (an outlier sample);
* FAKE_VLLM_EVENTS=path: append "import <pid> <time>" at import and "exit <pid> <time>" at exit
  (real wall-clock), so a test can see whether two engine processes overlapped;
* FAKE_VLLM_NO_METRICS=1: metrics None whatever disable_log_stats says.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from types import SimpleNamespace

from .inputs import TokensPrompt  # noqa: F401
from .sampling_params import RequestOutputKind, SamplingParams  # noqa: F401

__version__ = "0.26.0+fake"

_EV = os.environ.get("FAKE_VLLM_EVENTS")


def _event(what: str) -> None:
    if _EV:
        with open(_EV, "a") as f:
            f.write(f"{what} {os.getpid()} {time.time():.6f}\n")


_event("import")
atexit.register(_event, "exit")


class _Req:
    def __init__(self, rid, tokens, sp, clock):
        self.rid, self.tokens, self.sp = rid, list(tokens), sp
        self.computed = 0
        self.generated = 0
        self.cached = None
        self.metrics = SimpleNamespace(arrival_time=time.time(), queued_ts=clock, scheduled_ts=0.0,
                                       first_token_ts=0.0, last_token_ts=0.0, num_generation_tokens=0,
                                       first_token_latency=0.0, is_corrupted=False)


class _Engine:
    def __init__(self, kw):
        self.kw = kw
        self.chunk = kw.get("max_num_batched_tokens", 8192)
        self.max_seqs = kw.get("max_num_seqs", 256)
        self.stats = not kw.get("disable_log_stats", True) and not os.environ.get("FAKE_VLLM_NO_METRICS")
        self.clock = 1000.0
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.blocks: set = set()
        self.passes = 0
        self.slow_pass = int(os.environ.get("FAKE_VLLM_SLOW_PASS", "0") or 0)

    def _hashes(self, tokens):
        h, out = 0, []
        for j in range(len(tokens) // 64):
            h = hash((h, tuple(tokens[64 * j: 64 * (j + 1)])))
            out.append(h)
        return out

    def add_request(self, request_id, prompt, params, **kw):
        if not self.running and not self.waiting:
            self.passes += 1
        self.waiting.append(_Req(request_id, prompt["prompt_token_ids"], params, self.clock))
        return request_id

    def has_unfinished_requests(self):
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self):
        return len(self.running) + len(self.waiting)

    def step(self):
        budget = self.chunk
        decoding = [r for r in self.running if r.computed >= len(r.tokens)]
        budget -= len(decoding)
        prefill_tok = 0
        while self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting.pop(0)
            hs = self._hashes(r.tokens)
            n = 0
            while n < len(hs) and hs[n] in self.blocks:
                n += 1
            r.cached = min(64 * n, (len(r.tokens) - 1) // 64 * 64)
            r.computed = r.cached
            r.metrics.scheduled_ts = self.clock
            self.running.append(r)
        for r in self.running:
            if r.computed < len(r.tokens) and budget > 0:
                take = min(budget, len(r.tokens) - r.computed)
                r.computed += take
                budget -= take
                prefill_tok += take
        dur = (1.0 + 0.02 * len(decoding)) * 1e-3 + 2e-6 * prefill_tok
        if self.slow_pass and self.passes == self.slow_pass:
            dur *= 3
        self.clock += dur
        outs = []
        for r in list(self.running):
            if r.computed < len(r.tokens):
                continue  # still prefilling: no token this step
            r.generated += 1
            m = r.metrics
            if r.generated == 1:
                m.first_token_ts = self.clock
                for h in self._hashes(r.tokens):
                    self.blocks.add(h)
            m.last_token_ts = self.clock
            m.num_generation_tokens = r.generated
            finished = r.generated >= r.sp.max_tokens
            outs.append(SimpleNamespace(
                request_id=r.rid, finished=finished, num_cached_tokens=r.cached,
                prompt_token_ids=r.tokens, metrics=m if self.stats else None,
                outputs=[SimpleNamespace(token_ids=[7])]))
            if finished:
                self.running.remove(r)
        return outs


class LLM:
    def __init__(self, **kw):
        self.kw = kw
        print(f"INFO fake LLM {sorted(kw)}", flush=True)
        print(f"INFO Using AttentionBackendEnum.{kw.get('attention_backend')} backend.", flush=True)
        if kw.get("speculative_config"):
            print("INFO Loading drafter model...", flush=True)
            print("INFO Using FLASHMLA_SPARSE attention backend out of potential backends: "
                  "['FLASHMLA_SPARSE', 'TRITON_MLA_SPARSE'].", flush=True)
        print("INFO GPU KV cache size: 1,234,560 tokens", flush=True)
        time.sleep(float(os.environ.get("FAKE_VLLM_INIT_S", "0")))
        self.llm_engine = _Engine(kw)

    def get_metrics(self):
        return []

    def start_profile(self):
        pass

    def stop_profile(self):
        pass


