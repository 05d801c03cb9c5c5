"""An answer-correctness set a small model can pass: made-up products documented in short FAQ chunks.

MuSiQue's gold F1 is ~0.04 for every method on a 135M model, so it cannot show a method giving wrong answers.
Here every fact is invented (no model knows it), each question's answer is one fact stated in one chunk, and the
prompt carries that chunk among `k` others about other products, in the user's own wording. Accuracy is whether
the answer's first line states the fact (whole words; the rest of a completion that runs on is not its answer),
within a budget that fits a one-sentence answer (32 tokens: at 16, chat answers were cut before the fact).
Generated from a seed: the same seed gives the same set everywhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_SYLLABLES = ["zen", "tro", "va", "lum", "ka", "ori", "pex", "dal", "mi", "sor", "qui", "bel", "nax", "ter", "fio",
              "gra", "hul", "vek", "ost", "ria"]
_FIRST = ["Mira", "Tomas", "Leila", "Dario", "Ingrid", "Kofi", "Yuna", "Pavel", "Amara", "Bruno", "Selin", "Hugo"]
_LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Castellanos", "Novak", "Haddad", "Brennan", "Ivers", "Quist"]
_CITIES = ["Tallinn", "Porto", "Ghent", "Bergen", "Kyoto", "Valparaiso", "Tartu", "Graz", "Malmo", "Lyon"]
_KINDS = ["robot vacuum", "espresso machine", "e-bike", "smart thermostat", "drone", "air purifier", "3D printer",
          "electric kettle"]


@dataclass(frozen=True)
class FaqQuestion:
    """One question, the chunk that answers it, and the other chunks retrieved beside it."""

    question: str
    answer: str
    chunks: list[str]  # k chunks in retrieval order; one of them states the answer
    gold: int  # which


def _name(rng: random.Random) -> str:
    return "".join(rng.sample(_SYLLABLES, 2)).capitalize()


def _product(rng: random.Random, used: set[str]) -> dict:
    company = _name(rng)
    while company in used:
        company = _name(rng)
    founder = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    while founder in used:  # no two companies share a founder: a question names exactly one fact
        founder = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    used.update((company, founder))
    return {
        "company": company,
        "product": f"{company} {rng.choice('XQRSV')}{rng.randint(2, 9)}",
        "kind": rng.choice(_KINDS),
        "founder": founder,
        "city": rng.choice(_CITIES),
        "year": str(rng.randint(1994, 2021)),
        "warranty": f"{rng.choice([18, 24, 30, 36, 48])} months",
        "battery": f"{rng.randint(3, 14)} hours",
                "price": f"{rng.randint(79, 899)} euros",
    }


def _chunk(p: dict) -> str:
    """A company's FAQ page: each question as a user would ask it, answered in one sentence (about 130 tokens)."""
    c, x = p["company"], p["product"]
    return (f"{c} - Frequently asked questions\n"
            f"Who founded {c}? {c} was founded by {p['founder']}.\n"
            f"Where is {c} based? {c} is based in {p['city']}.\n"
            f"When was {c} founded? {c} was founded in {p['year']}.\n"
            f"What does {c} make? {c} makes the {x}, a {p['kind']}.\n"
            f"How long is the warranty of the {x}? The warranty of the {x} is {p['warranty']}.\n"
            f"How long does the battery of the {x} last? The battery of the {x} lasts {p['battery']}.\n"
            f"How much does the {x} cost? The {x} costs {p['price']}.")


_QUESTIONS = [
    ("Who founded {company}?", "founder"),
    ("Where is {company} based?", "city"),
    ("When was {company} founded?", "year"),
    ("How long is the warranty of the {product}?", "warranty"),
    ("How long does the battery of the {product} last?", "battery"),
    ("How much does the {product} cost?", "price"),
]


def faq_set(num_questions: int, k: int = 4, seed: int = 0, num_products: int = 24) -> list[FaqQuestion]:
    """`num_questions` questions, each over `k` chunks (the answering one at a random place among k - 1 others)."""
    if not 1 <= k <= num_products:
        raise ValueError(f"k must be in 1..{num_products}, got {k}")
    rng = random.Random(seed)
    used: set[str] = set()
    products = [_product(rng, used) for _ in range(num_products)]
    pages = [_chunk(p) for p in products]
    out = []
    for i in range(num_questions):
        target = i % num_products
        template, field = _QUESTIONS[rng.randrange(len(_QUESTIONS))]
        others = rng.sample([j for j in range(num_products) if j != target], k - 1)
        order = others + [target]
        rng.shuffle(order)
        out.append(FaqQuestion(template.format(**products[target]), products[target][field],
                               [pages[j] for j in order], order.index(target)))
    return out


def correct(answer_text: str, expected: str) -> bool:
    """Whether an answer's first line states the fact: its words in order, whole words, case and punctuation aside
    (a number alone for a quantity: '24' answers '24 months')."""
    # the first line only: a completion that runs on into more "Question: ... Answer: ..." lines or a copied page
    # would otherwise be credited with facts it never gave as its answer
    first_line = answer_text.strip().split("\n", 1)[0]
    words = "".join(c if c.isalnum() else " " for c in first_line.lower()).split()
    want = "".join(c if c.isalnum() else " " for c in expected.lower()).split()
    # whole words: '13 hours' does not state '3 hours'
    return f" {' '.join(want)} " in f" {' '.join(words)} " or (want[0].isdigit() and want[0] in words)


def string_prompt(q: FaqQuestion) -> str:
    """The chunks and question in a user's plain-text wording (a completion prompt)."""
    context = "\n\n".join(q.chunks)
    return (f"Use the following product information to answer the question.\n\n{context}\n\n"
            f"Question: {q.question}\nAnswer:")


def chat_prompt(q: FaqQuestion) -> list[dict[str, str]]:
    """The chunks and question as chat messages of a user's own wording."""
    context = "\n\n".join(q.chunks)
    return [{"role": "system", "content": "You are a support assistant. Answer in one sentence, using only the "
                                          "product information."},
            {"role": "user", "content": f"Product information:\n{context}\n\nQuestion: {q.question}\n"
                                        "Answer in one sentence."}]


def tool_prompt(q: FaqQuestion) -> list[dict[str, str]]:
    """An agent's step after a retriever tool: the question first, the pages after it in a `<tool_response>` turn
    (as the integrations send a tool's result once the call is answered: `tools.answer_turn`)."""
    context = "\n\n".join(q.chunks)
    return [{"role": "system", "content": "You are a support assistant. Answer in one sentence, using only the "
                                          "product information the tool returned."},
            {"role": "user", "content": q.question},
            {"role": "user", "content": f"<tool_response>\n{context}\n</tool_response>"}]


FAQ_FRAMES = {"chat": chat_prompt, "string": string_prompt, "tool": tool_prompt}
"""The frames `bench faq` asks each question in: the user's chat, a plain string, an agent's step after a tool."""
