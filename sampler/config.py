"""EngineConfig: the decode engine's sizes and limits, and whether a request fits them."""

from __future__ import annotations

import dataclasses

from rl.models.config import DTYPES
from rl.models.paged_attention import DECODE_ATTENTION
from rl.types import Request


def rungs(top: int) -> tuple[int, ...]:
    """The powers of two below `top`, then `top`: the sizes a padded count takes (one compiled
    program each)."""
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return (*out, top)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_slots: int = 64  # max_concurrent_decodes
    max_length: int = 1024  # KV positions per slot: prompt + response
    max_prefill_length: int = 512  # longest prompt
    min_prefill_bucket: int = 16  # prompts are padded to powers of two from here (few compiles)
    steps_per_call: int = 8  # decode steps fused into one generate call (host overhead / k)
    max_stop_tokens: int = 4  # stop ids per request
    cache_dtype: str = ""  # KV cache dtype; empty: the model's compute dtype
    seed: int = 0  # root of every request's random stream
    memory_budget_bytes: int = 0  # per device for params + KV cache; 0: the device's own limit
    attention_block: int = 64  # > 0: decode attention reads only the live blocks of this many
    # positions (sampler/decode.py; paged: rounded up to whole pages); 0: the whole cache every
    # step. 64: fewer, larger blocks cost less per step on XLA:CPU than one per 16-position page;
    # the whole cache is as fast only at short caps (launch/bench_paged.py)
    page_size: int = 16  # > 0: a paged KV cache of pages of this many positions (sampler/paged.py;
    # attention reads a slot's live pages); 0: a dense max_length row per slot
    kv_pages: int = 0  # pages in the pool; 0: as many as the dense cache's positions would fill
    attention_kernel: str = "xla"  # decode attention (rl/models/paged_attention.py): "xla" (gather
    # the live blocks, runs everywhere) | "pallas" (reads the pages in place; a paged cache only)
    # | "pallas_tpu" (JAX's TPU paged-attention kernel on kv-major pools; a paged cache only)

    def __post_init__(self):
        for name in (
            "max_slots",
            "max_length",
            "max_prefill_length",
            "min_prefill_bucket",
            "steps_per_call",
            "max_stop_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"EngineConfig.{name} must be >= 1; received {getattr(self, name)}."
                )
        if self.max_prefill_length > self.max_length:
            raise ValueError(
                f"EngineConfig.max_prefill_length ({self.max_prefill_length}) exceeds max_length "
                f"({self.max_length}); a prompt must fit in the cache."
            )
        if self.attention_block < 0:
            raise ValueError(
                f"EngineConfig.attention_block must be >= 0; received {self.attention_block}."
            )
        if self.page_size < 0 or self.kv_pages < 0:
            raise ValueError(
                f"EngineConfig.page_size and kv_pages must be >= 0; received {self.page_size} "
                f"and {self.kv_pages}."
            )
        if self.kv_pages and not self.page_size:
            raise ValueError(
                f"EngineConfig.kv_pages={self.kv_pages} needs page_size > 0 (a paged cache)."
            )
        if self.page_size and self.kv_pages and self.kv_pages < self.pages_per_sequence:
            raise ValueError(
                f"EngineConfig.kv_pages={self.kv_pages} cannot hold one sequence of max_length "
                f"{self.max_length} ({self.pages_per_sequence} pages of {self.page_size}); "
                "raise kv_pages or lower max_length."
            )
        if self.attention_kernel not in DECODE_ATTENTION:
            raise ValueError(
                f"EngineConfig.attention_kernel={self.attention_kernel!r}; expected one of "
                f"{sorted(DECODE_ATTENTION)}."
            )
        if self.attention_kernel in ("pallas", "pallas_tpu") and not self.page_size:
            raise ValueError(
                f"EngineConfig.attention_kernel={self.attention_kernel!r} reads a paged cache's "
                "pages; received page_size=0 (a dense cache). Expected page_size > 0 or "
                "attention_kernel 'xla'."
            )
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"EngineConfig.seed must be in [0, 2**31); received {self.seed}.")
        if self.cache_dtype and self.cache_dtype not in DTYPES:
            raise ValueError(
                f"EngineConfig.cache_dtype={self.cache_dtype!r}; expected one of {tuple(DTYPES)}."
            )

    @property
    def decode_block(self) -> int:
        """Positions per block that decode attention reads (0: the whole cache at once):
        attention_block, in whole pages for a paged cache, at most a whole sequence."""
        if not self.attention_block or not self.page_size:
            return min(self.attention_block, self.max_length)
        block = -(-self.attention_block // self.page_size) * self.page_size
        return min(block, self.pages_per_sequence * self.page_size)

    @property
    def pages_per_sequence(self) -> int:
        """Pages a sequence of max_length positions spans (the block table's width)."""
        return -(-self.max_length // self.page_size)

    @property
    def swaps(self) -> bool:
        """Whether a paged pool can run short: fewer pages than every slot at max_length (only
        then does the engine swap sequences out, sampler/paged.py)."""
        return bool(self.page_size) and self.pool_pages < self.max_slots * self.pages_per_sequence

    @property
    def pool_pages(self) -> int:
        """Pages in a paged cache's pool: kv_pages, or the dense cache's positions' worth."""
        return self.kv_pages or self.max_slots * self.pages_per_sequence

    def buckets(self) -> tuple[int, ...]:
        out, b = [], self.min_prefill_bucket
        while b < self.max_prefill_length:
            out.append(b)
            b *= 2
        return (*out, self.max_prefill_length)

    def bucket(self, length: int) -> int:
        """The prefill bucket (padded prompt length) of a prompt of `length` tokens."""
        for b in self.buckets():
            if length <= b:
                return b
        raise ValueError(
            f"Prompt of {length} tokens exceeds max_prefill_length ({self.max_prefill_length})."
        )

    def reprefill_buckets(self) -> tuple[int, ...]:
        """Padded lengths of a re-prefill (prompt + tokens so far, recompute_kv): the prompt
        buckets, then max_length for anything longer."""
        longer = (self.max_length,) if self.max_length > self.max_prefill_length else ()
        return (*self.buckets(), *longer)

    def reprefill_bucket(self, length: int) -> int:
        """The padded length of a re-prefill of `length` tokens (at most max_length)."""
        return next(b for b in self.reprefill_buckets() if length <= b)

    def slot_rungs(self) -> tuple[int, ...]:
        """Slot counts an admission call is padded to (one compiled program each, per bucket):
        the powers of two below max_slots, then max_slots."""
        return rungs(self.max_slots)

    def slot_rung(self, n: int) -> int:
        """The smallest slot rung that holds `n` slots."""
        return next(r for r in self.slot_rungs() if n <= r)

    def check_request(self, request: Request, vocab_size: int) -> None:
        """Raises a clear error if `request` can never run on an engine of this config."""
        p, n = request.params, len(request.prompt)
        if n > self.max_prefill_length:
            raise ValueError(
                f"Request uid={request.uid}: prompt of {n} tokens exceeds max_prefill_length "
                f"({self.max_prefill_length})."
            )
        if n + p.max_new_tokens > self.max_length:
            raise ValueError(
                f"Request uid={request.uid}: prompt ({n}) + max_new_tokens ({p.max_new_tokens}) "
                f"exceeds the engine's max_length ({self.max_length})."
            )
        if request.group_size > self.max_slots:
            raise ValueError(
                f"Request uid={request.uid}: group_size {request.group_size} exceeds max_slots "
                f"({self.max_slots}); a group is admitted whole."
            )
        if len(p.stop_token_ids) > self.max_stop_tokens:
            raise ValueError(
                f"Request uid={request.uid} has {len(p.stop_token_ids)} stop tokens; the engine "
                f"allows max_stop_tokens={self.max_stop_tokens}."
            )
        if any(not 0 <= t < vocab_size for t in request.prompt):
            raise ValueError(
                f"Request uid={request.uid}: prompt token ids must be in [0, {vocab_size})."
            )
