"""Continuous batching end to end: a real server and concurrent openai SDK streams.

The server serves a tiny random-weight Llama (saved to a folder with the real tokenizer), so its prefills and
decode steps take milliseconds and the test checks scheduling, not the model; the decoder's exactness on the
real model is tests/test_decode_kv.py's.
"""

from __future__ import annotations

import threading

import pytest

openai = pytest.importorskip("openai")

from test_serve import DOCS, ServerProcess, _home  # noqa: E402

MODEL = "tiny-llama"  # the served name: the model folder's name

QUESTIONS = ("Explain honeybee eyes and colonies step by step.", "List everything these passages say about honeybees.")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    from conftest import tiny_model

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory, tiny_folder):
    # a later --model wins over ServerProcess's own
    srv = ServerProcess(_home(tmp_path_factory.mktemp("serve-batching")), "--model", str(tiny_folder),
                        "--max-batch", "2", "--max-queue", "4", "--timeout", "1800")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def batching_client(batching_server):
    return openai.OpenAI(base_url=f"{batching_server.url}/v1", api_key="unused", max_retries=0, timeout=1800)


def _stream(client, question: str, arrivals: list, who: int, max_tokens: int = MAX_TOKENS,
            lock: threading.Lock | None = None) -> str:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                            max_tokens=max_tokens, stream=True, extra_body={"documents": DOCS})
    text = ""
    for chunk in stream:
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            text += piece
            with lock:
                arrivals.append(who)
    return text


def _together(client, questions) -> tuple[list[str], list[int]]:
    """Stream every question at once from its own thread: the answers and the order their pieces arrived in."""
    arrivals: list[int] = []
    lock = threading.Lock()
    answers: list[str] = [""] * len(questions)

    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            answers[i] = _stream(client, questions[i], arrivals, i, lock=lock)
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    if errors:
        raise errors[0]
    return answers, arrivals


def _interleaved(arrivals: list[int]) -> bool:
    """Each stream got a piece before the other's last piece: neither waited for the other to finish."""
    last = {who: max(i for i, w in enumerate(arrivals) if w == who) for who in set(arrivals)}
    first = {who: arrivals.index(who) for who in set(arrivals)}
    return len(last) == 2 and first[0] < last[1] and first[1] < last[0]


@pytest.mark.model
@pytest.mark.slow
def test_concurrent_streams_interleave_and_each_equals_its_solo_answer(batching_server, batching_client):
    for q in QUESTIONS:  # the passages' KV stored first, so every answer below reuses it (none computes holes)
        batching_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                max_tokens=1, extra_body={"documents": DOCS})
    solo = []
    for q in QUESTIONS:
        out = batching_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                      max_tokens=MAX_TOKENS, extra_body={"documents": DOCS})
        assert out.usage.completion_tokens == MAX_TOKENS  # no EOS: long enough to overlap
        solo.append(out.choices[0].message.content)
    answers, arrivals = _together(batching_client, QUESTIONS)
    assert [a.strip() for a in answers] == solo
    assert _interleaved(arrivals), arrivals


@pytest.mark.model
@pytest.mark.slow
def test_a_disconnected_stream_frees_its_slot(batching_server, batching_client):
    # --max-batch 2: a long answer whose client hangs up must leave the batch, or of the two streams sent next one
    # would decode beside it and the other wait in the queue until that one ended (no interleaving)
    gone = batching_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                   max_tokens=3000, stream=True, extra_body={"documents": DOCS})
    next(iter(gone))
    gone.close()
    answers, arrivals = _together(batching_client, QUESTIONS)
    assert all(answers) and _interleaved(arrivals), arrivals
    batching_server.wait_for(lambda h: h["running"] == 0 and h["queue_depth"] == 0, "the engine idle again")


# ---- the batch scheduler on a tiny model, in process ------------------------------------------------


def test_batch_scheduler_interleaves_jobs_equal_to_solo_and_frees_cancelled_slots(tokenizer):
    import asyncio
    import time

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.request import Request
    from cacheblend_rag.serve.runner import EngineCall, Retriever, make_scheduler
    from cacheblend_rag.serve.scheduler import BatchScheduler, Done, Failed, Job, Piece

    from conftest import tiny_model

    engine = CacheBlendEngine(tiny_model("llama", len(tokenizer)), tokenizer, None)
    passages = ("A short passage about bees and their five eyes.", "Queens, drones and workers live in a hive.")
    calls = [EngineCall(Request.of(passages, q, max_new_tokens=n))
             for q, n in (("What is in the passage?", 12), ("Who lives in a hive?", 12), ("Tell me more.", 2000))]
    solo = [engine.generate(list(passages), c.request.question, max_new_tokens=c.request.sampling.max_new_tokens
                            ).token_ids for c in calls[:2]]

    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        sched = make_scheduler(engine, Retriever(None), max_queue=4, max_batch=2)
        assert isinstance(sched, BatchScheduler)
        sched.start()
        # a long job takes a slot, then its client goes away: its slot is free at the next step
        long_job = Job(calls[2], loop, deadline=time.monotonic() + 600)
        sched.submit(long_job)
        assert isinstance(await long_job.next_event(600), Piece)
        long_job.cancel()
        event = await long_job.next_event(600)
        while isinstance(event, Piece):  # pieces emitted before the cancel was seen
            event = await long_job.next_event(600)
        assert isinstance(event, Failed)
        order: list[int] = []
        jobs = [Job(c, loop, deadline=time.monotonic() + 600) for c in calls[:2]]
        for job in jobs:
            sched.submit(job)
        results: list[list] = [[], []]

        async def drain(i: int) -> None:
            while True:
                event = await jobs[i].next_event(600)
                results[i].append(event)
                if isinstance(event, Piece):
                    order.append(i)
                else:
                    return

        await asyncio.gather(drain(0), drain(1))
        size = sched.batch_size()
        await asyncio.to_thread(sched.stop, 60)
        return results, order, size

    results, order, size = asyncio.run(main())
    for events, expected in zip(results, solo):
        done = events[-1]
        assert isinstance(done, Done) and done.stats["num_generated"] == len(expected) == 12
        text = "".join(e.text for e in events[:-1])
        assert text.strip() == tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert _interleaved(order), order
    assert size == 0
