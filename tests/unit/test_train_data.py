"""The demo model's training data and tokenizer: the real V4.1 encoding, held-out values apart, every added token."""

from __future__ import annotations

import json
import re
from collections import Counter

import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.writer import write_checkpoint
from dsflash.config import ModelConfig
from dsflash.service.catalog import BUNDLES, DEMO, packaged_dir
from dsflash.text.chat import parse_completion
from dsflash.text.tokenizer import V41, Tokenizer
from dsflash.train import data, vocab
from dsflash.train.fit import target_mask
from dsflash.train.model import demo_config, stored


def test_every_family_renders_in_the_v41_encoding_and_its_reference_answer_checks():
    gen = data.Generator(5)
    for family in data.FAMILIES:
        for thinking in (True, False):
            s = gen.sample(family, thinking)
            answer = s.full()[len(s.prompt()) :]
            assert data.check_text(s, answer), (family, answer)
            parsed = parse_completion(answer, thinking)
            assert bool(parsed.reasoning) == thinking and bool(parsed.tool_calls) == (family == "tool_call")


def test_a_wrong_answer_does_not_check():
    s = data.Generator(6).sample("tool_call", True)
    wrong = s.full()[len(s.prompt()) :].replace(s.expect["name"], "other_tool")
    assert not data.check_text(s, wrong)
    a = data.Generator(6).sample("arithmetic", False)
    assert not data.check_text(a, "I do not know.<｜end▁of▁sentence｜>")


def test_an_arithmetic_answer_is_right_only_when_its_last_number_is_the_result():
    a = data.Generator(6).sample("arithmetic", False)
    result = a.expect["content"]
    assert data.check(a, f"1 + 2 = {result}.", "", [])
    assert not data.check(a, f"1 + 2 = {result}1.", "", [])  # holds the result's digits, is not it
    assert not data.check(a, f"{result} is not {int(result) + 1}.", "", [])


def test_held_out_values_never_appear_in_training_pools():
    train, held = data.Generator(1), data.Generator(1, held_out=True)
    assert held.cities and held.words and held.tool_pairs
    assert not set(train.cities) & set(held.cities) and not set(train.words) & set(held.words)
    assert not set(train.tool_pairs) & set(held.tool_pairs)
    assert {train.operands()[:3] for _ in range(300)}.isdisjoint({held.operands()[:3] for _ in range(100)})


def test_invented_words_are_no_pool_word_and_half_are_training_words_spliced():
    gen = data.Generator(3)
    made = [gen._pseudo() for _ in range(400)]
    pool = {w.lower() for w in data._split(data._WORDS, False) + data._split(data._WORDS, True)}
    assert not set(made) & pool
    # a splice starts as one training word and ends as another; random letters rarely do both
    starts, ends = {a[:2] for a in gen.words}, {b[-2:] for b in gen.words}
    spliced = [w for w in made if w[:2] in starts and w[-2:] in ends]
    assert 0.4 * len(made) < len(spliced) < 0.7 * len(made)
    held = data.Generator(3, held_out=True)
    assert {held.word() for _ in range(100)} <= set(held.words)  # held-out values stay the held-out pool's words


def test_half_the_invented_words_are_strung_from_the_tokenizers_letter_tokens_once_it_has_them():
    gen = data.Generator(3)
    gen.pieces = ["zq", "xv", "kj"]  # strings neither random letters nor splices make often
    made = [gen._pseudo() for _ in range(400)]
    strung = [w for w in made if re.fullmatch("(zq|xv|kj){2,3}", w)]
    assert 0.4 * len(made) < len(strung) < 0.6 * len(made)
    tok = Tokenizer.from_dir(packaged_dir(BUNDLES[DEMO].packaged))
    pieces = vocab.word_pieces(tok)
    assert {"a", "z", "des", "pas"} <= set(pieces) and all(p.isalpha() and p.islower() for p in pieces)
    assert all(tok.encode(p) == [tok.token_to_id(p)] for p in pieces if tok.token_to_id(p) is not None)


