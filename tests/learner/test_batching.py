"""Packed learner batches: the layout, and the same loss and gradients as one sequence per row."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from learner.batching import first_fit, make_batch
from learner.config import LearnerConfig, OptimizerConfig
from learner.learner import Learner
from learner.mesh import MeshConfig, make_meshes
from learner.micro_batches import MicroBatches, Shape
from learner.step import accumulate, sum_keys, zero_accum
from rl.losses import LossConfig
from rl.models import create_model, get_preset
from tests.learner.test_learner import _advantages, _single_mesh, make_groups

EXACT = 1e-6  # float32: packing changes only the rows' shapes, never which tokens a token sees


def _long_tail_groups(n=4, g=4, seed=0):
    """Groups whose responses are mostly short with a few long ones (lengths 1-40)."""
    groups = make_groups(n, g=g, seed=seed, max_response=6)
    long = make_groups(1, g=g, seed=seed + 100, max_response=40)[0]
    return groups[:-1] + [long]


def test_first_fit_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    for _ in range(50):
        cap = int(rng.integers(8, 64))
        lengths = [int(x) for x in rng.integers(1, cap + 1, int(rng.integers(1, 40)))]
        bins = first_fit(lengths, cap)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= cap for b in bins)
        # First fit never leaves two bins that would fit in one.
        loads = sorted(sum(lengths[i] for i in b) for b in bins)
        assert len(loads) < 2 or loads[0] + loads[1] > cap
    assert first_fit([5, 3, 3, 2], 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="length of 9 exceeds the capacity 8"):
        first_fit([3, 9], 8)


def test_packed_layout_holds_every_sequence_and_pads_less():
    groups = _long_tail_groups(n=6, g=4)
    advs = _advantages(groups)
    plain = make_batch(groups, advs, rows=8, min_length_bucket=8)
    packed = make_batch(groups, advs, rows=8, min_length_bucket=8, pack=True, row_multiple=2)
    for name in ("loss_mask", "advantages", "behavior_logp"):  # the loss arrays are unchanged
        np.testing.assert_array_equal(getattr(packed, name), getattr(plain, name))
    assert packed.inputs.shape[0] % 2 == 0 and packed.inputs.shape[0] < plain.inputs.shape[0]
    assert packed.padded_fraction < plain.padded_fraction
    real = plain.segments > 0
    for name in ("inputs", "targets", "positions"):  # every sequence's tokens, via token_index
        gathered = getattr(packed, name).reshape(-1)[packed.token_index]
        np.testing.assert_array_equal(np.where(real, gathered, 0), getattr(plain, name))
    flat_index = packed.token_index[real]
    assert len(set(flat_index.tolist())) == flat_index.size == (packed.segments > 0).sum()
    for row_seg, row_pos in zip(packed.segments, packed.positions, strict=True):
        for s in set(row_seg.tolist()) - {0}:  # a segment is contiguous and starts at position 0
            where = np.flatnonzero(row_seg == s)
            assert np.all(np.diff(where) == 1) and row_pos[where[0]] == 0
    with pytest.raises(ValueError, match="row_multiple"):
        make_batch(groups, advs, rows=8, pack=True, row_multiple=0)


def _lengths(rng, n, cap):
    """Long-tailed sequence lengths in [2, cap]: mostly short, a few near the cap."""
    return [int(x) for x in np.clip(rng.lognormal(np.log(cap / 8), 1.0, n), 2, cap)]


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("halvings", [0, 2])
def test_micro_batches_place_every_sequence_once_on_the_fixed_shapes(pack, halvings):
    shapes = MicroBatches.from_config(
        rows=4, min_length_bucket=16, max_positions=100, pack=pack, halvings=halvings
    )
    assert shapes.lengths == (16, 32, 64, 128)
    flush = [Shape(128, 1), Shape(128, 2), Shape(128, 3)] if halvings else []  # quarters
    assert shapes.shapes() == [Shape(16, 32), Shape(32, 16), Shape(64, 8), Shape(128, 4), *flush]
    rng = np.random.default_rng(0)
    flushed = 0
    for _ in range(30):
        lengths = _lengths(rng, int(rng.integers(1, 60)), 100)
        n, pending, placed = len(lengths), [], []
        for k in range(0, n, 4):  # as Learner.add_groups: a plan after each group of 4
            pending += list(range(k, min(k + 4, n)))
            for final in (False, True) if k + 4 >= n else (False,):  # then the update's
                planned = shapes.plan([lengths[i] for i in pending], final=final)
                for m, (shape, bins) in enumerate(planned):
                    assert shape in shapes.shapes() and len(bins) <= shape.rows
                    assert sum(len(b) for b in bins) <= shapes.sequences(shape)
                    for b in bins:
                        assert sum(lengths[pending[j]] for j in b) <= shape.length
                        assert pack or len(b) == 1
                    chosen = [pending[j] for b in bins for j in b]
                    placed += chosen
                    longest = shapes.length_for(max(lengths[i] for i in chosen))
                    if shape.rows * shape.length == shapes.rows * 128:  # one token budget
                        # the shortest row length that holds the longest sequence it was given
                        assert shape.length == longest
                        if final and m == len(planned) - 1:  # no flush shape holds the last
                            for f in flush:
                                fit = first_fit(
                                    [lengths[i] for i in chosen],
                                    f.length,
                                    max_bins=f.rows,
                                    max_per_bin=None if pack else 1,
                                    max_items=shapes.sequences(f),
                                )
                                assert sum(map(len, fit)) < len(chosen)
                    else:  # a flush: only the update's last, the smallest that holds it
                        assert final and m == len(planned) - 1 and shape in flush
                        if shape.rows == 2:  # the smallest that holds it: one row did not
                            one = first_fit(
                                [lengths[i] for i in chosen],
                                128,
                                max_bins=1,
                                max_per_bin=None if pack else 1,
                                max_items=shapes.sequences(Shape(128, 1)),
                            )
                            assert sum(map(len, one)) < len(chosen)
                        flushed += 1
                pending = [i for i in pending if i not in placed]
        assert sorted(placed) == list(range(n)) and not pending
    assert flushed > 0 if halvings else flushed == 0
    with pytest.raises(ValueError, match="longer than the learner's longest row"):
        shapes.length_for(129)


def test_flush_shapes_are_those_the_mesh_shards_divide():
    shapes = MicroBatches.from_config(
        rows=8, min_length_bucket=32, max_positions=127, pack=True, halvings=3
    )
    assert shapes.flush_rows() == [1, 2, 3, 4, 5, 6, 7]  # eighths of the budget
    assert shapes.flush_rows(shards=2) == [2, 4, 6]
    # the learner's own mesh of 2 batch shards: the plan never forms a 1-row flush
    on_two = MicroBatches.from_config(
        rows=8, min_length_bucket=32, max_positions=127, pack=True, halvings=3, row_multiple=2
    )
    assert on_two.flush_rows() == [2, 4, 6] and on_two.flush_rows(shards=4) == [4]
    plan = on_two.plan([100], final=True)  # one sequence: the 2-row flush, not 1 row
    assert [shape for shape, _ in plan] == [Shape(128, 2)]
    assert shapes.shapes(shards=4)[-1:] == [Shape(128, 4)]
    # on a mesh whose shards do not divide a flush shape, the full budget's rows, same length
    assert shapes.on(Shape(128, 2), 4) == Shape(128, 8) and shapes.on(Shape(128, 4), 4) == (128, 4)
    with pytest.raises(ValueError, match="halvings >= 0"):
        MicroBatches.from_config(
            rows=8, min_length_bucket=32, max_positions=127, pack=True, halvings=-1
        )


def _padded(shapes, lengths, group):
    """The padded share of the micro-batches one update of these sequence `lengths` forms,
    handed over as Learner.add_groups plans them: after each group of `group`, then the update's."""
    pending, positions = [], 0
    for k in range(0, len(lengths), group):
        pending += lengths[k : k + group]
        for final in (False, True) if k + group >= len(lengths) else (False,):
            planned = shapes.plan(pending, final=final)
            positions += sum(shape.rows * shape.length for shape, _ in planned)
            chosen = {j for _, bins in planned for b in bins for j in b}
            pending = [n for j, n in enumerate(pending) if j not in chosen]
    return 1 - sum(lengths) / positions


