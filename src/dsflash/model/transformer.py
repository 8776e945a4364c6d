"""DeepSeek-V4.1 backbone: embed -> hc streams -> blocks (Engram, attention, MoE) -> collapse -> head (arch §5)."""

from __future__ import annotations

import torch
from torch import nn

from dsflash.config import ModelConfig
from dsflash.errors import ConfigError, ContextTooLong, UnsupportedInput
from dsflash.model import mhc
from dsflash.model.attention import BatchStep, Step
from dsflash.model.block import Block, Embedding, Head, make_ropes
from dsflash.model.dspark import DSparkBlock, draft
from dsflash.model.engram import Engram, EngramHasher
from dsflash.model.experts import ExpertBackend
from dsflash.model.layers import RMSNorm
from dsflash.model.parallel import TP
from dsflash.model.state import DecodeState


class Transformer(nn.Module):
    """forward(tokens, start_pos, state, experts) -> logits. Parameter names are checkpoint names."""

    def __init__(self, cfg: ModelConfig, tp: TP | None = None, token_map=None, qat: bool = True, dspark: bool = True):
        super().__init__()
        if not cfg.is_v41:
            raise ConfigError(f"running {cfg.model_type} is not supported; this model implements DeepSeek-V4.1")
        tp = tp or TP.single()
        self.cfg, self.tp, self.qat = cfg, tp, qat
        self.ropes = make_ropes(cfg)
        specs = cfg.layers()
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([Block(cfg, s, tp, self.ropes[s.ratio > 0]) for s in specs if not s.is_dspark])
        rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, strict=True))
        for lid, n in rows.items():
            self.layers[lid].engram = Engram(cfg, n)
        self.hasher = None
        if cfg.engram_layer_ids:
            if token_map is None:
                raise ConfigError("this model has Engram layers: it needs the tokenizer's compressed token map")
            self.hasher = EngramHasher(cfg, token_map)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Head(cfg.vocab_size, cfg.hidden_size, tp)
        stages = [s for s in specs if s.is_dspark] if dspark and cfg.has_dspark else []
        self.mtp = nn.ModuleList(
            [DSparkBlock(cfg, s, tp, self.ropes[False], k == 0, k == len(stages) - 1) for k, s in enumerate(stages)]
        )

    def new_state(self, max_len: int, batch: int = 1, device="cpu") -> DecodeState:
        return DecodeState.allocate(self.cfg, max_len, batch, device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        state: DecodeState,
        experts: ExpertBackend,
        trace: dict | None = None,
        taps: bool = False,
        last_only: bool = False,
    ):
        """tokens [b, s] at positions start_pos.. -> fp32 logits [b, s, V] ([b, 1, V] with last_only: generation
        needs only the next token, and the head is the largest matrix) and DSpark taps [b, s, n*d].

        start_pos a device tensor [1]: one token as a static step (attention.Step), nothing read back to the host;
        the caller checks the input and advances state.length (a captured graph replays the same calls)."""
        b, s = tokens.shape
        if isinstance(start_pos, torch.Tensor):
            if s != 1:
                raise UnsupportedInput(f"a static step takes one token, got {s}")
            step = Step(None, 1, state, self.qat, start_pos.view(1), trace=trace)
        else:
            self.check_input(tokens, start_pos, state)
            positions = torch.arange(start_pos, start_pos + s, device=tokens.device)
            step = Step(start_pos, s, state, self.qat, positions, trace=trace)
        ids = self.hasher(tokens, start_pos, state.engram_history) if self.hasher else None
        if trace is not None and ids is not None:
            trace["engram_hash_ids"] = ids
        x = self.embed(tokens).unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        pre_mix, tapped = mhc.identity_pre(x), []
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "engram"):
                x = layer.engram(x, ids[:, :, self.cfg.engram_layer_ids.index(i)])
                if trace is not None:
                    trace.setdefault("engram_states", []).append(x.mean(dim=2))
            if layer.spec.is_dspark_tap:  # DSpark reads the *input* streams of its target layers
                tapped.append(x.mean(dim=2))
            x, pre_mix = layer(x, pre_mix, step, experts)
            if trace is not None:
                trace.setdefault("layer_states", []).append(x.mean(dim=2))
        y = mhc.collapse(x, pre_mix)
        if trace is not None:
            trace["final_hidden"] = y
        logits = self.head(self.norm(y[:, -1:] if last_only else y))
        if not step.static:
            state.length = step.end
        if taps:
            return logits, torch.cat(tapped, dim=-1) if tapped else None
        return logits

    @torch.inference_mode()
    def decode_batch(
        self, tokens: list[int], positions: list[int], states: list[DecodeState], experts: ExpertBackend
    ) -> torch.Tensor:
        """One decode token of each of B sequences (token i at positions[i], continuing states[i]) -> fp32 logits
        [B, V]. Dense products and the routed experts take the B tokens as one chunk (each weight read once for
        all of them, experts expert-major over the union of the tokens' routes); attention runs per sequence."""
        B = len(tokens)
        if not B or len(positions) != B or len(states) != B:
            raise ValueError(f"decode_batch: {B} tokens, {len(positions)} positions, {len(states)} states")
        if len({id(s) for s in states}) != B:
            raise ValueError("decode_batch: a sequence's state appears twice in one step")
        device = states[0].layers[0].window.device
        ids_t = torch.tensor([tokens], dtype=torch.int64, device=device)  # [1, B]
        steps = []
        for i, (p, st) in enumerate(zip(positions, states, strict=True)):
            self.check_input(ids_t[:, i : i + 1], p, st)
            steps.append(Step(p, 1, st, self.qat, torch.arange(p, p + 1, device=device)))
        batch = BatchStep(steps, torch.tensor(positions, dtype=torch.int64, device=device))
        ids = None
        if self.hasher:
            ids = torch.cat(
                [self.hasher(ids_t[:, i : i + 1], s.start_pos, s.state.engram_history) for i, s in enumerate(steps)],
                dim=1,
            )
        x = self.embed(ids_t).unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        pre_mix = mhc.identity_pre(x)
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "engram"):
                x = layer.engram(x, ids[:, :, self.cfg.engram_layer_ids.index(i)])
            x, pre_mix = layer(x, pre_mix, batch, experts)
        logits = self.head(self.norm(mhc.collapse(x, pre_mix)))
        for s in steps:
            s.state.length = s.end
        return logits[0]

    def check_input(self, tokens: torch.Tensor, start_pos: int, state: DecodeState) -> None:
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise UnsupportedInput(f"tokens must be [batch, seq] with seq >= 1, got {tuple(tokens.shape)}")
        if start_pos != 0 and start_pos != state.length:
            raise ValueError(f"start_pos {start_pos} does not continue the sequence (length {state.length})")
        if start_pos + tokens.shape[1] > state.max_len:
            raise ContextTooLong(f"{start_pos + tokens.shape[1]} tokens exceed the context of {state.max_len}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise UnsupportedInput(
                f"token id {hi if hi >= self.cfg.vocab_size else lo} is outside the vocabulary "
                f"0..{self.cfg.vocab_size - 1}"
            )
        image = self.cfg.image_token_id
        if image is not None and bool((tokens == image).any()):
            raise UnsupportedInput("image tokens are not supported: this engine has no vision tower")

    @torch.inference_mode()
    def draft(
        self,
        token: torch.Tensor,
        main_hidden: torch.Tensor,
        start_pos: int,
        state: DecodeState,
        experts: ExpertBackend,
        sample=None,
    ):
        """DSpark after the target consumed start_pos (see dspark.draft); needs the taps of that call."""
        if not len(self.mtp):
            raise ConfigError("this model has no DSpark head (or it was not loaded)")
        kwargs = {} if sample is None else {"sample": sample}
        return draft(self, self.mtp, token, main_hidden, start_pos, state, experts, qat=self.qat, **kwargs)
