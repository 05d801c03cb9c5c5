"""Answering a queued call: JSON, or SSE chunks as the engine's pieces arrive; `usage` with the cache facts; an
answer's tool calls as OpenAI's `message.tool_calls` (streamed: their deltas, `tooling.CallStream`); an "auto" answer
that only repeats calls the chat already answered, answered again under "none".
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .. import tools as generic_tools
from ..errors import CacheBlendError
from ..tool_format import GENERIC
from .admission import Admission
from .calls import APIError, api_error, chat_call
from .config import ServeConfig
from .metrics import ServerMetrics
from .runner import EngineCall
from .scheduler import Cancelled, Done, Failed, Job, Piece, RequestTimeout
from .schemas import ChatCompletionRequest, _Generation
from .tooling import CallStream, ChatPlan, answer_message

logger = logging.getLogger(__name__)


def usage_of(stats: dict, job: Job, ttft_s: float | None) -> dict:
    """OpenAI's usage, with cached tokens, plus the CacheBlend stats."""
    links = stats.get("links")
    # the learned links' rows are the engine's, not the client's prompt
    prompt = int(stats.get("num_tokens", 0)) - int((links or {}).get("num_links", 0))
    completion = int(stats.get("num_generated", 0))
    cached = int(stats.get("num_reused", 0)) + int(stats.get("num_exact_cached", 0))
    hits, misses = list(stats.get("chunk_hits", ())), list(stats.get("chunk_misses", ()))
    timing = stats.get("timing", {})
    cacheblend = {
        "method": stats.get("method"),
        "chunk_hits": len(hits), "chunk_misses": len(misses), "hit_ids": hits, "miss_ids": misses,
        "reused_tokens": int(stats.get("num_reused", 0)), "exact_cached_tokens": int(stats.get("num_exact_cached", 0)),
        "recomputed_tokens": int(stats.get("num_recomputed", 0)),
        "recomputed_share": float(stats.get("recompute_ratio_effective", 0.0)),
        "recompute_ratio": stats.get("recompute_ratio"),
        "prefill_s": stats.get("ttft_s"),  # the engine's time to first token
        "ttft_s": ttft_s,  # from the request's arrival, queueing included
        "queue_s": (job.started - job.arrived) if job.started is not None else None,
        "decode_s": timing.get("decode_s"),
    }
    if "num_retrieved" in stats:
        cacheblend["num_retrieved"] = stats["num_retrieved"]
    if stats.get("fidelity") is not None:  # the model's calibrated ratio ran (the fidelity gate)
        cacheblend["fidelity"] = stats["fidelity"]
    if links is not None:  # the engine has learned links: whether they ran
        cacheblend["links"] = links
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "cacheblend": cacheblend}


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Responder:
    """Runs admitted calls and answers with what their jobs emit: the route's `respond`."""

    def __init__(self, engine, config: ServeConfig, admission: Admission, metrics: ServerMetrics) -> None:
        self.engine, self.config, self.admission, self.metrics = engine, config, admission, metrics

    def finished(self, job: Job, stats: dict, ttft_s: float | None) -> dict:
        """The usage to answer with (its cache facts left out under `hide_cache_usage`); the metrics see them all."""
        usage = usage_of(stats, job, ttft_s)
        latency = time.monotonic() - job.arrived
        self.metrics.observe_finished(usage, stats, ttft_s, latency)
        self.admission.observe_latency(latency)
        if self.config.hide_cache_usage:
            return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return usage

    async def respond(self, request: Request, body: _Generation, call: EngineCall, chat: bool,
                      plan: ChatPlan | None = None) -> dict | StreamingResponse:
        """Queue the call and answer with JSON, or with SSE once the first piece (or an error) is known."""
        try:
            call = await self.admission.admit(call)
        except CacheBlendError as e:
            raise api_error(e) from e
        job = self.admission.submit(call)
        streaming = False
        try:
            try:
                first = await job.next_event(self.config.poll_s, request.is_disconnected)
            except (RequestTimeout, Cancelled) as e:
                raise api_error(e) from e
            if isinstance(first, Failed):
                raise api_error(first.error)
            ttft_s = time.monotonic() - job.arrived
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if body.stream:
                streaming = True
                return StreamingResponse(self._stream(job, first, body, chat, rid, ttft_s, plan),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            texts, event, checked = [], first, time.monotonic()
            while not isinstance(event, Done):
                if isinstance(event, Failed):
                    raise api_error(event.error)
                texts.append(event.text)
                if time.monotonic() - checked > self.config.poll_s:  # pieces keep coming: is anyone still there?
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise api_error(Cancelled("the client disconnected"))
                try:
                    event = await job.next_event(self.config.poll_s, request.is_disconnected)
                except (RequestTimeout, Cancelled) as e:
                    raise api_error(e) from e
            text = "".join(texts).strip()
            if plan is not None and plan.answered and plan.repeats(self._calls(text, plan)):
                body, (call, plan) = self._answer_instead(body, plan, call.request.cache_salt)
                return await self.respond(request, body, call, chat, plan)
            usage = self.finished(job, event.stats, ttft_s)
            choice: dict = {"index": 0, "finish_reason": event.finish_reason, "logprobs": None}
            if chat:
                choice["message"], choice["finish_reason"] = answer_message(
                    text, event.finish_reason, plan.functions if plan else (), plan.format if plan else GENERIC)
            else:
                choice["text"] = text
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": self.config.model_name, "choices": [choice], "usage": usage}
        finally:
            if not streaming:
                job.cancel()  # a no-op once the job is done; stops it when the handler failed or its client left

    @staticmethod
    def _calls(text: str, plan: ChatPlan) -> list[generic_tools.ToolCall]:
        """The calls an answer's text makes under `plan`."""
        return generic_tools.parse_tool_calls(text, plan.functions, plan.format)[1] if plan.functions else []

    def _answer_instead(self, body: ChatCompletionRequest, plan: ChatPlan, cache_salt: str | None,
                        ) -> tuple[ChatCompletionRequest, tuple[EngineCall, ChatPlan]]:
        """The request again under tool_choice "none", for an "auto" answer that only repeated answered calls."""
        logger.info("tool_choice 'auto': the answer repeats calls whose results the chat holds; answering under "
                    "'none' instead")
        body = body.model_copy(update={"tool_choice": "none"})
        return body, chat_call(body, self.engine.tokenizer, self.config.default_max_tokens, cache_salt)

    async def _stream(self, job: Job, first: Piece | Done, body: _Generation, chat: bool, rid: str,
                      ttft_s: float, plan: ChatPlan | None = None) -> AsyncIterator[str]:
        """SSE chunks: the role, content (or tool-call) deltas, the finish reason, usage (if asked), then [DONE]."""
        created, model = int(time.time()), self.config.model_name
        include_usage = body.include_usage()
        calls = CallStream(plan.functions, plan.format) if plan is not None and plan.functions else None

        def chunk(content: str | dict | None, finish_reason: str | None = None, role: bool = False) -> dict:
            if chat:
                delta: dict = {"role": "assistant"} if role else {}
                if isinstance(content, dict):  # a delta from CallStream
                    delta.update(content)
                elif content is not None:
                    delta["content"] = content
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": content or "", "finish_reason": finish_reason, "logprobs": None}
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": model, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return out

        try:
            if chat:
                yield sse(chunk("", role=True))
            event: Piece | Done | Failed = first
            leading = True  # strip the answer's leading whitespace, as the non-streaming answer is stripped
            # under "auto" after tool results a call is held back until the answer ends: one that only repeats
            # answered calls is not sent, the answer under "none" is streamed instead (see `respond`)
            guarded = plan is not None and bool(plan.answered)
            held: list[dict] = []
            text = ""
            while True:
                if isinstance(event, Piece) and calls is not None:
                    text += event.text
                    for delta in calls.feed(event.text):
                        if guarded and "tool_calls" in delta:
                            held.append(delta)
                        else:
                            yield sse(chunk(delta))
                elif isinstance(event, Piece):
                    text = event.text.lstrip() if leading else event.text
                    if text:
                        leading = False
                        yield sse(chunk(text))
                elif isinstance(event, Done):
                    finish_reason = event.finish_reason
                    if calls is not None:
                        held += calls.finish()
                        if guarded and plan.repeats(self._calls(text, plan)):
                            job.cancel()
                            try:  # building the call may refuse it too: the stream has begun, an SSE error says so
                                body, (call, plan) = self._answer_instead(body, plan, job.call.request.cache_salt)
                                job = self.admission.submit(await self.admission.admit(call))
                                event = await job.next_event(self.config.poll_s)
                            except (CacheBlendError, APIError, RequestTimeout) as e:
                                yield sse((e if isinstance(e, APIError) else api_error(e)).body())
                                break
                            calls, guarded, held = None, False, []
                            continue
                        for delta in held:
                            yield sse(chunk(delta))
                        if calls.called and finish_reason != "length":
                            finish_reason = "tool_calls"
                    usage = self.finished(job, event.stats, ttft_s)
                    yield sse(chunk(None if chat else "", finish_reason))
                    if include_usage:
                        yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [], "usage": usage})
                    break
                else:
                    yield sse(api_error(event.error).body())
                    break
                try:
                    event = await job.next_event(self.config.poll_s)  # a disconnect cancels this coroutine
                except RequestTimeout as e:
                    yield sse(api_error(e).body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client left (or the stream ended): the worker stops at its next piece


__all__ = ["Responder", "sse", "usage_of"]
