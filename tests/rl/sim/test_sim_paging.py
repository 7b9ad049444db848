"""The simulated paged KV cache (rl/sim/paging.py) and the presets' two KV layouts: paged runs more
sequences than dense at the same memory, preemption loses and repeats nothing, pages never leak."""

import collections
import dataclasses

import pytest

from rl.elastic.borrowing import BorrowConfig, BorrowPolicy
from rl.elastic.migration import MigrationConfig
from rl.elastic.stage import StageModel
from rl.round_planner import TailConfig
from rl.sim.borrow import SimBorrower
from rl.sim.compare import sim_config
from rl.sim.kv_layouts import compare_kv_layouts, format_kv_table
from rl.sim.presets import GPUS, MAX_LENGTH, gpu_preset
from rl.sim.replica import pages
from rl.sim.simulator import Simulator
from rl.sim.workload import Workload, WorkloadConfig
from rl.types import Request, SamplingParams

H100 = gpu_preset("qwen3-1.7b", "h100")
TINY = WorkloadConfig(max_new_tokens=512, median_tokens=120, prompt_min=20, prompt_max=60)


def test_the_presets_size_each_layout_from_the_same_free_memory():
    dense = gpu_preset("qwen3-1.7b", "h100", kv_layout="dense")
    free, kv = H100.notes["kv_free_bytes"], H100.notes["kv_bytes_per_token"]
    assert dense.slots == int(free // (kv * MAX_LENGTH)) == 69 and dense.model.kv_pages == 0
    assert H100.slots == 256 and H100.model.kv_pages == int(free // (kv * 16))
    assert H100.model.swap_s(1) == pytest.approx(16 * kv / 25e9)
    assert H100.model.decode_c == dense.model.decode_c  # one step reads the live KV in both
    assert GPUS["h100"].hbm_bytes == 80e9
    with pytest.raises(ValueError, match="kv_layout"):
        gpu_preset("qwen3-1.7b", "h100", kv_layout="ring")


def test_paged_runs_more_sequences_than_dense_at_the_same_kv_budget():
    """The long tail at an 8k cap: a dense slot reserves 8.6k positions, a paged sequence takes
    what it has written, so the same HBM runs more than twice the sequences and more groups/s."""
    workload = WorkloadConfig(max_new_tokens=8192, seed=0)
    rows = compare_kv_layouts(
        ["dense", "paged"],
        ["async+frontier+s4+fill"],
        workload,
        rounds=2,
        groups_per_round=32,
        groups_per_update=2,
        group_size=8,
        replicas=1,
        max_new_tokens=8192,
    )["async+frontier+s4+fill"]
    dense, paged = rows["dense"], rows["paged"]
    assert dense["in_flight_peak"] <= dense["slots"] == 69
    assert paged["in_flight_peak"] > 2 * dense["slots"]
    assert paged["in_flight_mean"] > 1.5 * dense["in_flight_mean"]
    assert paged["vs_dense"] > 1.0 and dense["preemptions"] == 0
    assert "vs dense" in format_kv_table({"m": rows})


def run_checked(cfg, model, workload, rounds):
    """Runs the simulator checking the page bookkeeping at every jump: the next call's pages fit,
    the jump ends at the first call that would overflow (by brute force), nothing is negative.
    Returns (result, emitted groups per request key, the simulator)."""
    sim = Simulator(cfg, model, workload)
    paging, emitted = sim.sampler.paging, collections.Counter()
    overflow_call = paging.overflow_call

    def checked(rep, end):
        assert rep.prompt_pages >= 0 and all(n > 0 for n in rep.groups.values())
        assert paging.demand(rep, rep.calls) <= paging.pool
        got = overflow_call(rep, end)
        first = next(
            (c for c in range(rep.calls + 1, end) if paging.demand(rep, c) > paging.pool), end
        )
        assert got == first
        return got

    paging.overflow_call = checked
    on_group = sim.sampler._emit

    def emit(group, now):
        emitted[group.request.key] += 1
        on_group(group, now)

    sim.sampler._emit = emit
    return sim.run(rounds), emitted, sim


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("cgp+frontier+fifo", {}),
        ("async+frontier+s4+fill", {}),
        ("sync+tail", dict(tail=TailConfig(eta=1.25, response_eta=1.5))),  # cuts and aborts
        (  # the forcing mode: `tail` moves nothing into a pool this full (it has no room)
            "async+frontier+s4+fill",
            dict(
                routing="round_robin",
                migration=MigrationConfig(policy="always"),
                migration_consumer=True,
            ),
        ),
    ],
)
def test_a_tiny_pool_preempts_and_every_request_finishes_once_without_leaking_pages(mode, extra):
    model = H100.model.replace(kv_pages=60)  # 960 positions: a few sequences at a time
    fields = dict(
        groups_per_round=8, groups_per_update=2, group_size=4, max_new_tokens=512, replicas=2
    )
    cfg = sim_config(mode, slots=16, **fields, **extra)
    result, emitted, sim = run_checked(cfg, model, Workload(TINY), rounds=3)
    c = result.counters
    assert c["preemptions"] > 0 and c["swap_pages"] > 0
    assert c["swap_s"] == pytest.approx(model.swap_s(c["swap_pages"]))
    assert max(emitted.values()) == 1
    trained = sum(int(r["groups_trained"]) for r in result.rounds)
    assert c["groups_emitted"] - c["groups_cut"] >= trained > 0
    if mode == "cgp+frontier+fifo":  # nothing is cut or aborted: every request, once
        assert len(emitted) == 3 * 8 and c["groups_aborted"] == c["samples_cut"] == 0
    if "tail" in extra:  # over-provisioned samples cut and a round's extra requests aborted
        assert c["samples_cut"] > 0 and c["groups_aborted"] > 0
    if "migration" in extra:
        assert c["migrations"] > 0
    for rep in sim.sampler.replicas:  # every page back in the pool
        assert rep.active == 0 and not rep.swapped and not rep.groups and rep.prompt_pages == 0
    assert not sim.sampler.pending


