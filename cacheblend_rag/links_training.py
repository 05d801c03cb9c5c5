"""Training learned links by distillation from the model's own full prefill (the model frozen).

For each training prompt (retrieved passages + a question) the teacher is the model's full prefill: its greedy answer
(the first `answer_tokens` tokens) and its next-token distributions along that answer, teacher-forced. The student
is the same prompt fused from the passages' stored KV, with the links after the last passage: the link rows, the
question and the answer rows are computed in every layer over the stored KV (`fuse.loop.run_layers(trainable=True)`),
and the KL between the two distributions, averaged over the answer's positions, flows back to the link embeddings
alone. Chunk KV is fixed and the model's weights never change, so a step costs a forward and backward pass over
about a hundred rows.

    examples = examples_from_file(path, ...)            # NQ-style {"items": [...]} or MuSiQue-style [...]
    teachers = [teach(engine, e) for e in examples]     # one full prefill + greedy answer each (cached on disk)
    links = train(engine, teachers, steps=300)          # Adam on the link embeddings; resumable from a checkpoint
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .errors import ConfigError
from .fuse.links import Links
from .fuse.loop import run_layers
from .fuse.policies import make_policy
from .request import Request

if TYPE_CHECKING:
    from .engine import CacheBlendEngine

logger = logging.getLogger(__name__)

TRAINING_METHOD = "full_reuse"
"""What links are trained under by default: every passage row stays stale, the hardest case (and the one links
correct most); `train(method=..., recompute_ratio=...)` trains them under another."""

__all__ = ["TRAINING_METHOD", "Example", "Teacher", "distill_loss", "examples_from_file", "initial_links", "teach", "train"]


@dataclass(frozen=True)
class Example:
    """One training prompt: passages in the order the retriever gave them, and a question."""

    passages: tuple[str, ...]
    question: str
    answers: tuple[str, ...] = ()  # gold answers, where the data set has them (for scoring, not for training)


@dataclass
class Teacher:
    """The model's full prefill of an example: its greedy answer ids and log-probabilities along them."""

    example: Example
    answer_ids: list[int]  # the first answer tokens of full prefill's greedy answer (its EOS included if it came)
    logprobs: torch.Tensor = field(repr=False)  # (len(answer_ids), vocab) float16: log p(next | prompt, answer[:i])


def examples_from_file(path: str | os.PathLike[str], *, start: int = 0, limit: int | None = None,
                       num_passages: int | None = None, passage_words: int | None = None) -> list[Example]:
    """Examples from an NQ-style file (`{"items": [{"question", "passages", "answers"}]}`) or a MuSiQue-style one
    (`[{"question", "ctxs": [{"title", "text"}], "answers"}]`): items [start, start + limit), each with its first
    `num_passages` passages cut to `passage_words` words (None: as they are)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"training data {path} cannot be read as JSON: {e}") from e
    items = data.get("items") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: expected {{'items': [...]}} (NQ-style) or a list (MuSiQue-style) of questions")
    out = []
    for i, item in enumerate(items[start:start + limit if limit else None], start):
        if not isinstance(item, dict) or not isinstance(item.get("question"), str):
            raise ConfigError(f"{path}: item {i} has no question")
        if "passages" in item:
            passages = [str(p) for p in item["passages"]]
        elif "ctxs" in item:
            passages = [f"{c['title']}\n{c['text']}" if c.get("title") else c["text"] for c in item["ctxs"]]
        else:
            raise ConfigError(f"{path}: item {i} has neither 'passages' nor 'ctxs'")
        passages = passages[:num_passages] if num_passages else passages
        if passage_words:
            passages = [" ".join(p.split()[:passage_words]) for p in passages]
        answers = item.get("answers") or ()
        out.append(Example(tuple(passages), item["question"], tuple(str(a) for a in answers)))
    return out


@torch.inference_mode()
def teach(engine: "CacheBlendEngine", example: Example, answer_tokens: int = 8) -> Teacher:
    """Full prefill of the example (the model's own forward over the whole prompt, then greedy decoding): its
    answer's first tokens and the log-probabilities the model gave each, i.e. teacher-forced along that answer."""
    request = Request.of(list(example.passages), example.question, "full_prefill")
    prompt = engine.fusion_of(request).layout.token_ids.to(engine.adapter.device)
    out = engine.model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None],
                                max_new_tokens=answer_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=engine.tokenizer.eos_token_id)
    answer = out.sequences[0, prompt.numel():].tolist()
    logits = torch.cat([step[:1] for step in out.logits[:len(answer)]]).float()
    return Teacher(example, answer, torch.log_softmax(logits, -1).to(torch.float16).cpu())


def student_logits(engine: "CacheBlendEngine", links: Links | None, teacher: Teacher,
                   method: str = TRAINING_METHOD, recompute_ratio: float | None = None) -> torch.Tensor:
    """(len(answer), vocab) logits of the fused prompt with `links` after its last passage (None: without links),
    teacher-forced on the teacher's answer; differentiable in `links.embeds` (the passages' KV and the model are
    fixed)."""
    policy = make_policy(method, recompute_ratio)
    request = Request.of(list(teacher.example.passages), teacher.example.question, policy)
    fusion = engine.fusion_of(request, links)
    cache, adapter = engine.cache, engine.adapter
    with torch.inference_mode():
        placed = policy.place(cache, fusion)
    answer = torch.tensor(teacher.answer_ids[:-1], dtype=torch.long)
    layout = fusion.layout
    ids = torch.cat([layout.token_ids, answer])
    segments = torch.cat([layout.segment_of_row, torch.full_like(answer, -1)])
    try:
        seq = cache.sequence(ids, segments, placed.placements, links)
        try:
            with torch.inference_mode():
                selection = policy.start(adapter, seq, placed)
            result = run_layers(adapter, seq, selection, num_output_rows=len(teacher.answer_ids), trainable=True)
        finally:
            seq.close()
    finally:
        placed.close()
    return adapter.logits(result.hidden).float()


