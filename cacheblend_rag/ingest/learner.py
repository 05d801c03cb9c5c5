"""Passages learned as they pass: texts a request has seen are ingested on a worker thread after its answer.

A RAG app's retriever hands the same passages back again and again. The integrations tell the engine which
passages a prompt carried (LlamaIndex's retrieval events, LangChain's retriever callbacks) and the engine queues
them here; one worker ingests them one at a time, so a request that arrives meanwhile waits for at most one
chunk's KV. The next prompt that carries a learned passage reuses its KV: no warm step. A failed ingest is logged
and dropped (a failing cache never fails a request).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


class PassageLearner:
    """A bounded queue of passages and the daemon thread that ingests them (started on the first submit).

    >>> learned = []
    >>> learner = PassageLearner(learned.append)
    >>> learner.submit(["Bees have five eyes.", "Bees have five eyes.", "  "])
    1
    >>> learner.wait(timeout=5), learned
    (True, ['Bees have five eyes.'])
    """

    def __init__(self, ingest_one: Callable[[str], object], max_pending: int = 256) -> None:
        self._ingest_one = ingest_one
        self.max_pending = max_pending
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.learned = 0  # passages ingested
        self.failed = 0  # passages whose ingest raised (logged, dropped)
        self.dropped = 0  # passages pushed out of a full queue, oldest first

    def submit(self, texts: Iterable[str]) -> int:
        """Queue these passages (blank and already queued ones skipped); how many were queued."""
        queued = 0
        with self._cond:
            for text in texts:
                if not isinstance(text, str) or not text.strip() or text in self._pending:
                    continue
                self._pending[text] = None
                queued += 1
                if len(self._pending) > self.max_pending:
                    self._pending.popitem(last=False)
                    self.dropped += 1
            if queued:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True, name="cacheblend-learner")
                    self._thread.start()
                self._cond.notify_all()
        return queued

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued passage is ingested (or `timeout` seconds pass); whether the queue drained."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                text, _ = self._pending.popitem(last=False)
                self._busy = True
            try:
                self._ingest_one(text)
                self.learned += 1
            except Exception as e:  # noqa: BLE001 - a passage that cannot be learned is skipped, never raised
                self.failed += 1
                logger.warning("could not learn a %d-character passage (%s: %s); it stays uncached",
                               len(text), type(e).__name__, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
