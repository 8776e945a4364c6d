"""The trained demo model (dsflash-demo-v4.1) through a real server and the real openai client, on held-out prompts:
it greets and says who it is, thinking answers carry reasoning and content and stop, tool calls it writes come back
as OpenAI `tool_calls`. Nothing here trains; the gates on it are measured in docs/performance.md.

Repeating and tool arguments are not asserted: the committed weights (recipe v15: 0.85 / 0.63 on the training
script's held-out set) do not meet issue 23's accuracy there yet (docs/performance.md, "demo model"); its sums (0.97)
do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from dsflash.checkpoint.index import Checkpoint
from dsflash.service.catalog import DEMO, choose
from dsflash.store.build import build_store
from dsflash.store.layout import store_dir
from dsflash.train.data import FAMILIES, Generator, check
from tests.server.conftest import start_server

PER_FAMILY = 2  # the training script measures the full held-out set; this is a sample
SEED = 2024  # not the training script's evaluation seed: other held-out prompts


def older_store(cache: Path, tmp: Path) -> None:
    """The packaged model's store as an earlier release leaves it in the cache: built from other files of the model
    (here its config.json with one more newline), where the packaged directory's store goes."""
    older = tmp / "older-demo"
    shutil.copytree(choose(DEMO).source, older)
    (older / "config.json").write_text((older / "config.json").read_text() + "\n")
    build_store(Checkpoint.open(older), cache, tp=1, fmt="bfp8_b", progress=False)
    where = store_dir(choose(DEMO).source, cache)
    where.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(store_dir(older, cache), where)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("demo")
    older_store(model_cache, tmp)
    srv = start_server(tmp, model_cache, "--max-model-len", "1024", model=DEMO)  # the session's kernels
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def answers(demo):
    client = openai.OpenAI(base_url=demo.base + "/v1", api_key="none", max_retries=0, timeout=60)
    gen = Generator(SEED, held_out=True)
    out = []
    for family in FAMILIES:
        for i in range(PER_FAMILY):
            sample = gen.sample(family, thinking=i % 2 == 0)
            r = client.chat.completions.create(
                model=DEMO,
                messages=sample.messages,
                tools=sample.tools or openai.NOT_GIVEN,
                max_tokens=128,  # a difference worked out twice in thinking mode takes ~100
                temperature=0,
                extra_body={"chat_template_kwargs": {"thinking": sample.thinking}},
            )
            out.append((sample, r.choices[0]))
    return out


def _right(sample, choice) -> bool:
    msg = choice.message
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    return check(sample, msg.content or "", getattr(msg, "reasoning_content", None) or "", calls)


def test_the_packaged_model_boots_without_generating_and_replaces_an_older_releases_store(demo):
    out = demo.wait_output("Ready in")
    assert DEMO in out and "generated" not in out
    assert "rebuilt (built for" in out  # not refused: its weights change with a release, and the store is small
    assert Path(choose(DEMO).source).is_dir()


def test_gates_take_the_packaged_models_name_and_replace_its_older_store(tmp_path, capsys):
    from dsflash.cli.main import main

    cache = tmp_path / "cache"
    older_store(cache, tmp_path)
    code = main(["gates", DEMO, "--tokens", "24", "--cache-dir", str(cache)])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["pass"] and r["config"]["expert_format"] == "bfp8_b", r


def test_it_greets_and_says_it_is_the_demo_model(answers):
    said = [_right(s, c) for s, c in answers if s.family in ("greeting", "identity")]
    assert sum(said) >= 0.9 * len(said), [c.message.content for s, c in answers if s.family == "greeting"]


def test_its_sums_come_out_right(answers):
    sums = [(s, c) for s, c in answers if s.family == "arithmetic"]
    assert sums and all(_right(s, c) for s, c in sums), [(s.messages[-1], c.message.content) for s, c in sums]


def test_tool_calls_come_back_as_openai_tool_calls(answers):
    calls = [(s, c) for s, c in answers if s.family == "tool_call" and c.message.tool_calls]
    assert calls  # the DSML block it writes is parsed, whatever the argument
    for _, choice in calls:
        assert choice.finish_reason == "tool_calls"
        assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)


def test_thinking_answers_reason_then_answer_then_stop(answers):
    thinking = [(s, c) for s, c in answers if s.thinking and s.family != "tool_call"]
    good = [
        c.finish_reason == "stop" and getattr(c.message, "reasoning_content", None) and c.message.content
        for _, c in thinking
    ]
    assert sum(map(bool, good)) >= 0.9 * len(thinking), [c.message for _, c in thinking]