def test_sum_facts_are_drawn_alike_from_the_distinct_steps_of_their_sides_sums():
    train, held = data.Generator(5), data.Generator(5, held_out=True)
    assert ("6 + 8", "14") in train.sum_steps and all(eval(lhs) == int(rhs) for lhs, rhs in train.sum_steps)  # noqa: S307
    drawn = Counter(train.facts(40 * len(train.sum_steps)))
    assert len(drawn) == len(train.sum_steps) and max(drawn.values()) < 2.5 * min(drawn.values())
    # each side's steps are those of its own operand pairs' sums
    for gen in (train, held):
        for _ in range(100):
            a, op, b, _ = gen.operands()
            steps = data.columns(a, op, b).split(": ", 1)[1].split(", ")[:-1]
            assert {tuple(f.split(" = ")) for f in steps} <= set(gen.sum_steps)
    assert held.sum_steps != train.sum_steps


def test_the_loss_mask_covers_exactly_the_assistant_turns():
    tok = Tokenizer.from_dir(packaged_dir(BUNDLES[DEMO].packaged))
    msgs, tools, thinking = data.Generator(8).conversation()
    ids = tok.encode(data.render_conversation(msgs, tools, thinking))
    mask = target_mask(ids, tok)
    spans = tok.decode([t for t, m in zip(ids, mask) if m])
    assert spans.count("<｜end▁of▁sentence｜>") == sum(m["role"] == "assistant" for m in msgs)
    assert "<｜User｜>" not in spans and "<｜Assistant｜>" not in spans


def test_the_packaged_tokenizer_carries_every_v41_added_token():
    real = Tokenizer.bundled(V41).backend.get_added_tokens_decoder()
    tok = Tokenizer.from_dir(packaged_dir(BUNDLES[DEMO].packaged))
    ours = {t.content: t.special for t in tok.backend.get_added_tokens_decoder().values()}
    assert ours == {t.content: t.special for t in real.values()}
    assert (tok.bos_id, tok.eos_id, tok.token_to_id("<｜▁pad▁｜>")) == (0, 1, 2)
    assert tok.vocab_size == ModelConfig.from_file(packaged_dir(BUNDLES[DEMO].packaged) / "config.json").vocab_size


def test_given_values_are_written_as_the_training_forward_saw_them(tmp_path):
    cfg = ModelConfig.from_dict(demo_config(4096, 3000, 5))
    w = torch.randn(cfg.q_lora_rank, cfg.hidden_size)
    name = "layers.0.attn.wq_a.weight"
    write_checkpoint(cfg, tmp_path, values={name: w}, tokenizer_dir=None)
    got = Checkpoint.open(tmp_path).tensor(name)
    assert torch.equal(got, stored(w, "fp8", cfg.fp8_block))


def test_trainings_fused_attention_is_the_serving_kernels_math_values_and_gradients():
    from dsflash.model.attention import sparse_attention
    from dsflash.train.model import dense_attention

    g = torch.Generator().manual_seed(0)
    b, s, h, d, n, k = 2, 9, 4, 16, 21, 6
    # each query picks distinct rows (as the window and the indexer do), some slots empty (-1)
    idx = torch.stack([torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(s)]) for _ in range(b)])
    drop = torch.rand(b, s, k, generator=g) < 0.3
    drop[..., 0] = False  # every query attends somewhere (the serving kernel's gradient is NaN where none is)
    idx = torch.where(drop, -1, idx).int()
    grads = []
    for f in (sparse_attention, dense_attention):
        q = torch.randn(b, s, h, d, generator=g.manual_seed(1)).requires_grad_()
        kv = torch.randn(b, n, d, generator=g.manual_seed(2)).requires_grad_()
        sink = torch.randn(h, generator=g.manual_seed(3)).requires_grad_()
        out = f(q, kv, sink, idx, 0.25)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach(), q.grad, kv.grad, sink.grad])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a query that selects nothing sees only the sink: zero output, and (unlike the serving kernel) finite gradients
    q = torch.randn(1, 1, h, d, requires_grad=True)
    sink = torch.zeros(h, requires_grad=True)
    out = dense_attention(q, torch.randn(1, n, d), sink, torch.full((1, 1, k), -1, dtype=torch.int32), 0.25)
    out.sum().backward()
    assert out.abs().max() == 0 and torch.isfinite(q.grad).all() and torch.isfinite(sink.grad).all()