def test_preemption_keeps_every_token_and_costs_the_swaps():
    """The same requests on an ample and on a tiny pool: the same tokens decoded, every sample's
    slot spans adding up to its length; the tiny pool takes longer by at least its swaps."""
    fields = dict(groups_per_round=8, groups_per_update=2, group_size=4, max_new_tokens=512)
    cfg = sim_config("cgp+frontier+fifo", slots=16, **fields)
    ample = Simulator(cfg, H100.model, Workload(TINY)).run(2)
    tiny, _, _ = run_checked(cfg, H100.model.replace(kv_pages=40), Workload(TINY), rounds=2)
    assert ample.counters["preemptions"] == 0 < tiny.counters["preemptions"]
    assert tiny.counters["tokens"] == ample.counters["tokens"]
    made = collections.Counter()
    for s in tiny.timeline.spans():
        if s.lane.startswith("sampler/slot"):
            made[(s.args["round"], s.args["uid"], s.args["sample"])] += s.args["tokens"]
    assert sum(made.values()) == tiny.counters["tokens"]
    swaps = [s for s in tiny.timeline.spans("sampler/swap")]
    assert {s.name for s in swaps} == {"swap_out", "swap_in"}
    assert tiny.end_s > ample.end_s


def test_a_request_the_pool_cannot_hold_is_refused_at_submission():
    cfg = sim_config(
        "sync", groups_per_round=1, groups_per_update=1, group_size=4, slots=16, max_new_tokens=512
    )
    sim = Simulator(cfg, H100.model.replace(kv_pages=20), Workload(TINY))  # 512 tokens: 32 pages
    request = Request(
        uid=0, prompt=(0,) * 40, group_size=4, params=SamplingParams(max_new_tokens=512)
    )
    with pytest.raises(ValueError, match="could never run"):
        sim.sampler.submit([request], 0.0)


def test_pages_span_positions():
    assert [pages(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert pages(100, 0) == 0
    assert dataclasses.replace(H100.model, kv_pages=0).kv_pages == 0


def test_borrowed_replicas_taken_back_with_swapped_sequences_lose_nothing():
    """Async borrowing on a tiny pool: replicas taken back mid-rollout hold running and swapped
    sequences; both resume elsewhere (re-prefilled with the tokens they made), every group is
    emitted once and every token decoded once."""
    model = StageModel(
        decode_a=0.005,
        decode_b=1e-4,
        learner_per_token=2e-5,
        learner_fixed=0.02,
        update_s=0.05,
        micro_batch_rows=8,
        publish_fixed=0.5,
        kv_bytes_per_token=1000,
        kv_pages=70,
        swap_per_byte=1e-9,
    )
    workload = WorkloadConfig(max_new_tokens=512, median_tokens=150, runaway_fraction=0.0)
    cfg = sim_config(
        "async+frontier+s2",
        groups_per_round=12,
        groups_per_update=2,
        group_size=4,
        replicas=2,
        slots=8,
    )
    policy = BorrowPolicy(
        BorrowConfig(borrowing="sampler", switch_cost_s=0.2), model, model_learner_devices=2
    )
    borrow = SimBorrower(policy, learner_devices=2)
    sim = Simulator(cfg, model, Workload(workload), pool=borrow)
    result = sim.run(4)
    c = result.counters
    assert borrow.moves["sampler"] >= 2 and c["preemptions"] > 0
    assert c["groups_emitted"] == 48 and c["aborted_tokens"] == 0
    spans = result.timeline.spans("sampler/slot")
    assert c["tokens"] == sum(s.args["tokens"] for s in spans)
    assert any(s.args.get("evicted") for s in spans)
    for rep in sim.sampler.replicas:
        assert rep.active == 0 and not rep.swapped and not rep.groups and rep.prompt_pages == 0
