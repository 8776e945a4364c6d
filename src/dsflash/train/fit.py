"""Train the demo model and write it in the official format: `python -m dsflash.train OUT_DIR`.

Reproducible: every random draw comes from RECIPE's seed, torch runs on RECIPE's two threads, and the recipe's hash is
stamped into the model directory (STAMP) with the training time and the held-out accuracy per family.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.load import load_experts, load_into
from dsflash.checkpoint.writer import write_checkpoint
from dsflash.config import ModelConfig
from dsflash.model.experts import ResidentExperts
from dsflash.model.transformer import Transformer
from dsflash.text.chat import ASSISTANT
from dsflash.text.token_map import compressed_token_map
from dsflash.text.tokenizer import EOS, THINK_CLOSE, THINK_OPEN, Tokenizer
from dsflash.train import vocab
from dsflash.train.data import FAMILIES, TRAIN_WEIGHTS, Generator, check_text, render_conversation
from dsflash.train.model import Drafts, Trainable, demo_config

STAMP = "dsflash-demo.json"
RECIPE = {
    "version": 15,
    "seed": 23,
    # a word keeps the space after it (vocab.train_tokenizer): a value's words are the same pieces in a question,
    # an answer and a DSML argument
    "bpe_vocab": 640,
    "spaces": "trailing",
    "family_weights": dict(TRAIN_WEIGHTS),
    # share of training tool questions that need a never-seen tool where the set offers one (0: any tool alike)
    "generic_calls": 0.6,
    "tokenizer_conversations": 4000,
    # the first copy_steps train on copy rows only (induction forms there in ~300 steps with the 448-id leading-space
    # tokenizer, later with this one's; within chat data, whose copied values are a few tokens a conversation, it did
    # not form in 2,000), the rest mix copy_tokens of them into every batch so that it stays
    "copy_steps": 400,
    "copy_tokens": 512,
    # share of a copy row's items that are numbers
    "copy_numbers": 0.25,
    # arithmetic drill conversations (worked sums, no system prompt or tools) beside every chat batch after the
    # copy phase (v8's 256 left the single-digit tables half learnt)
    "drill_tokens": 256,
    # rows of the worked sums' one-digit steps (`4 - 1 = 3, 9 + 9 = 18, ...`, loss on each result) beside every chat
    # batch after the copy phase: v10's wrong sums were wrong one-digit facts (`4 - 1 = 2`, `9 + 9 = 16`)
    "facts_tokens": 384,
    "steps": 1800,
    # the last dspark_steps also train the DSpark head, at up to dspark_anchors draft blocks of each chat batch
    # (its loss reaches only the stages: the backbone trains exactly as without it)
    "dspark_steps": 400,
    "dspark_anchors": 256,
    # then head_steps train the DSpark stages alone on the frozen backbone, each draft labelled with the backbone's
    # own greedy token there (what a verify accepts), at head_lr (cosine, head_warmup): v6's 400 joint steps left
    # the head far from done (teacher-forced accepted per verify 1.57; 900 more head-only steps: 2.25; 600 here to
    # keep the whole run within the hour; 500 since v13: v12's run took 3,658 s)
    "head_steps": 500,
    "head_lr": 3e-3,
    "head_warmup": 20,
    "batch_tokens": 1536,
    "lr": 3e-3,
    "warmup": 30,
    "weight_decay": 0.01,
    "clip": 1.0,
    "threads": 2,
    # 60 a family: at 30 one prompt is 3.3 points and a family near 0.7 has a standard error of 8 points
    "eval_per_family": 60,
    "eval_seed": 1023,
}


def recipe_hash(recipe: dict = RECIPE) -> str:
    """Hash of the recipe, the config template and the training package's sources (the data generator, the
    tokenizer's training, the loop): what the weights depend on."""
    blob = json.dumps([recipe, demo_config(0, 0, 0)], sort_keys=True).encode()
    for src in sorted(Path(__file__).parent.glob("*.py")):
        blob += src.read_bytes()
    return hashlib.sha256(blob).hexdigest()[:16]