def test_packed_micro_batches_pad_little_on_long_tails():
    """Mostly short sequences, a few long, in groups of 8: one per row pads 80% (a micro-batch's
    rows take the longest pending sequence's length), packed rows under 10% (7.8%)."""
    rng = np.random.default_rng(1)
    lengths = _lengths(rng, 512, 500)
    packed, plain = (
        MicroBatches.from_config(rows=16, min_length_bucket=64, max_positions=500, pack=p)
        for p in (True, False)
    )
    assert _padded(plain, lengths, 8) > 0.3
    assert _padded(packed, lengths, 8) < 0.10


def test_a_flush_micro_batch_cuts_the_padding_where_an_update_ends():
    """launch.bench_tunix's updates (8 groups of 8: prompts of 12-20 tokens, responses of 1-64):
    an update's ~3,000 tokens end partway through a micro-batch. In 8 rows of 128, half the
    budget for the last cuts the padded share from ~19% to ~11%; in 16 rows (the default), where
    what is left after the first is ~1,000-1,100 positions, halves cut it to ~17% and quarters
    (12 rows when 8 do not hold it) to ~10%."""
    rng = np.random.default_rng(0)
    updates = [
        [int(p + rng.integers(1, 65) - 1) for p in rng.integers(12, 21, 8) for _ in range(8)]
        for _ in range(50)
    ]

    def padded(rows, k):
        shapes = MicroBatches.from_config(
            rows=rows, min_length_bucket=32, max_positions=83, pack=True, halvings=k
        )
        return np.mean([_padded(shapes, lengths, 8) for lengths in updates])

    assert padded(8, 0) > 0.16 and padded(8, 1) < 0.13
    sixteen = [padded(16, k) for k in (0, 1, 2)]
    assert sixteen[0] > sixteen[1] > 0.15 > 0.11 > sixteen[2], sixteen


