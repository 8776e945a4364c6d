"""Agent frameworks against a running dsflash server: LangChain's with_structured_output (json_schema and
function_calling) and litellm's JSON mode and tool_choice="required". Needs the `agents` extra
(pip install -e '.[agents]'); prints one line per check and exits 1 if any failed.

    dsflash serve --port 18000 &
    python scripts/agents_check.py --base-url http://127.0.0.1:18000/v1

Thinking is turned off (chat_template_kwargs) so that a random model's output is the structured part at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise

NO_THINK = {"chat_template_kwargs": {"thinking": False}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}


def _langchain(base: str, key: str, model: str) -> list[tuple[str, bool, str]]:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)
        role: str = Field(json_schema_extra={"enum": ["dev", "ops"]})

    llm = ChatOpenAI(base_url=base, api_key=key, model=model, max_tokens=200, extra_body=NO_THINK, max_retries=0)
    out = []
    for method in ("json_schema", "function_calling"):
        try:
            got = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
            out.append((f"langchain with_structured_output({method})", isinstance(got, Person), repr(got)))
        except Exception as e:  # a failure is a result to print, not a crash of the check
            out.append((f"langchain with_structured_output({method})", False, f"{type(e).__name__}: {e}"))
    return out


def _litellm(base: str, key: str, model: str) -> list[tuple[str, bool, str]]:
    import litellm

    kw = dict(model=f"openai/{model}", api_base=base, api_key=key, extra_body=NO_THINK, max_tokens=100)
    msgs = [{"role": "user", "content": "Answer in JSON."}]
    out = []
    try:
        r = litellm.completion(messages=msgs, response_format={"type": "json_object"}, seed=2, **kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        # a random model's free keys and strings may outrun max_tokens: then the text must be a prefix of an object
        ok = isinstance(json.loads(text), dict) if finish == "stop" else _object_prefix(text)
        out.append(("litellm response_format=json_object", ok, f"finish={finish} {text[:60]!r}"))
    except Exception as e:
        out.append(("litellm response_format=json_object", False, f"{type(e).__name__}: {e}"))
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER["function"]["parameters"]}}
        # a bounded schema always closes, but a random model may spell its 8 characters as \uXXXX escapes of several
        # tokens each: room for that, and a fixed seed so that a rerun is the same check
        r = litellm.completion(messages=msgs, response_format=fmt, seed=2, **{**kw, "max_tokens": 400})
        got = json.loads(r.choices[0].message.content)
        out.append(("litellm response_format=json_schema", set(got) >= {"city", "unit"},
                    f"finish={r.choices[0].finish_reason} {got!r}"))  # fmt: skip
    except Exception as e:
        out.append(("litellm response_format=json_schema", False, f"{type(e).__name__}: {e}"))
    try:
        r = litellm.completion(messages=msgs, tools=[WEATHER], tool_choice="required", **kw)
        calls = r.choices[0].message.tool_calls or []
        args = json.loads(calls[0].function.arguments) if calls else None
        ok = bool(calls) and calls[0].function.name == "get_weather" and set(args) >= {"city", "unit"}
        out.append(('litellm tool_choice="required"', ok, f"finish={r.choices[0].finish_reason} {args}"))
    except Exception as e:
        out.append(('litellm tool_choice="required"', False, f"{type(e).__name__}: {e}"))
    return out


def _object_prefix(text: str) -> bool:
    """True when `text` can still become a JSON object (llguidance's matcher accepts all its tokens)."""
    from dsflash.text.grammar import GrammarCache
    from dsflash.text.tokenizer import Tokenizer

    tok = Tokenizer.bundled("v41")
    state = GrammarCache(tok).json_schema(None)()
    for t in tok.encode(text):
        state.advance(t)
    return text.startswith("{") and not state.matcher.is_error()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:18000/v1")
    ap.add_argument("--api-key", default=os.environ.get("DSFLASH_API_KEY", "none"))
    ap.add_argument("--model", default="dsflash-tiny-v4.1")
    args = ap.parse_args()
    failed = 0
    for check in (_langchain, _litellm):
        t = time.perf_counter()
        results = check(args.base_url, args.api_key, args.model)
        for name, ok, detail in results:
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
        print(f"     ({check.__name__[1:]}: {time.perf_counter() - t:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
