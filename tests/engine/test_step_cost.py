"""The model of a step's cost (a part per token, a part per token and position) and the chunk that
fits a budget."""

from __future__ import annotations

import random

from wafer.engine.step_cost import StepCost, StepCosts, positions_of, tokens_within


def test_the_fit_recovers_a_cost_per_token_and_per_position():
    cost = StepCost()
    rng = random.Random(0)
    for _ in range(30):
        tokens, start = rng.randint(1, 64), rng.randint(0, 3000)
        positions = positions_of(start, tokens)
        cost.observe(tokens, positions, 0.002 * tokens + 3e-7 * positions)
    a, b = cost.coefficients()
    assert abs(a - 0.002) < 1e-9 and abs(b - 3e-7) < 1e-12


def test_recent_steps_count_more():
    cost = StepCost()
    for _ in range(20):
        cost.observe(16, 0, 0.016)  # 1 ms a token
    for _ in range(20):
        cost.observe(16, 0, 0.032)  # the machine got busier: 2 ms
    a, b = cost.coefficients()
    assert b == 0.0 and 0.00198 < a < 0.002  # the first 20 weigh about 1% of the last 20


def test_steps_at_one_position_leave_the_cost_per_position_at_zero():
    assert StepCost().coefficients() is None
    cost = StepCost()
    cost.observe(32, 0, 0.032)
    cost.observe(16, 0, 0.016)
    assert cost.coefficients() == (0.001, 0.0)


def test_each_thread_count_has_its_own_fit_and_an_unseen_one_borrows_the_nearest():
    costs = StepCosts()
    assert costs.coefficients(2) is None
    for _ in range(10):
        costs.observe(1, 16, 0, 0.016)  # 1 ms a token on one thread
        costs.observe(2, 16, 0, 0.020)  # on two, parallel work costs 25% more core-seconds
    assert costs.coefficients(1) == (0.001, 0.0)
    assert abs(costs.coefficients(2)[0] - 0.00125) < 1e-12  # not the mixture of both
    assert costs.coefficients(3) == costs.coefficients(2) and costs.coefficients(8) == costs.coefficients(2)


def test_tokens_within_is_the_most_that_fit():
    for start in (0, 1, 17, 500, 4000):
        for k in (0.0, 0.001, 0.01, 0.3):
            for budget in (0.0, 0.5, 1.0, 7.3, 20.0, 300.0):
                n = tokens_within(budget, start, k)
                def cost(m: int) -> float:
                    return m + k * positions_of(start, m)
                assert cost(n) <= budget + 1e-9 and cost(n + 1) > budget, (start, k, budget, n)