def target_mask(ids: list[int], tok: Tokenizer) -> list[bool]:
    """True at the tokens an assistant writes: after `<｜Assistant｜>` and its think marker, through EOS."""
    assistant, think = tok.token_to_id(ASSISTANT), {tok.token_to_id(THINK_OPEN), tok.token_to_id(THINK_CLOSE)}
    eos = tok.token_to_id(EOS)
    mask, inside = [], False
    for i, t in enumerate(ids):
        mask.append(inside)
        if t == eos:
            inside = False
        elif t in think and i > 0 and ids[i - 1] == assistant:
            inside = True
    return mask


def tensors(rows: list[tuple[list[int], list[bool]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (ids, loss mask) padded to the longest: (tokens [b, s], loss mask [b, s])."""
    s = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), s), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), s, dtype=torch.bool)
    for i, (ids, m) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = torch.tensor(m)
    return tokens, mask


class Batches:
    """Conversations drawn `pool` at a time, sorted by length and packed into batches of at most `budget` padded
    tokens: rows of like length share a batch, so little of a step (attention least of all) is spent on padding."""

    def __init__(self, gen: Generator, tok: Tokenizer, budget: int, pad: int, pool: int = 64):
        self.gen, self.tok, self.budget, self.pad, self.pool = gen, tok, budget, pad, pool
        self.ready: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.ready:
            self._fill()
        return self.ready.pop()

    def _fill(self) -> None:
        convs = [self.tok.encode(render_conversation(*self.gen.conversation())) for _ in range(self.pool)]
        groups: list[list[list[int]]] = [[]]
        for ids in sorted(convs, key=len):
            if groups[-1] and len(ids) * (len(groups[-1]) + 1) > self.budget:
                groups.append([])
            groups[-1].append(ids)
        self.gen.rng.shuffle(groups)
        self.ready = [tensors([(ids, target_mask(ids, self.tok)) for ids in g], self.pad) for g in groups]


def packed(draw, budget: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (ids, loss mask) from draw() until `budget` padded tokens."""
    rows = []
    while True:
        row = draw()
        longest = max([len(row[0]), *(len(r) for r, _ in rows)])
        if rows and longest * (len(rows) + 1) > budget:
            break
        rows.append(row)
    return tensors(rows, pad)


def copy_batch(
    gen: Generator, tok: Tokenizer, budget: int, pad: int, numbers: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy rows until `budget` tokens: BOS, a phrase of the generator's values (a share `numbers` of them numbers),
    `<｜Assistant｜>`, the same phrase, EOS; the loss mask covers the repetition and the EOS."""
    assistant = tok.token_to_id(ASSISTANT)

    def row():
        ids = tok.encode(gen.copy_value(2, 8, numbers))
        return [tok.bos_id, *ids, assistant, *ids, tok.eos_id], [i >= len(ids) + 2 for i in range(2 * len(ids) + 3)]

    return packed(row, budget, pad)


def drill_batch(gen: Generator, tok: Tokenizer, budget: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic drill conversations (Generator.drill) until `budget` tokens, loss on the assistant turns."""

    def row():
        ids = tok.encode(render_conversation(*gen.drill()))
        return ids, target_mask(ids, tok)

    return packed(row, budget, pad)


def facts_batch(gen: Generator, tok: Tokenizer, budget: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 6-12 steps of worked sums (Generator.facts) until `budget` tokens: BOS, `lhs = result, ...`, EOS; the
    loss on each result and the EOS. The pieces are encoded one by one, which the pre-tokenizer's split at every
    digit and punctuation run makes the same ids as the whole row."""

    def row():
        ids, mask = [tok.bos_id], [False]
        for lhs, rhs in gen.facts(gen.rng.randint(6, 12)):
            for text, scored in ((lhs, False), (rhs, True), (", ", False)):
                piece = tok.encode(text)
                ids += piece
                mask += [scored] * len(piece)
        ids[-len(tok.encode(", ")) :] = [tok.eos_id]
        return ids, mask[: len(ids) - 1] + [True]

    return packed(row, budget, pad)


def draft_anchors(mask: torch.Tensor, beta: int, cap: int, rng: random.Random) -> list[tuple[int, int]]:
    """(row, p) where the DSpark head drafts after position p (p >= 1, as in serving) and the first of its beta
    labels is an answer token; at most `cap` of them, drawn by rng."""
    b, s = mask.shape
    spots = [(r, p) for r in range(b) for p in range(1, s - 2) if mask[r, p + 2]]
    return sorted(rng.sample(spots, cap)) if len(spots) > cap else spots


def draft_losses(drafts: Drafts, logits: torch.Tensor, confidence: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(cross-entropy of the drafts plus the confidence head's BCE on whether each draft is right, top-1)."""
    v = drafts.valid
    right = logits[v].argmax(-1) == drafts.labels[v]
    loss = F.cross_entropy(logits[v], drafts.labels[v])
    loss = loss + F.binary_cross_entropy_with_logits(confidence[v], right.float())
    return loss, right.float().mean().item()


def train(out: Path, recipe: dict = RECIPE, log=print) -> dict:
    """Tokenizer, training, checkpoint and held-out evaluation into `out`; returns the stamp."""
    torch.set_num_threads(recipe["threads"])
    seed = recipe["seed"]
    random.seed(seed)
    torch.manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    gen = Generator(seed, weights=recipe["family_weights"], generic_calls=recipe["generic_calls"])
    texts = [render_conversation(*gen.conversation()) for _ in range(recipe["tokenizer_conversations"])]
    work = Path(tempfile.mkdtemp(prefix=".demo-"))
    try:
        tokenizer = vocab.train_tokenizer(texts, recipe["bpe_vocab"], spaces=recipe["spaces"])
        vocab.save(tokenizer, work / "tokenizer")
        tok = Tokenizer.from_dir(work / "tokenizer")
        gen.pieces = vocab.word_pieces(tok)
        token_map = compressed_token_map(tok.backend)
        config = demo_config(tok.vocab_size, max(token_map) + 1, tok.token_to_id(vocab.NOISE), tok.bos_id, tok.eos_id)
        cfg = ModelConfig.from_dict(config)
        model = Trainable(cfg, token_map, seed)
        params = model.parameters()
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": recipe["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
            lr=recipe["lr"],
            betas=(0.9, 0.95),
            foreach=True,  # one call over every tensor, where the CPU default runs ~700 tensors' updates one by one
        )
        steps, warm = recipe["steps"], recipe["warmup"]
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda i: min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))),
        )
        pad = tok.token_to_id(vocab.PAD)
        chats = Batches(gen, tok, recipe["batch_tokens"], pad)
        backbone, stages = model.parameters(draft=False), model.parameters(draft=True)
        anchor_rng = random.Random(seed)  # its own stream: the backbone's data are those of a run without drafts
        for step in range(steps):
            copying = recipe["batch_tokens"] if step < recipe["copy_steps"] else recipe["copy_tokens"]
            parts = [copy_batch(gen, tok, copying, pad, recipe["copy_numbers"])] if copying else []
            if step >= recipe["copy_steps"]:
                if recipe["drill_tokens"]:
                    parts.append(drill_batch(gen, tok, recipe["drill_tokens"], pad))
                if recipe["facts_tokens"]:
                    parts.append(facts_batch(gen, tok, recipe["facts_tokens"], pad))
                if recipe["batch_tokens"]:
                    parts.append(chats())
            picked, wanted, draft_loss, drafted = [], [], 0.0, None
            weights = model.weights()  # the stored weights once for the step's forwards
            for k, (tokens, mask) in enumerate(parts):
                drafts = None
                if step >= steps - recipe["dspark_steps"] and k == len(parts) - 1:
                    spots = draft_anchors(mask, cfg.dspark_block_size, recipe["dspark_anchors"], anchor_rng)
                    drafts = Drafts.build(tokens, spots, cfg, wanted=mask) if spots else None
                logits = model.forward(tokens, drafts, weights)
                if drafts is not None:
                    logits, draft_loss, drafted = logits[0], *draft_losses(drafts, *logits[1:])
                picked.append(logits[:, :-1][mask[:, 1:]])
                wanted.append(tokens[:, 1:][mask[:, 1:]])
            logits, target = torch.cat(picked), torch.cat(wanted)
            loss = F.cross_entropy(logits, target)
            opt.zero_grad(set_to_none=True)
            (loss + draft_loss).backward()
            torch.nn.utils.clip_grad_norm_(backbone, recipe["clip"])
            torch.nn.utils.clip_grad_norm_(stages, recipe["clip"])
            opt.step()
            sched.step()
            if step % 20 == 0 or step == steps - 1:
                line = f"step {step} loss {loss.item():.3f}"
                if copying:
                    line += f" copy accuracy {(picked[0].argmax(-1) == wanted[0]).float().mean().item():.2f}"
                if drafted is not None:
                    line += f" draft loss {draft_loss.item():.3f} draft top-1 {drafted:.2f}"
                log(f"{line} {time.perf_counter() - t0:.0f}s ({time.process_time() - c0:.0f} CPU s)")
        train_head(model, chats, cfg, recipe, random.Random(seed + 1), t0, log)
        train_s = time.perf_counter() - t0
        model_dir = work / "model"
        write_checkpoint(config, model_dir, seed=seed, tokenizer_dir=work / "tokenizer", values=model.values())
        n, eval_seed = recipe["eval_per_family"], recipe["eval_seed"]
        acc = evaluate(model_dir, n, eval_seed, log=log)
        drafts = evaluate_drafts(model, tok, n, eval_seed, log=log) if recipe["dspark_steps"] else None
        stamp = {
            "recipe": recipe_hash(recipe),
            **recipe,
            "train_seconds": round(train_s),
            "held_out_accuracy": acc,
            "dspark": drafts,
        }
        (model_dir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(model_dir, out)
        return stamp
    finally:
        shutil.rmtree(work, ignore_errors=True)


def greedy_labels(drafts: Drafts, logits: torch.Tensor, spots: list[tuple[int, int]], beta: int) -> torch.Tensor:
    """Each draft's label as the backbone's own greedy token there: anchor (row r, p) drafts positions p + 2 .. p +
    1 + beta, which the backbone's logits at p + 1 .. p + beta predict (a verify keeps a draft where it is the
    target's choice, which a label from the data is not wherever the model errs)."""
    s = logits.shape[1]
    rows = torch.tensor([r for r, _ in spots]).repeat_interleave(beta)
    at = (torch.tensor([p for _, p in spots]).unsqueeze(1) + 1 + torch.arange(beta)).flatten().clamp_max(s - 1)
    return logits[rows, at].argmax(-1)


def train_head(model: Trainable, chats: Batches, cfg, recipe: dict, rng: random.Random, t0: float, log) -> None:
    """The DSpark stages alone on the frozen backbone (no backbone gradients: each step is a forward of it), for
    recipe["head_steps"] steps of chat batches, drafts labelled by greedy_labels."""
    steps = recipe["head_steps"]
    if not steps:
        return
    stages, backbone = model.parameters(draft=True), model.parameters(draft=False)
    for p in backbone:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(
        stages, lr=recipe["head_lr"], betas=(0.9, 0.95), weight_decay=recipe["weight_decay"], foreach=True
    )
    warm = recipe["head_warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))),
    )
    beta = cfg.dspark_block_size
    try:
        for step in range(steps):
            tokens, mask = chats()
            spots = draft_anchors(mask, beta, recipe["dspark_anchors"], rng)
            if not spots:
                continue
            drafts = Drafts.build(tokens, spots, cfg, wanted=mask)
            # the stored weights of this step's values (the stages change every step; ~0.08 s on the demo)
            logits, draft_logits, confidence = model.forward(tokens, drafts, model.weights())
            drafts.labels = greedy_labels(drafts, logits.detach(), spots, beta)
            loss, top1 = draft_losses(drafts, draft_logits, confidence)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(stages, recipe["clip"])
            opt.step()
            sched.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"head step {step} draft loss {loss.item():.3f} draft top-1 {top1:.2f} "
                    f"{time.perf_counter() - t0:.0f}s")  # fmt: skip
    finally:
        for p in backbone:
            p.requires_grad_(True)


