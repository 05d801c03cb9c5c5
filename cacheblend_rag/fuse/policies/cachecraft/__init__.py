"""Cache-Craft (§3): per-chunk recompute budgets from stored variants, and focused-chunk early termination.

    equations.py   β, γ, CFO, focused chunks (eqs. 6–8, 12, Alg. 1); the calibrated α read (eq. 13; measured by
                   `cacheblend_rag/cachecraft_calibration.py`)
    selection.py   the policy (variant and budget per chunk) and its selection (budget rows, HKVD, focus,
                   attention metadata and storing of new variants)
    variants.py    its per-chunk state: variants' KV in the chunk store, their metadata in SQLite beside it
                   (`CacheCraft.chunk_state`: one VariantStore per chunk cache, `ChunkCache.policy_state`)

Per chunk of a request, among its stored variants (the isolated ingestion precompute and any KV computed after
other chunks, `variants.py`):

    β   prefix overlap (eq. 6)      share of the variant's inter-attention that went to chunks also before it now
    γ   order penalty (eq. 7)       normalized Kendall tau distance between the old and new order of those chunks
    β'  = β · (1 − γ)               (eq. 8)
    CFO = α · CCI · (1 − β')        (eq. 12), clipped to [0, 1]

the variant with the lowest CFO is placed and the top ⌈CFO · |C|⌉ of its tokens are recomputed: by the variant's
stored inter-attention ranking (eq. 14, no check layer), by this engine's question-weighted HKVD at layer 1 within
the chunk's budget (`token_choice="hkvd"`), or by the question's attention over the stale KV in a probe pass of the
uncached rows (`token_choice="relevance"`, `hkvd.question_relevance`, as the `relevance` policy ranks rows). Per
layer the question's attention to each chunk is accumulated; once the set of high-attention chunks (Algorithm 1) is
the same for `focus_window` layers, the other chunks' rows stop being recomputed (§3.2.2). Chunks computed in full
in context (holes, a budget of every token) are stored as new variants after the first token, with their attention
metadata; variants beyond a byte budget are evicted by usefulness (f_r += 1/CFO per use, lowest first, §3.3).
"""

from .equations import (DEFAULT_ALPHA, cache_fix_overhead, calibrated_alpha, calibration_path, focused_chunks,
                        order_penalty, prefix_overlap)
from .selection import (CHECK_LAYER, FIRST_USES, METADATA_EVERY, TOKEN_CHOICES, CacheCraft, ChunkPlan,
                        CraftPlacements, CraftSelection, RequestPlan)

__all__ = ["CHECK_LAYER", "DEFAULT_ALPHA", "FIRST_USES", "METADATA_EVERY", "TOKEN_CHOICES", "CacheCraft",
           "ChunkPlan", "CraftPlacements", "CraftSelection", "RequestPlan", "cache_fix_overhead",
           "calibrated_alpha", "calibration_path", "focused_chunks", "order_penalty", "prefix_overlap"]