@pytest.mark.parametrize(
    "policy_loss,aggregation,kl",
    [
        ("ppo_clip", "seq_mean_token_mean", True),  # the quick tier's: ~15-20 s cold each
        pytest.param("ppo_clip", "token_mean", False, marks=pytest.mark.slow),
        pytest.param("gspo", "seq_mean_token_mean", False, marks=pytest.mark.slow),
        pytest.param("tis_reinforce", "seq_mean_token_sum_norm", False, marks=pytest.mark.slow),
    ],
)
def test_packed_batch_gives_the_same_loss_and_gradients(policy_loss, aggregation, kl):
    cfg = LearnerConfig(
        policy_loss=policy_loss,
        aggregation=aggregation,
        norm_constant=40.0 if aggregation == "seq_mean_token_sum_norm" else 0.0,
        loss=LossConfig(kl_coef=0.1 if kl else 0.0),
        old_logprobs="sampler",
    )
    graphdef, params = nnx.split(create_model(get_preset("tiny"), seed=4))
    ref = jax.tree.map(lambda p: p * 0.9, params) if kl else None
    groups = _long_tail_groups(n=5, g=4, seed=1)
    advs = _advantages(groups)
    # The weights are arguments, not constants the program closes over (those compile slower).
    step = jax.jit(
        lambda p, b, behavior, ref: accumulate(
            zero_accum(p, sum_keys(cfg)),
            p,
            b,
            graphdef=graphdef,
            cfg=cfg,
            behavior_params=behavior,
            ref_params=ref,
        )
    )
    fn = lambda b, behavior: step(params, b, behavior, ref)
    plain = make_batch(groups, advs, rows=4, min_length_bucket=8)
    packed = make_batch(groups, advs, rows=4, min_length_bucket=8, pack=True, row_multiple=2)
    assert packed.inputs.size < plain.inputs.size / 2
    behaviour = jax.tree.map(lambda p: p * 1.05, params)
    for behavior in (None, behaviour):  # old log-probs from the sampler, then from a snapshot
        a, b = fn(plain, behavior), fn(packed, behavior)
        assert float(a.denominator) == float(b.denominator) > 0
        # the numerator is a float32 sum of every token's loss, in another order once packed:
        # compared relative to its size, as the sums below (2 ulps absolute failed on an AMD EPYC)
        np.testing.assert_allclose(b.numerator, a.numerator, atol=EXACT, rtol=1e-6)
        for k in a.sums:
            np.testing.assert_allclose(b.sums[k], a.sums[k], atol=EXACT, rtol=1e-6, err_msg=k)
        leaves_a, leaves_b = jax.tree.leaves(a.grads), jax.tree.leaves(b.grads)
        assert max(float(np.abs(x).max()) for x in leaves_a) > 1e-3  # gradients are not ~0
        for x, y in zip(leaves_a, leaves_b, strict=True):
            np.testing.assert_allclose(y / b.denominator, x / a.denominator, atol=EXACT, rtol=0)


