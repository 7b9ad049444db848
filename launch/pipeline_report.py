"""The tables launch.bench_pipeline prints, from its result (the JSON it writes):

    python -c "import json; from launch import pipeline_report; \
        pipeline_report.print_tables(json.load(open('/tmp/bench_pipeline.json')))"
"""

from __future__ import annotations

from typing import Any

import numpy as np

from launch.bench_util import range_text


def print_tables(result: dict[str, Any]) -> None:
    """The tables of a launch.bench_pipeline result (what its --json writes)."""
    out, c = result["modes"], result["config"]
    lengths = np.asarray(c["lengths"])
    print(
        f"workload: {c['groups']} groups x {c['group_size']} samples per round, U = "
        f"{c['groups_per_update']} ({c['groups'] // c['groups_per_update']} updates), "
        f"{c['slots']} slots, {c['steps_per_call']} steps per call; an epoch of {len(lengths)} "
        f"prompts, response lengths median {np.median(lengths):.0f}, mean {lengths.mean():.1f}, "
        f"{int(np.sum(lengths == c['max_new_tokens']))} at the cap {c['max_new_tokens']}; backend "
        f"{c['backend']}, {c['cpu_count']} CPU cores; medians of {c['repeats']} repeats"
    )
    print(
        f"{'mode':<30}{'rounds':>7}{'r2t_end s':>10}{'min-max':>13}{'vs sync':>9}{'1st disp s':>11}"
        f"{'ratio':>7}{'wait':>7}{'rollout s':>10}{'train s':>9}{'slot occ':>9}{'build s':>8}"
    )
    for m, r in out.items():
        s = r["spread"]["rollout_to_train_end_s"]
        print(
            f"{m:<30}{len(r['kinds']):>7}{r['rollout_to_train_end_s']:>10.3f}"
            f"{range_text(s):>13}"
            f"{-r['rollout_to_train_end_reduction']:>+9.1%}{r['first_dispatch_s']:>11.3f}"
            f"{r['first_dispatch_ratio']:>7.2f}{r['trainer_wait_ratio']:>7.2f}"
            f"{r['rollout_s']:>10.3f}{r['trainer_compute_s']:>9.3f}{r['slot_occupancy']:>9.2f}"
            f"{r['build_s']:>8.1f}"
        )
    print(
        "rounds: timed rounds per repeat; r2t_end: rollout start -> last update's end (round mean, "
        "median over repeats; min-max: over repeats); vs sync: its change; 1st disp: rollout start "
        "-> first learner span; ratio: vs sync; wait: trainer_wait_ratio; train s: learner busy "
        "time in the window; build s: runtime + engine warm-up"
    )
    print(
        f"{'mode':<30}{'groups':>7}{'s/group':>9}{'min-max':>15}{'tail_speedup':>13}{'aborted':>8}"
        f"{'short-round max len':>20}  round kinds"
    )
    for m, r in out.items():
        kinds = "".join(k[0] for k in r["kinds"])
        s = r["spread"]["time_per_group_s"]
        print(
            f"{m:<30}{r['groups_trained']:>7.0f}{r['time_per_group_s']:>9.4f}"
            f"{range_text(s, '.4f'):>15}"
            f"{r['tail_speedup_vs_sync']:>12.2f}x{r['aborted_prompts']:>8}"
            f"{r['short_round_response_len_max']:>20.1f}  {kinds}"
        )
    print(
        "s/group: the timed rounds' summed r2t_end / groups they trained; tail_speedup: sync's "
        "s/group / the mode's; short-round max len: mean over plain/short rounds of the longest "
        "trained response; kinds: p(lain) s(hort) l(ong) f(lush)"
    )
    print(
        f"{'mode':<30}{'groups/s':>9}{'vs sync':>8}{'1st disp':>9}{'ratio':>7}{'wait':>7}"
        f"{'lag mean':>9}{'lag max':>8}{'ESS':>7}{'|dlogp|':>9}"
    )
    for m, r in out.items():
        print(
            f"{m:<30}{r['groups_per_s']:>9.2f}{r['throughput_vs_sync']:>7.2f}x"
            f"{r['first_dispatch_s']:>9.3f}{r['first_dispatch_ratio']:>7.2f}"
            f"{r['trainer_wait_ratio']:>7.2f}{r['lag_mean']:>9.2f}{r['lag_max']:>8.0f}"
            f"{r['ess']:>7.3f}{r['logprob_diff_abs']:>9.4f}"
        )
    print(
        "groups/s: groups trained / wall time of the timed run_round calls; lag: policy versions "
        "between a token's and the updated params (round means of token means; max); ESS: "
        "(sum w)^2 / (N sum w^2), w = pi_learner / mu_sampler; |dlogp|: mean |learner - sampler "
        "log-prob|"
    )
    for m, r in out.items():
        print(
            f"{m:<30}first batch (logical indices) {r['first_batch_indices']}, tokens same as "
            f"sync: {r['same_tokens_as_sync']}, in every repeat: {r['same_tokens_each_repeat']}, "
            f"compiles timed: {r['compiles_timed']}"
        )
    maps = [r["memory_maps"]["held"] for r in out.values()]
    print(
        f"total (all modes, warm-ups included): {c['total_s']:.1f} s; memory maps held per mode "
        f"{min(maps)}-{max(maps)}; compiles timed: {result['compiles_timed']}; load average at the "
        f"end {c['load_average'][0]:.1f} on {c['cpu_count']} cores"
    )