def distill_loss(student: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """KL(teacher ‖ student) per answer position, averaged: what training lowers."""
    target = teacher.logprobs.to(device=student.device, dtype=torch.float32)
    logp = torch.log_softmax(student, -1)
    return (target.exp() * (target - logp)).sum(-1).mean()


def initial_links(engine: "CacheBlendEngine", num_links: int, seed: int = 0) -> Links:
    """Links to start from: the embeddings of `num_links` tokens of a neutral bridge text (then trained)."""
    text = "\n\nThe passages above are the context; read them together to answer the question that follows.\n"
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (num_links // len(ids) + 1))[:num_links]
    with torch.no_grad():
        embeds = engine.adapter.embed(torch.tensor(ids, device=engine.adapter.device)).float().cpu().clone()
    embed = engine.model.get_input_embeddings().weight
    recipe = {"init": "bridge-text", "seed": seed, "num_links": num_links}
    return Links(embeds, engine.weights_fingerprint, int(embed.shape[0]), recipe)


def train(engine: "CacheBlendEngine", teachers: Sequence[Teacher], *, links: Links, steps: int = 300,
          lr: float = 2e-3, method: str = TRAINING_METHOD, recompute_ratio: float | None = None, seed: int = 0,
          checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 25, start_step: int = 0,
          optimizer_state: dict | None = None, show_progress: bool = True,
          on_step: Callable[[int, float], None] | None = None) -> tuple[Links, dict[str, Any]]:
    """Adam on the link embeddings, one teacher per step in a seeded shuffled order, for `steps` steps (from
    `start_step`, with `optimizer_state`, when resuming). Every `checkpoint_every` steps and at the end the links,
    with the optimizer's state beside them, are written to `checkpoint`. Returns the trained links and a log
    ({"losses", "step_s"})."""
    if not teachers:
        raise ConfigError("train: no training examples")
    if steps < 1 or lr <= 0 or not math.isfinite(lr):
        raise ConfigError(f"train: steps must be ≥ 1 and lr a positive number, got steps={steps}, lr={lr}")
    param = links.embeds.detach().clone().to(engine.adapter.device, torch.float32).requires_grad_(True)
    opt = torch.optim.Adam([param], lr=lr)
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state)
    current = dataclasses.replace(links, embeds=param)
    order = list(range(len(teachers)))
    log: dict[str, Any] = {"losses": [], "step_s": []}
    bar = tqdm(range(start_step, steps), desc="train links", unit="step", disable=not show_progress,
               initial=start_step, total=steps)
    with _frozen_weights(engine.model):
        for step in bar:
            if step % len(order) == 0 or step == start_step:  # a new seeded order each pass
                rng = random.Random(seed + step // len(order))
                rng.shuffle(order)
            teacher = teachers[order[step % len(order)]]
            started = time.perf_counter()
            loss = distill_loss(student_logits(engine, current, teacher, method, recompute_ratio), teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            log["step_s"].append(time.perf_counter() - started)
            log["losses"].append(float(loss.detach()))
            window = log["losses"][-25:]
            bar.set_postfix(kl=f"{sum(window) / len(window):.3f}")
            if on_step is not None:
                on_step(step, log["losses"][-1])
            if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
                save_checkpoint(checkpoint, _snapshot(links, param, step + 1), opt.state_dict(), step + 1)
    return _snapshot(links, param, steps), log


@contextmanager
def _frozen_weights(model) -> Iterator[None]:
    """The model's weights take no gradient inside (training links), and are handed back as they came."""
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _snapshot(links: Links, param: torch.Tensor, steps_done: int) -> Links:
    recipe = dict(links.recipe, steps=steps_done)
    return Links(param.detach().float().cpu().clone(), links.fingerprint, links.vocab_size, recipe)


def save_checkpoint(path: str | os.PathLike[str], links: Links, optimizer_state: dict, step: int) -> None:
    """The links file at `path` and, beside it (`<path>.optim.pt`), the optimizer's state and the step reached."""
    links.save(path)
    tmp = Path(f"{path}.optim.pt.tmp")
    torch.save({"step": step, "optimizer": optimizer_state}, tmp)
    os.replace(tmp, f"{path}.optim.pt")


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[Links, dict | None, int]:
    """(links, optimizer state, step) from a checkpoint `save_checkpoint` wrote; without its optimizer file, the
    step is the links' recipe's and the optimizer starts afresh."""
    links = Links.load(path)
    side = Path(f"{path}.optim.pt")
    if side.is_file():
        state = torch.load(side, weights_only=True)
        return links, state["optimizer"], int(state["step"])
    return links, None, int(links.recipe.get("steps", 0))
