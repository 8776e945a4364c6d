"""Invariants of the model's parts (v41_spec.md §9), on synthetic inputs."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from dsflash.config import ModelConfig
from dsflash.errors import ConfigError
from dsflash.model import mhc
from dsflash.model.attention import sparse_attention, static_window_rows, window_indices
from dsflash.model.compressor import Indexer
from dsflash.model.engram import EngramHasher, engram_primes, hash_multipliers
from dsflash.model.layers import Rope
from dsflash.model.moe import Gate
from dsflash.model.parallel import TP


@pytest.fixture(scope="module")
def real_cfg(data_dir):
    return ModelConfig.from_file(data_dir / "configs" / "deepseek-v4.1-flash.config.json")


def test_sinkhorn_is_doubly_stochastic():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 64)
    fn, base, scale = torch.randn(24, 256) * 0.1, torch.randn(24), torch.rand(3) + 0.5
    pre, post, comb = mhc.mixes(x, fn, scale, base, 20, 1e-20, 1e-6)
    # the last step normalises columns exactly; rows converge to within a percent in 20 iterations
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 5, 4), atol=2e-2, rtol=0)
    assert (pre > 1e-6).all() and (pre < 1 + 1e-6).all() and (post > 0).all() and (post < 2).all()


def test_identity_comb_and_zero_post_leave_streams_alone():
    x = torch.randn(1, 3, 4, 8)
    out = mhc.expand(torch.randn(1, 3, 8), x, torch.zeros(1, 3, 4), torch.eye(4).expand(1, 3, 4, 4))
    torch.testing.assert_close(out, x)


def test_expand_routes_source_to_destination():
    """comb[j, k] moves stream j into stream k (not the transpose)."""
    x = torch.zeros(1, 1, 4, 2)
    x[0, 0, 1] = 1.0
    comb = torch.zeros(1, 1, 4, 4)
    comb[0, 0, 1, 3] = 1.0
    out = mhc.expand(torch.zeros(1, 1, 2), x, torch.zeros(1, 1, 4), comb)
    assert out[0, 0, 3].sum() == 2 and out[0, 0, 1].sum() == 0


def test_rope_inverse_and_interleaving():
    rope = Rope(16, 160000.0, original_len=64, factor=16)
    x = torch.randn(1, 5, 3, 48)
    cis = rope.cis(torch.arange(100, 105))
    y = rope.rotate(x, cis)
    torch.testing.assert_close(y[..., :32], x[..., :32])  # only the last rd channels rotate
    torch.testing.assert_close(rope.rotate(y, cis, inverse=True), x, atol=1e-5, rtol=0)
    # interleaved: channels (2i, 2i+1) form one complex number whose modulus is preserved
    pairs = lambda t: t[..., 32:].unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(y), pairs(x))


def test_yarn_only_changes_low_frequencies():
    plain, yarn = Rope(64, 160000.0), Rope(64, 160000.0, original_len=65536, factor=16)
    assert torch.equal(plain.freqs[:4], yarn.freqs[:4])  # fast dims keep their frequency
    torch.testing.assert_close(yarn.freqs[-1], plain.freqs[-1] / 16)  # slow dims are divided by factor
    assert Rope(64, 10000.0, original_len=0).freqs.equal(Rope(64, 10000.0).freqs)


def test_sparse_attention_sink_and_selection():
    torch.manual_seed(1)
    q, kv = torch.randn(1, 2, 3, 16), torch.randn(1, 6, 16)
    idx = torch.tensor([[[0, 1, 2, 3, 4, 5], [2, 4, -1, -1, -1, -1]]])
    no_sink = sparse_attention(q, kv, torch.full((3,), -torch.inf), idx, 0.25)
    scores = torch.einsum("bshd,bnd->bshn", q, kv) * 0.25
    want0 = torch.einsum("bhn,bnd->bhd", scores[:, 0].softmax(-1), kv)
    torch.testing.assert_close(no_sink[:, 0], want0)
    sub = scores[:, 1, :, [2, 4]].softmax(-1)
    torch.testing.assert_close(no_sink[:, 1], torch.einsum("bhn,bnd->bhd", sub, kv[:, [2, 4]]))
    # a finite sink only adds mass to the denominator: same direction, smaller weight
    sink = torch.tensor([0.0, 1.0, 2.0])
    with_sink = sparse_attention(q, kv, sink, idx, 0.25)
    z = scores[:, 0].exp().sum(-1)
    torch.testing.assert_close(with_sink[:, 0], no_sink[:, 0] * (z / (z + sink.exp())).unsqueeze(-1))


def test_sparse_attention_is_the_same_over_few_rows_and_many():
    # few rows (a short context, a verify's queries): every query against every row; many (a long context's
    # compressed cache): the selected rows gathered per query. The same selection gives the same output.
    torch.manual_seed(2)
    q, kv, sink = torch.randn(2, 3, 4, 16), torch.randn(2, 40, 16), torch.randn(4)
    idx = torch.stack([torch.randperm(10)[:8] for _ in range(6)]).view(2, 3, 8)
    idx[0, 1, 5:] = -1
    idx[1, 2, :] = -1  # a query that selects nothing gets zeros
    many = sparse_attention(q, kv, sink, idx, 0.25)
    few = sparse_attention(q, kv[:, :10], sink, idx, 0.25)  # 10 rows for 8 selected
    torch.testing.assert_close(few, many, rtol=1e-6, atol=1e-6)
    assert not many[1, 2].any() and many[0, 1].abs().sum() > 0


def test_window_indices_cover_the_last_w_positions():
    idx = window_indices(start_pos=10, length=3, n_prev=4, window=4, device="cpu")
    # rows: [pos 6, 7, 8, 9 (previous) ; 10, 11, 12 (chunk)]; query at pos 10 sees 7..10 = rows 1..4
    assert idx.tolist() == [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6]]
    # early in a sequence: as many columns as there are rows, not the window's
    assert window_indices(0, 2, 0, 4, "cpu").tolist() == [[-1, 0], [0, 1]]
    assert window_indices(3, 2, 3, 8, "cpu").tolist() == [[-1, 0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_static_window_rows_see_what_the_ring_holds():
    ring = torch.zeros(1, 4, 2)
    for p in range(6):  # positions 0..5 through a ring of 4
        rows, idx = static_window_rows(ring, torch.full((1, 1, 2), float(p)), torch.tensor([p]))
    assert rows[0, :, 0].tolist() == [4.0, 5.0, 2.0, 3.0] and idx.tolist() == [[[0, 1, 2, 3]]]
    ring.zero_()
    rows, idx = static_window_rows(ring, torch.ones(1, 1, 2), torch.tensor([1]))
    assert idx.tolist() == [[[0, 1, -1, -1]]]  # slots 2 and 3 never written: positions -2 and -1


def test_static_select_takes_what_select_takes(real_cfg):
    """Entries the candidate blocks masked (-inf) that a query can see still fill the top-k before any entry it
    cannot see, as the dynamic select (whose k is what is visible) takes them. (Which of two masked entries fills
    the last place when more are visible than k is a tie in both.)"""
    spec = next(s for s in real_cfg.layers() if s.is_index_source)
    ix = Indexer(dataclasses.replace(real_cfg, index_topk=4), spec, TP.single())
    s = torch.tensor([[[5.0, -torch.inf, 1.0, -torch.inf, 7.0, 9.0, 3.0, 2.0]]])
    for n_visible in (3, 4, 6):
        visible = torch.tensor([n_visible])
        masked = s.masked_fill(torch.arange(8) >= n_visible, -torch.inf)
        want = ix.select(masked[..., :n_visible], visible, n_visible * spec.ratio, offset=10)
        got = ix.select_static(masked, visible, offset=10)
        assert sorted(x for x in got[0, 0].tolist() if x >= 0) == sorted(x for x in want[0, 0].tolist() if x >= 0)


def test_gate_bias_selects_but_does_not_weight(real_cfg):
    cfg = dataclasses.replace(real_cfg, n_routed_experts=8, num_experts_per_tok=2, hidden_size=16)
    gate = Gate(cfg, dataclasses.replace(cfg.layers()[3], n_experts=8, n_active=2))
    torch.manual_seed(0)
    gate.weight.data = torch.randn(8, 16)
    gate.bias.data = torch.zeros(8)
    x = torch.randn(5, 16)
    w, ids = gate(x)
    torch.testing.assert_close(w.sum(-1), torch.full((5,), cfg.routed_scaling_factor))
    gate.bias.data[7] = 100.0  # forces expert 7 into every selection ...
    w2, ids2 = gate(x)
    assert (ids2 == 7).any(-1).all()
    scores = torch.nn.functional.softplus(x @ gate.weight.T).sqrt()
    picked = scores.gather(1, ids2)  # ... but its weight still comes from the unbiased score
    torch.testing.assert_close(w2, picked / picked.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_engram_primes_and_multipliers_of_the_release(real_cfg):
    primes = engram_primes(real_cfg)
    assert [sum(map(sum, layer)) for layer in primes] == list(real_cfg.engram_num_embeddings)
    assert primes[0][0][0] == 16000057
    assert hash_multipliers(1, 4, 99092).tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert hash_multipliers(14, 4, 99092)[0] == 67716810739261


def test_engram_rows_mismatch_is_a_config_error(data_dir):
    raw = json.loads((data_dir / "dsv41_tiny" / "tiny_a" / "model" / "config.json").read_text())
    raw["text_config"]["engram_num_embeddings"][0] += 1
    cfg = ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="primes sum"):
        EngramHasher(cfg, list(range(cfg.vocab_size)))


def test_engram_ids_depend_only_on_the_last_n_tokens(data_dir):
    cfg = ModelConfig.from_file(data_dir / "dsv41_tiny" / "tiny_a" / "model")
    token_map = [i % cfg.engram_compressed_vocab_size for i in range(cfg.vocab_size)]
    hasher, n = EngramHasher(cfg, token_map), cfg.engram_max_ngram_size
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 700, 40), rng.integers(3, 700, 40)
    b[-n:] = a[-n:]
    ids = [hasher(torch.from_numpy(t[None]), 0, torch.zeros(1, 64, dtype=torch.int64))[0, -1] for t in (a, b)]
    assert torch.equal(ids[0], ids[1])
    # and the first positions see padding instead of history
    c = a.copy()
    c[0] = 5 if a[0] != 5 else 6
    first = [hasher(torch.from_numpy(t[None, :2]), 0, torch.zeros(1, 64, dtype=torch.int64))[0, 1] for t in (a, c)]
    assert not torch.equal(first[0], first[1])
    assert (ids[0] < torch.tensor(cfg.engram_num_embeddings).view(-1, 1)).all()
