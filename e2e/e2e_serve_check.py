#!/usr/bin/env python3
"""`vllm serve` of the tiny GLM-5 answers OpenAI requests through the patched install (issue 5,
verification 4).

Steps (each logged with its time; results as they come to $OUT/e2e_serve_check_h200.json):
1. preflight: in the engine's environment, import every module the server path needs and name all
   that are missing at once (e2e/gpu-host-serve-deps.txt lists the wheels the host lacks);
2. model: build or reuse the tiny GLM-5 of e2e/e2e_model.py (same place as e2e_correctness.py);
3. start `python -m vllm.entrypoints.cli.main serve MODEL --attention-backend TRITON_MLA_SPARSE
   --kv-cache-dtype fp8_ds_mla ...` (the `vllm` console script is not installed with pip --target),
   wait for /health;
4. GET /v1/models; POST /v1/chat/completions (a short message and one longer than index_topk, so
   the sparse path runs), POST /v1/completions; check the answers' shape (object, role, content,
   finish_reason, usage; prompt_tokens equal to the chat template's token count computed here);
5. shut the server down (SIGINT, then SIGKILL of its process group after 30 s).

usage (GPU host, staged vLLM in /tmp/site, plus the wheels of e2e/gpu-host-serve-deps.txt):
  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
      python3 e2e/e2e_serve_check.py [--kv-cache-dtype fp8_ds_mla] [--port 8765] [--eager]
Only the standard library is needed for the HTTP side (urllib).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import e2e_common as C  # noqa: E402

SERVER_MODULES = [
    "uvicorn", "watchfiles", "prometheus_fastapi_instrumentator", "model_hosting_container_standards",
    "jmespath", "fastapi", "starlette", "uvloop", "h11", "click", "prometheus_client",
    "vllm", "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server",
]
SERVED_NAME = "glm5-tiny"
LONG_WORDS = ("sparse attention reads the top tokens of a long context through an indexer that scores "
              "every earlier token with a few heads and keeps the best ones ")


def preflight(env: dict[str, str]) -> dict[str, Any]:
    """Import each server module in a fresh interpreter with the engine's environment."""
    return C.preflight_imports(SERVER_MODULES, env)


