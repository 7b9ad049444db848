"""The paged KV cache against the dense one: sequences in flight at one KV byte budget, decode speed.

`launch.bench_sampler --modes paged` runs this (`measure`); the JSON's "paged" entry holds:

  in_flight_vs_dense       sequences decoding at once, paged / dense, while requests still wait
                           for admission (the capacity the KV budget allows), on a long-tailed
                           workload with a 4k-token cap: dense reserves max_length positions per
                           slot, paged holds live pages only (same bytes: dense slots x max_length
                           = pool pages x page)
  tokens_per_s_vs_dense    decode tokens/s, paged / dense, short contexts (a 168-position cap);
                           both read the live blocks of 64 positions (the default attention_block)
  by_cap                   the same at longer caps with the same short responses, and against a
                           dense engine reading its whole cache every step (attention_block 0)
  kv_bytes_per_live_token  pool bytes held / live positions, mean over the saturated steps (the
                           dense cache's figure is bytes_per_token x max_length / live length)
  prompt_kv_copies_per_group  copies of a G-sample group's prompt KV (dense: G)

All of it on one CPU device with the tiny model: the ratios, not the seconds, are the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rl.admission import FCFS
from rl.models import create_model, get_preset
from rl.types import Request, SamplingParams
from sampler.engine import Engine, EngineConfig
from sampler.loop import SamplerLoop

PAGE = 16
PROMPT_MAX = 32
SHORT_CAP = 136  # the speed rows' response cap: a 168-position context
RunLoop = Callable[..., dict[str, Any]]  # launch.bench_sampler.run_loop


def _requests(rng: np.random.Generator, n: int, group: int, lengths: np.ndarray) -> list[Request]:
    return [
        Request(
            uid=i,
            prompt=tuple(int(t) for t in rng.integers(0, 256, rng.integers(8, PROMPT_MAX + 1))),
            group_size=group,
            params=SamplingParams(temperature=1.0, max_new_tokens=int(lengths[i])),
        )
        for i in range(n)
    ]


def long_tail(rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
    """Response lengths: log-normal around 96 tokens, one group in ten at the cap."""
    body = np.clip(np.rint(96 * np.exp(rng.standard_normal(n))), 1, cap)
    return np.where(rng.random(n) < 0.1, cap, body).astype(int)


def _engine(
    model: Any, *, slots: int, cap: int, page: int = 0, pages: int = 0, block: int = 64
) -> Engine:
    return Engine(
        model,
        EngineConfig(
            max_slots=slots,
            max_length=PROMPT_MAX + cap,
            max_prefill_length=PROMPT_MAX,
            steps_per_call=8,
            page_size=page,
            kv_pages=pages,
            attention_block=block,
        ),
    )


def saturated(engine: Engine, model: Any, requests: list[Request]) -> dict[str, float]:
    """Steps a loop while requests still wait for admission; the mean sequences decoding per step
    and (paged) pool bytes per live position over those steps."""
    loop = SamplerLoop(
        engine,
        engine.load_params(model),
        admission=FCFS(),
        reward_fn=lambda r, c: 0.0,
        emit=lambda g: None,
    )
    loop.submit(requests)
    in_flight, per_token = [], []
    k = engine.config.steps_per_call
    while loop.waiting():
        before = loop.stats.tokens
        loop.step()
        in_flight.append((loop.stats.tokens - before) / k)
        usage = loop.kv_usage()
        if usage["live_tokens"]:
            per_token.append(usage["bytes"] / usage["live_tokens"])
    return dict(
        in_flight=float(np.mean(in_flight)),
        steps=len(in_flight) * k,
        kv_bytes_per_live_token=float(np.mean(per_token)),
        preemptions=engine.pool.preemptions if engine.pool is not None else 0,
    )


def capacity(model: Any, seed: int, *, dense_slots: int = 4, cap: int = 4096) -> dict[str, Any]:
    """Dense (dense_slots rows of max_length) vs paged (the same bytes in pages, 64 slots)."""
    rng = np.random.default_rng(seed)
    group = 4
    requests = _requests(rng, 32, group, long_tail(rng, 32, cap))
    dense = _engine(model, slots=dense_slots, cap=cap, page=0)
    pages = dense_slots * (-(-(PROMPT_MAX + cap) // PAGE))
    paged = _engine(model, slots=64, cap=cap, page=PAGE, pages=pages)
    d, p = saturated(dense, model, requests), saturated(paged, model, requests)
    return dict(
        cap=cap,
        kv_bytes=dense.layout.bytes,
        dense=d,
        paged=p,
        in_flight_vs_dense=p["in_flight"] / d["in_flight"],
    )


def _decode_seconds(
    engine: Engine, model: Any, requests: list[Request], watch: Any, run_loop: RunLoop
) -> float:
    """One timed run of `requests` (bench_sampler's `run_loop`) after a warm-up run."""
    params = engine.load_params(model)
    run_loop(engine, params, requests, static=False)  # warm-up: compiles
    with watch.timed():
        return run_loop(engine, params, requests, static=False)["seconds"]


def speed(
    model: Any, seed: int, caps: list[int], repeats: int, watch: Any, run_loop: RunLoop
) -> list[dict]:
    """Decode tokens/s, dense vs paged (both reading the live blocks) and dense reading its whole
    cache every step, 32 slots, 64-token responses, at each response cap; the runs alternate,
    medians over `repeats`."""
    rows = []
    for cap in caps:
        rng = np.random.default_rng(seed)
        requests = _requests(rng, 32, 1, np.full(32, 64))
        engines = {
            "dense": _engine(model, slots=32, cap=cap),
            "dense_whole": _engine(model, slots=32, cap=cap, block=0),
            "paged": _engine(model, slots=32, cap=cap, page=PAGE),
        }
        seconds = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                seconds[name].append(_decode_seconds(engine, model, requests, watch, run_loop))
        tokens = 32 * 64
        tps = {name: tokens / float(np.median(s)) for name, s in seconds.items()}
        rows.append(
            dict(
                context=PROMPT_MAX + cap,
                dense_tokens_per_s=tps["dense"],
                dense_whole_tokens_per_s=tps["dense_whole"],
                paged_tokens_per_s=tps["paged"],
                paged_vs_dense=tps["paged"] / tps["dense"],
                paged_vs_dense_whole=tps["paged"] / tps["dense_whole"],
            )
        )
    return rows


def prompt_copies(model: Any, group: int = 8) -> float:
    """Copies of one group's prompt KV a paged engine stores (distinct pages over its G slots
    covering the prompt's shared part, over the pages of one copy)."""
    engine = _engine(model, slots=group, cap=64, page=PAGE)
    state = engine.init_decode_state()
    request = Request(
        uid=0,
        prompt=tuple(range(1, PROMPT_MAX + 1)),
        group_size=group,
        params=SamplingParams(max_new_tokens=8),
    )
    engine.prefill_insert(engine.load_params(model), state, [(request, range(group), None)])
    shared = (PROMPT_MAX - 1) // PAGE
    distinct = len(set(engine.pool.table[:group, :shared].ravel().tolist()))
    return distinct / shared


def measure(seed: int, repeats: int, watch: Any, run_loop: RunLoop) -> dict[str, Any]:
    """The JSON's "paged" entry; `run_loop` is launch.bench_sampler's (it checks every response
    has its drawn length)."""
    model = create_model(get_preset("tiny", init_std=0.3, max_position_embeddings=8192), seed=seed)
    cap = capacity(model, seed)
    rows = speed(model, seed, [SHORT_CAP, 1024, 4096], repeats, watch, run_loop)
    return dict(
        in_flight_vs_dense=cap["in_flight_vs_dense"],
        tokens_per_s_vs_dense=rows[0]["paged_vs_dense"],
        kv_bytes_per_live_token=cap["paged"]["kv_bytes_per_live_token"],
        dense_kv_bytes_per_live_token=cap["dense"]["kv_bytes_per_live_token"],
        prompt_kv_copies_per_group=prompt_copies(model),
        capacity=cap,
        by_cap=rows,
        page=PAGE,
    )


def report(out: dict[str, Any]) -> None:
    cap = out["capacity"]
    d, p = cap["dense"], cap["paged"]
    print(
        f"paged KV (page {out['page']}) vs dense, one budget of {cap['kv_bytes'] / 2**20:.1f} MiB"
        f" of KV, long-tailed responses capped at {cap['cap']} tokens:"
    )
    print(f"{'':<8}{'in flight':>11}{'KV B/live token':>17}{'preemptions':>13}")
    for name, r in (("dense", d), ("paged", p)):
        print(
            f"{name:<8}{r['in_flight']:>11.1f}{r['kv_bytes_per_live_token']:>17.0f}"
            f"{r['preemptions']:>13}"
        )
    print(
        f"in flight paged / dense: {out['in_flight_vs_dense']:.2f}x; prompt KV copies per "
        f"G=8 group: {out['prompt_kv_copies_per_group']:.0f} (dense: 8)"
    )
    print("decode tokens/s (dense and paged read the live blocks; whole: dense, the whole cache):")
    print(
        f"{'context':>8}{'dense':>10}{'whole':>10}{'paged':>10}{'paged/dense':>13}"
        f"{'paged/whole':>13}"
    )
    for r in out["by_cap"]:
        print(
            f"{r['context']:>8}{r['dense_tokens_per_s']:>10.0f}"
            f"{r['dense_whole_tokens_per_s']:>10.0f}{r['paged_tokens_per_s']:>10.0f}"
            f"{r['paged_vs_dense']:>12.2f}x{r['paged_vs_dense_whole']:>12.2f}x"
        )
