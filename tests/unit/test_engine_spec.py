"""The engine's options are defined once (runtime.spec.EngineSpec) and resolved in one function: serve, gates and
`logits --backend engine` given the same flags run the same engine."""

from dataclasses import replace

import pytest

from dsflash.cli import gates, logits, serve
from dsflash.cli.main import build_parser
from dsflash.config import ModelConfig
from dsflash.errors import ConfigError
from dsflash.runtime.spec import EngineSpec, resolve
from tests.model.conftest import ROOT

CONFIG = ModelConfig.from_file(ROOT / "tiny_a" / "model")
FLAGS = ["--tp", "2", "--expert-slots", "7", "--device", "cpu", "--enforce-eager", "--cache-dir", "/tmp/c", "--rebuild"]


def _specs(flags: list[str]) -> dict[str, EngineSpec]:
    parse = build_parser().parse_args
    return {
        "serve": serve.boot_options(parse(["serve", "m", *flags])).engine,
        # the gates compare both sides with the fake-quant points as --qat says (off unless given)
        "gates": gates.gates_spec(parse(["gates", "m", *flags, "--qat"])),
        "logits": logits.logits_spec(
            parse(["logits", "m", "--tokens", "t", "--out", "o", "--backend", "engine", *flags])
        ),
    }


@pytest.mark.parametrize(
    "flags", [FLAGS, [], ["--expert-format", "bfp4_b", "--tp", "4"]], ids=["some", "none", "other"]
)
def test_serve_gates_and_logits_resolve_the_same_spec_from_the_same_flags(flags):
    specs = {name: resolve(s, CONFIG) for name, s in _specs(flags).items()}
    assert specs["serve"] == specs["gates"] == specs["logits"], specs
    assert specs["serve"].resolved


def test_the_flags_reach_the_spec():
    s = resolve(_specs(FLAGS)["serve"], CONFIG, memory=1 << 40)
    assert (s.tp, s.expert_slots, s.device, s.cuda_graph, s.cache_dir, s.rebuild_store) == (
        2,
        7,
        "cpu",
        False,
        "/tmp/c",
        True,
    )
    assert s.expert_format == "bfp8_b"  # auto: the tiny store fits a quarter of a large host's memory
    assert resolve(s, CONFIG, memory=1) == s  # resolving a resolved spec changes nothing
    assert resolve(EngineSpec(), CONFIG, memory=1).expert_format == "bfp4_b"  # nor does it fit a tiny one
    assert resolve(EngineSpec(), CONFIG).threads == 1  # a tiny model's ops are too small to split
    no_qat = gates.gates_spec(build_parser().parse_args(["gates", "m"]))
    assert no_qat == replace(_specs([])["serve"], qat=False)


@pytest.mark.parametrize(
    "field, value, message",
    [("tp", 0, "--tp"), ("expert_slots", 0, "--expert-slots"), ("prefill_chunk", 0, "--prefill-chunk"),
     ("device", "tpu", "device 'tpu'"), ("expert_format", "bfp2", "expert format"),
     ("max_num_seqs", 0, "--max-num-seqs"), ("max_num_batched_tokens", 1, "--max-num-batched-tokens"),
     ("prefill_step_factor", 0.5, "--prefill-step-factor")],
)  # fmt: skip
def test_a_bad_option_is_refused_in_one_line(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineSpec(**{field: value})
