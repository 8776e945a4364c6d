"""lm-eval's default tokenizer lookup against a running dsflash server, offline: `local-completions` with
tokenizer_backend="auto" asks GET /tokenizer_info (it needs `eos_token`) and POST /tokenize; when both answer it
uses the server's tokenizer (RemoteTokenizer) instead of downloading one from the Hub.

lm-eval pins nothing that conflicts with ours, but its dependencies are many (datasets, evaluate, transformers, ...)
and this check needs none of them, so it is installed beside, not into, the venv:

    pip install --no-deps --target /tmp/lmeval-pkg lm_eval==0.4.13
    pip install --target /tmp/lmeval-deps aiohttp tenacity   # what lm_eval.models imports that our venv lacks
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lm_eval_check.py http://127.0.0.1:20000 [--api-key KEY]

Exit status 0 when lm-eval picked the remote tokenizer and it round-trips text.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base_url", help="the server, e.g. http://127.0.0.1:20000")
    p.add_argument("--model", default="dsflash-tiny-v4.1", help="the served model id (default: dsflash-tiny-v4.1)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: none)")
    p.add_argument("--lm-eval-path", default="/tmp/lmeval-pkg", help="where lm_eval lies (default: /tmp/lmeval-pkg)")
    p.add_argument("--deps-path", default="/tmp/lmeval-deps", help="its extra deps (default: /tmp/lmeval-deps)")
    args = p.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # a Hub lookup would fail here instead of passing by accident
    sys.path.insert(0, args.lm_eval_path)
    sys.path.append(args.deps_path)  # after the venv: only what it lacks

    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url = args.base_url.rstrip("/") + "/v1/completions"
    lm = LocalCompletionsAPI(base_url=url, model=args.model, auth_token=args.api_key, max_length=1024)
    ids = lm.tok_encode("Hello world")
    text = lm.tokenizer.decode(ids)
    print(f"tokenizer_backend={lm.tokenizer_backend} tokenizer={type(lm.tokenizer).__name__}")
    print(f"tok_encode('Hello world')={ids} decode={text!r} eot_token_id={lm.eot_token_id}")
    ok = lm.tokenizer_backend == "remote" and text == "Hello world" and lm.eot_token_id is not None
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