def test_arithmetic_columns_end_at_the_result_and_each_step_holds():
    import re

    for op in "+-":
        for a in range(21):
            for b in range(21 if op == "+" else a + 1):
                text = data.columns(a, op, b)
                head, steps = text.split(": ", 1)
                assert head == f"{a} {op} {b}"
                *facts, result = steps.split(", ")
                assert int(result) == (a + b if op == "+" else a - b)
                for fact in facts:  # every step is a true small equation
                    lhs, rhs = fact.split(" = ")
                    assert eval(lhs) == int(rhs) and all(len(n) <= 2 for n in re.findall(r"\d+", lhs))  # noqa: S307
    # a difference always borrows, and carries the units' tens back: no answer decides whether to borrow
    assert data.columns(17, "-", 7) == "17 - 7: 10 - 7 = 3, 7 + 3 = 10, 1 - 0 - 1 + 1 = 1, 10"
    assert data.columns(14, "-", 5) == "14 - 5: 10 - 5 = 5, 4 + 5 = 9, 1 - 0 - 1 + 0 = 0, 9"
    gen = data.Generator(3)
    for thinking in (True, False):
        s = gen.sample("arithmetic", thinking)
        assert data.check_text(s, s.full()[len(s.prompt()) :])


def test_trailing_spaces_give_a_value_the_same_pieces_wherever_it_stands():
    gen = data.Generator(2)
    texts = [data.render_conversation(*gen.conversation()) for _ in range(200)]
    tok = vocab.train_tokenizer(texts, 400, spaces="trailing")
    value = tok.encode("lantern river").ids
    # a question's value, a DSML argument, a quote and an answer's content: the value's pieces in each
    for text in ("Repeat after me: lantern river", ">lantern river<", '"lantern river"', "</think>lantern river"):
        ids = tok.encode(text).ids
        assert any(ids[i : i + len(value)] == value for i in range(len(ids))), text
        assert tok.decode(ids) == text
    # GPT-2's split opens a word with the space before it: a frequent word's pieces after a space are not its
    # pieces after `>`
    lead = vocab.train_tokenizer(texts, 400)
    assert lead.encode("the weather").ids[1:] != lead.encode(">weather").ids[1:]
    assert tok.encode("the weather").ids[1:] == tok.encode(">weather").ids[1:]


def test_the_packaged_demo_was_trained_by_the_tracked_recipe():
    # the stamp's hash covers the recipe and every source of dsflash.train: an edit there without a new training run
    # would ship weights that the tracked script no longer makes
    from dsflash.train import fit

    stamp = json.loads((packaged_dir(BUNDLES[DEMO].packaged) / fit.STAMP).read_text())
    assert stamp["recipe"] == fit.recipe_hash() and stamp["version"] == fit.RECIPE["version"]


def test_facts_rows_score_each_result_and_are_the_ids_of_their_text():
    from dsflash.train.fit import facts_batch

    tok = Tokenizer.from_dir(packaged_dir(BUNDLES[DEMO].packaged))
    tokens, mask = facts_batch(data.Generator(4), tok, 512, tok.token_to_id(vocab.PAD))
    assert tokens.shape[0] > 1  # several rows packed
    for row, scored in zip(tokens.tolist(), mask.tolist()):
        end = row.index(tok.eos_id)
        text = tok.decode(row[1:end])
        assert row[0] == tok.bos_id and tok.encode(text) == row[1:end]  # pieces encoded one by one: the whole's ids
        facts = [f.split(" = ") for f in text.split(", ")]
        assert len(facts) >= 6 and all(eval(lhs) == int(rhs) for lhs, rhs in facts)  # noqa: S307
        results = tok.decode([t for t, k in zip(row, scored) if k])
        assert results == "".join(rhs for _, rhs in facts) + tok.decode([tok.eos_id]) and not any(scored[end + 1 :])