def load(model_dir: Path) -> tuple[Tokenizer, Transformer, ResidentExperts]:
    """The checkpoint through the loader every model uses (reference math: fp32, experts resident)."""
    ckpt = Checkpoint.open(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    model = Transformer(ckpt.config, token_map=compressed_token_map(tok.backend))
    load_into(model, ckpt)
    experts = ResidentExperts(load_experts(ckpt, ckpt.config), ckpt.config.swiglu_limit)
    return tok, model.eval(), experts


def greedy(model: Transformer, experts, prompt: list[int], eos: int, max_new: int = 128) -> list[int]:
    """Greedy tokens through EOS, at most max_new (a thinking-mode difference, worked twice, takes ~100)."""
    state = model.new_state(len(prompt) + max_new)
    logits = model(torch.tensor([prompt]), 0, state, experts, last_only=True)
    out: list[int] = []
    while len(out) < max_new:
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
        logits = model(torch.tensor([[nxt]]), state.length, state, experts, last_only=True)
    return out


def evaluate(model_dir: Path, per_family: int, seed: int, log=print) -> dict[str, float]:
    """Greedy held-out accuracy per family (half thinking, half chat mode), plus how often thinking-mode answers
    close their reasoning and end with EOS."""
    tok, model, experts = load(model_dir)
    gen = Generator(seed, held_out=True)
    acc, closed, n_think = {}, 0, 0
    for family in FAMILIES:
        right = 0
        for i in range(per_family):
            sample = gen.sample(family, thinking=i % 2 == 0)
            out = greedy(model, experts, tok.encode(sample.prompt()), tok.eos_id)
            text = tok.decode(out)
            right += check_text(sample, text)
            if sample.thinking:
                n_think += 1
                closed += out[-1] == tok.eos_id and THINK_CLOSE in text
        acc[family] = round(right / per_family, 3)
        log(f"held-out {family}: {acc[family]:.2f}")
    acc["thinking_closed_and_stopped"] = round(closed / max(n_think, 1), 3)
    return acc


@torch.no_grad()
def evaluate_drafts(model: Trainable, tok: Tokenizer, per_family: int, seed: int, log=print) -> dict:
    """The DSpark head on held-out answers, teacher-forced at every answer position (training math, which the
    unit tests hold equal to serving's): top-1 per draft slot and the mean number of leading drafts equal to the
    backbone's own greedy token, which is what greedy verification accepts per pass (and the same against the
    answers' tokens)."""
    gen = Generator(seed + 1, held_out=True)
    beta = model.cfg.dspark_block_size
    right, valid, lead, lead_data = torch.zeros(beta), torch.zeros(beta), [], []
    for family in FAMILIES:
        for i in range(per_family):
            ids = tok.encode(gen.sample(family, thinking=i % 2 == 0).full())
            tokens = torch.tensor([ids])
            mask = torch.tensor([target_mask(ids, tok)])
            spots = draft_anchors(mask, beta, len(ids), random.Random(0))
            if not spots:
                continue
            drafts = Drafts.build(tokens, spots, model.cfg, wanted=mask)
            backbone, logits, _ = model.forward(tokens, drafts)
            guess = logits.argmax(-1)
            ok_valid = drafts.valid.view(-1, beta)
            ok = (guess == greedy_labels(drafts, backbone, spots, beta)).view(-1, beta) & ok_valid
            right += ok.sum(0)
            valid += ok_valid.sum(0)
            lead += ok.int().cumprod(1).sum(1).tolist()
            lead_data += ((guess == drafts.labels).view(-1, beta) & ok_valid).int().cumprod(1).sum(1).tolist()
    out = {
        "draft_top1": [round(float(r / max(v, 1)), 3) for r, v in zip(right, valid)],
        "accepted_per_verify": round(sum(lead) / max(len(lead), 1), 3),
        "accepted_per_verify_data": round(sum(lead_data) / max(len(lead_data), 1), 3),
    }
    log(f"held-out drafts: top-1 per slot {out['draft_top1']}, accepted per verify {out['accepted_per_verify']} "
        f"({out['accepted_per_verify_data']} against the answers' tokens)")  # fmt: skip
    return out