def http(method: str, url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode("utf-8", "replace")


def expected_chat_tokens(model_dir: pathlib.Path, messages: list[dict]) -> int | None:
    """Token count of the chat template's rendering, with the model's own tokenizer files."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding (transformers 5) or dict
            ids = ids["input_ids"]
        return len(ids)
    except Exception:  # noqa: BLE001 - informational only
        return None


def check_chat(resp: Any, max_tokens: int, expect_prompt: int | None) -> list[str]:
    problems = []
    if not isinstance(resp, dict):
        return [f"not a JSON object: {str(resp)[:300]}"]
    if resp.get("object") != "chat.completion":
        problems.append(f"object is {resp.get('object')!r}")
    ch = resp.get("choices") or []
    if len(ch) != 1:
        problems.append(f"{len(ch)} choices")
    else:
        msg = ch[0].get("message") or {}
        if msg.get("role") != "assistant":
            problems.append(f"role {msg.get('role')!r}")
        if not isinstance(msg.get("content"), str):
            problems.append(f"content is {type(msg.get('content')).__name__}")
        if ch[0].get("finish_reason") not in ("length", "stop"):
            problems.append(f"finish_reason {ch[0].get('finish_reason')!r}")
    u = resp.get("usage") or {}
    if not (isinstance(u.get("prompt_tokens"), int) and u["prompt_tokens"] > 0):
        problems.append(f"usage.prompt_tokens {u.get('prompt_tokens')!r}")
    if not (isinstance(u.get("completion_tokens"), int) and 0 < u["completion_tokens"] <= max_tokens):
        problems.append(f"usage.completion_tokens {u.get('completion_tokens')!r}")
    if expect_prompt is not None and u.get("prompt_tokens") != expect_prompt:
        problems.append(f"prompt_tokens {u.get('prompt_tokens')} != chat template's {expect_prompt}")
    if resp.get("model") != SERVED_NAME:
        problems.append(f"model {resp.get('model')!r}")
    return problems


def server_args(model_dir: pathlib.Path, a: argparse.Namespace) -> list[str]:
    """The arguments after `vllm serve` (the README recipe uses the same flags)."""
    args = [str(model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(a.port),
            "--attention-backend", a.backend, "--kv-cache-dtype", a.kv_cache_dtype,
            "--max-model-len", "4160", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(2 * 2**30)]
    if a.eager:
        args += ["--enforce-eager"]
    else:
        args += ["-cc", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": [1, 2, 4, 8]})]
    if a.backend == "FLASHMLA_SPARSE":
        args += ["--attention-config", json.dumps({"sparse_mla_force_mqa": True})]
    return args + shlex.split(a.extra)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build/reuse $E2E_WORK/glm5-tiny)")
    ap.add_argument("--backend", default="TRITON_MLA_SPARSE")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager instead of decode CUDA graphs")
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--extra", default="", help="extra server arguments (one string, shell-split)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import e2e_model as M

    out, work = C.out_dir(), C.work_dir()
    results: dict[str, Any] = {"name": "e2e_serve_check_h200",
                               "command": "python3 " + " ".join(shlex.quote(x) for x in sys.argv)}
    run = C.Run(out / "e2e_serve_check_h200.json", results, tag="serve")
    env = C.engine_env()
    with run.phase("preflight"):
        pf = preflight(env)
        results["preflight"] = pf
        if pf.get("missing"):
            run.log("MISSING for the server: " + "; ".join(f"{m} ({e})" for m, e in pf["missing"].items()))
        if pf.get("error") or pf.get("missing", {}).get("vllm.entrypoints.openai.api_server"):
            raise RuntimeError("the server modules do not import: " + json.dumps(pf)[:2000])
    model_dir = pathlib.Path(a.model) if a.model else work / "glm5-tiny"
    with run.phase("model", fatal=True):
        if not a.model and not M.model_is_current(model_dir, "tiny", 0):
            M.write_model(model_dir, "tiny", 0, log=run.log)
    log_path = work / "serve_log.txt"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *server_args(model_dir, a)]
    results["server_command"] = " ".join(shlex.quote(x) for x in cmd)
    base = f"http://127.0.0.1:{a.port}"
    proc = None
    rc = 1
    try:
        with run.phase("start", fatal=True):
            run.log("server: " + results["server_command"])
            results["gpu_before"] = C.wait_gpu_idle(log=run.log)
            logf = open(log_path, "wb")
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            logf.close()
            t0 = time.time()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode} before it was healthy; log tail:\n"
                                       + C.tail(log_path, 4000))
                if time.time() - t0 > a.startup_timeout_s:
                    raise TimeoutError(f"no /health after {a.startup_timeout_s} s; log tail:\n" + C.tail(log_path, 4000))
                try:
                    st, _ = http("GET", base + "/health", timeout=2)
                    if st == 200:
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                time.sleep(1.0)
            results["startup_s"] = round(time.time() - t0, 1)
            run.log(f"server healthy after {results['startup_s']} s")
        checks: dict[str, Any] = {}
        with run.phase("models"):
            st, body = http("GET", base + "/v1/models")
            ids = [m.get("id") for m in (body.get("data") or [])] if isinstance(body, dict) else []
            checks["models"] = {"status": st, "ids": ids, "ok": st == 200 and SERVED_NAME in ids}
        cases = {
            "chat_short": [{"role": "user", "content": "Hello! Who are you?"}],
            "chat_long": [{"role": "system", "content": "You are a test."},
                          {"role": "user", "content": LONG_WORDS * 12}],
        }
        for name, messages in cases.items():
            with run.phase(name):
                exp = expected_chat_tokens(model_dir, messages)
                t = time.time()
                st, body = http("POST", base + "/v1/chat/completions",
                                {"model": SERVED_NAME, "messages": messages, "max_tokens": 16, "temperature": 0.0},
                                timeout=120)
                probs = ([] if st == 200 else [f"HTTP {st}"]) + check_chat(body, 16, exp)
                checks[name] = {"status": st, "seconds": round(time.time() - t, 2), "expected_prompt_tokens": exp,
                                "response": body if isinstance(body, dict) else str(body)[:2000],
                                "problems": probs, "ok": not probs}
                run.log(f"{name}: HTTP {st}, problems {probs}, usage {(body or {}).get('usage') if isinstance(body, dict) else None}")
        with run.phase("completions"):
            st, body = http("POST", base + "/v1/completions",
                            {"model": SERVED_NAME, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.0},
                            timeout=120)
            ok = (st == 200 and isinstance(body, dict) and body.get("object") == "text_completion"
                  and len(body.get("choices") or []) == 1 and isinstance(body["choices"][0].get("text"), str))
            checks["completions"] = {"status": st, "response": body if isinstance(body, dict) else str(body)[:2000],
                                     "ok": bool(ok)}
        results["checks"] = checks
        need = ("models", "chat_short", "chat_long", "completions")
        results["pass"] = all((checks.get(k) or {}).get("ok") for k in need)
        long_tokens = (checks.get("chat_long") or {}).get("expected_prompt_tokens")
        results["note"] = (f"chat_long prompt: {long_tokens} tokens (index_topk 256: sparse when > 256)"
                           if long_tokens else None)
        rc = 0 if results["pass"] else 1
    except Exception:  # noqa: BLE001 - recorded by run.phase; summarised below
        rc = 1
    finally:
        with run.phase("shutdown"):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                results["server_returncode"] = proc.poll()
        try:
            text = log_path.read_text(errors="replace")
            keys = [ln for ln in text.splitlines() if any(p in ln for p in C.KEY_LOG_PATTERNS)]
            (out / "e2e_serve_check_log.txt").write_text(
                "-- key lines:\n" + "\n".join(keys[-200:]) + "\n-- tail:\n" + text[-60000:])
        except OSError:
            pass
        run.save()
    print("\n" + "=" * 100)
    print(f"serve check: {'PASS' if results.get('pass') else 'FAIL'}  ({run.elapsed():.0f} s)")
    print(f"server: {results.get('server_command')}")
    for k, v in (results.get("checks") or {}).items():
        print(f"  {k}: ok={v.get('ok')} status={v.get('status')} {v.get('problems') or ''}")
    if results.get("errors"):
        for e in results["errors"]:
            print(f"  ERROR {e['phase']}: {e['type']}: {e['message'][:500]}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
