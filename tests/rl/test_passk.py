"""pass@k: the unbiased estimator against its closed form, and through evaluate()."""

import itertools
import math

import pytest
from flax import nnx

from rl.evaluate import evaluate
from rl.models import ByteTokenizer, create_model, get_preset
from rl.passk import mean_pass_at_k, pass_at_k
from rl.tasks.synthetic import addition_records
from sampler.engine import Engine, EngineConfig


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2) / C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5) / C(10,5)
        (5, 1, 1, 1 / 5),  # pass@1 = c / n
        (10, 0, 3, 0.0),
        (4, 4, 1, 1.0),
        (6, 3, 4, 1.0),  # n - c < k: every 4 of the 6 hold a correct one
        (4, 1, 4, 1.0),  # n = k: any correct
        (4, 0, 4, 0.0),
    ],
)
def test_pass_at_k_equals_the_closed_form_on_hand_made_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_binomial_ratio_everywhere_small():
    for n in range(1, 13):
        for c, k in itertools.product(range(n + 1), range(1, n + 1)):
            exact = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_mean_over_problems_and_bad_input():
    # problem 0: 1 of 4 correct; problem 1: 3 of 4: pass@2 = mean(1 - 3/6, 1 - 0/6)
    correct = [[True, False, False, False], [True, True, False, True]]
    assert mean_pass_at_k(correct, 2) == pytest.approx((0.5 + 1.0) / 2)
    with pytest.raises(ValueError, match=r"needs 1 <= k <= n; received n=3, k=4"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match=r"needs 0 <= c <= n; received n=3, c=5"):
        pass_at_k(3, 5, 2)
    with pytest.raises(ValueError, match=r"k must be an int; received 2.0"):
        pass_at_k(3, 1, 2.0)
    with pytest.raises(ValueError, match="received no problems"):
        mean_pass_at_k([], 1)


def test_evaluate_reports_the_unbiased_pass_at_k_from_n_samples():
    tok = ByteTokenizer()
    model = create_model(get_preset("tiny"), seed=0)
    engine = Engine(model, EngineConfig(max_slots=8, max_length=32, max_prefill_length=16))
    records = addition_records(3, digits=1, seed=0, split="heldout")

    def every_third_sample(request, completion):  # samples 0 and 3 of 6 are "correct"
        return 1.0 if completion.sample % 3 == 0 else 0.0

    params = nnx.split(model)[1]
    out = evaluate(engine, params, records, tok, every_third_sample, max_new_tokens=2, k=2, n=6)
    assert out["pass@2"] == pytest.approx(1 - math.comb(4, 2) / math.comb(6, 2))  # 0.6
    assert out["accuracy"] == 1.0  # the greedy sample is sample 0
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= n; received k=4, n=2"):
        evaluate(engine, params, records, tok, every_third_sample, max_new_tokens=2, k=4, n=2)