@pytest.mark.slow  # two learners on two meshes (~30 s cold); packing's equality per loss stays quick
def test_packed_sharded_learner_equals_unpacked_single_device():
    opt = OptimizerConfig(lr=1e-2, eps=1.0)
    model = create_model(get_preset("tiny"), seed=5)
    lm, _ = make_meshes(MeshConfig(learner_devices=8, learner_tp=2, colocated=True))
    results = []
    for mesh, packing in ((_single_mesh(), False), (lm, True)):
        cfg = LearnerConfig(
            optimizer=opt,
            micro_batch_rows=8,
            old_logprobs="snapshot",
            packing=packing,
            min_length_bucket=8,
            aggregation="seq_mean_token_mean",
        )
        learner = Learner(model, cfg, mesh=mesh)
        learner.begin_round(updates=2)
        metrics = []
        for r in range(2):
            learner.add_groups(_long_tail_groups(n=3, g=4, seed=10 + r))
            metrics.append(learner.update())
        results.append((jax.device_get(learner.params), metrics))
    (p0, m0), (p1, m1) = results
    for a, b in zip(m0, m1, strict=True):
        for k in ("loss", "grad_norm", "tokens", "sequences", "entropy"):
            np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=1e-5, err_msg=k)
    for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)


def _observed(groups, every=3):
    """The groups with every `every`-th response token marked as the environment's."""
    out = []
    for g in groups:
        comps = tuple(
            dataclasses.replace(
                c, observation_mask=tuple(i % every == 1 for i in range(len(c.tokens)))
            )
            for c in g.completions
        )
        out.append(dataclasses.replace(g, completions=comps))
    return out


@pytest.mark.parametrize("pack", [False, True])
def test_observation_tokens_carry_no_loss_weight(pack):
    groups = _observed(make_groups(2, seed=4, max_response=12))
    batch = make_batch(groups, _advantages(groups), rows=8, min_length_bucket=16, pack=pack)
    for k, c in enumerate(x for g in groups for x in g.completions):
        start = len(c.prompt) - 1
        row = batch.loss_mask[k, start : start + len(c.tokens)]
        np.testing.assert_array_equal(row, [0.0 if m else 1.0 for m in c.observation_mask])
        assert batch.loss_mask[k].sum() == len(c.tokens) - sum(c.observation_mask)


@pytest.mark.slow  # ~8 s cold; test_observation_tokens_carry_no_loss_weight checks the mask
def test_an_update_ignores_what_the_sampler_reported_for_observation_tokens():
    """The behaviour log-probs of observation tokens (0.0 from the sampler: it did not draw them)
    enter neither the loss nor its metrics: any value there gives the same update, bitwise."""
    model = create_model(get_preset("tiny"), seed=3)
    groups = _observed(make_groups(2, seed=10, max_response=12))
    garbage = [
        dataclasses.replace(
            g,
            completions=tuple(
                dataclasses.replace(
                    c,
                    logprobs=tuple(
                        -50.0 if m else lp
                        for lp, m in zip(c.logprobs, c.observation_mask, strict=True)
                    ),
                )
                for c in g.completions
            ),
        )
        for g in groups
    ]
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-3), micro_batch_rows=8, old_logprobs="sampler"
    )
    results = []
    for gs in (groups, garbage):
        learner = Learner(model, cfg, mesh=_single_mesh())
        learner.begin_round(updates=1)
        learner.add_groups(gs)
        results.append((learner.update(), jax.tree.leaves(learner.params)))
    (m0, p0), (m1, p1) = results
    assert m0 == m1
    for a, b in zip(p0, p1, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
