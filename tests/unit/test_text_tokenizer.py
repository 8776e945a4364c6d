"""text/tokenizer.py: loading (checkpoint file, bundled V4 file, V4.1 patch), special ids, encode/decode, bytes."""

import json
import shutil
from pathlib import Path

import pytest

from dsflash.errors import CheckpointError, ConfigError, ModelSourceError
from dsflash.text.tokenizer import Tokenizer, normalize_release

DATA = Path(__file__).resolve().parents[1] / "data" / "text"
TINY = DATA / "tiny_tokenizer"


@pytest.fixture(scope="module")
def v4():
    return Tokenizer.bundled("v4")


@pytest.fixture(scope="module")
def v41():
    return Tokenizer.bundled("v41")


def test_bundled_v4_ids_match_the_spec(v4):
    assert v4.vocab_size == 129280
    assert (v4.bos_id, v4.eos_id) == (0, 1)
    assert (v4.think_open_id, v4.think_close_id) == (128821, 128822)
    assert v4.token_to_id("<｜User｜>") == 128803 and v4.token_to_id("<｜Assistant｜>") == 128804
    assert v4.token_to_id("｜DSML｜") == 128825
    assert v4.token_to_id("<｜image2｜>") == 129264
    assert v4.token_to_id("<｜System｜>") is None
    assert v4.eos_ids == {1}


def test_special_ids_hold_control_tokens_but_not_markup(v4):
    assert {0, 1, 2, 128799} <= v4.special_ids
    assert v4.markup_ids == {128821, 128822, 128825, 128840, 128841}
    assert not v4.markup_ids & v4.special_ids
    assert v4.is_special(1) and not v4.is_special(128822)


def test_v41_adds_system_token_past_the_end_and_renames_the_image_slot(v41, v4):
    assert v41.token_to_id("<｜System｜>") == v4.vocab_size == 129280
    assert v41.vocab_size == 129281
    assert v41.token_to_id("<｜deepseek_image｜>") == 129264
    assert v41.token_to_id("<｜image2｜>") is None
    assert 129280 in v41.special_ids
    assert v41.encode("<｜System｜>hi<｜deepseek_image｜>")[0] == 129280
    assert 129264 in v41.encode("x<｜deepseek_image｜>y")


def test_encode_matches_special_strings_and_adds_no_bos(v4):
    ids = v4.encode("<｜begin▁of▁sentence｜>sys<｜User｜>Hi<｜Assistant｜><think>r</think>ok<｜end▁of▁sentence｜>")
    assert ids[0] == 0 and ids[-1] == 1
    assert ids.count(0) == 1  # the BOS in the text only
    assert [i for i in ids if i >= 128000] == [128803, 128804, 128821, 128822]
    assert v4.encode("plain")[0] != v4.bos_id


def test_decode_round_trips_and_skips_specials_on_request(v4):
    text = "<｜begin▁of▁sentence｜>你好 🙂 world\n\n<｜DSML｜ calls></think><｜end▁of▁sentence｜>"
    ids = v4.encode(text)
    assert v4.decode(ids) == text
    assert v4.decode(ids, skip_special_tokens=True) == "你好 🙂 world\n\n<｜DSML｜ calls></think>"


def test_golden_prompt_tokenizes_losslessly(v4):
    prompt = (DATA / "dsv4" / "case_3.txt").read_text(encoding="utf-8")
    assert v4.decode(v4.encode(prompt)) == prompt


def test_token_bytes_concatenate_to_the_utf8_text(v4):
    text = "naïve 数学🙂 ∑ x²\n\tend 𝔘𝔫𝔦"
    ids = v4.encode(text)
    assert b"".join(v4.token_bytes(i) for i in ids) == text.encode()
    partial = [i for i in ids if not _is_utf8(v4.token_bytes(i))]
    assert partial, "the emoji should split into byte pieces that are not UTF-8 on their own"
    assert v4.token_bytes(1) == "<｜end▁of▁sentence｜>".encode()


def test_token_bytes_agree_with_decode_for_every_added_token(v41):
    for i in v41.added_ids:
        assert v41.token_bytes(i).decode() == v41.decode([i])


def test_id_to_token_is_the_byte_level_form(v4):
    ids = v4.encode(" hello")
    assert v4.id_to_token(ids[0]).startswith("Ġ")
    assert v4.id_to_token(10**7) is None


def test_from_dir_prefers_the_checkpoint_tokenizer():
    tok = Tokenizer.from_dir(TINY, "deepseek_v41")
    assert tok.vocab_size == 1024
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (tok.think_open_id, tok.think_close_id) == (1018, 1019)
    assert tok.token_to_id("<｜System｜>") is None  # the checkpoint's file is the authority: nothing is added


def test_from_dir_without_tokenizer_falls_back_to_the_bundled_file(tmp_path):
    tok = Tokenizer.from_dir(tmp_path, "deepseek_v41")
    assert tok.token_to_id("<｜System｜>") == 129280
    assert Tokenizer.from_dir(tmp_path, "v4").vocab_size == 129280


def test_from_dir_reads_bos_eos_from_tokenizer_config(tmp_path):
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<｜User｜>", "eos_token": "</think>"}))
    tok = Tokenizer.from_dir(tmp_path, "v41")
    assert (tok.bos_id, tok.eos_id) == (1016, 1019)


def test_missing_directory_is_a_model_source_error(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope", "v41")


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path, "v41")


def test_corrupt_tokenizer_config_is_a_checkpoint_error(tmp_path):
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path, "v41")


@pytest.mark.parametrize("name,want", [("v4", "v4"), ("deepseek_v4", "v4"), ("V41", "v41"), ("deepseek_v41", "v41")])
def test_release_names(name, want):
    assert normalize_release(name) == want


def test_unknown_release_is_a_config_error():
    with pytest.raises(ConfigError, match="v42"):
        normalize_release("v42")


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False
