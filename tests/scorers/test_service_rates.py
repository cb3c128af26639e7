"""ServiceRates: the fleet's speeds learned from completed requests, robust to waits and noise."""

from __future__ import annotations

import random

import pytest

from scorers.service_rates import ServiceRates


def _feed(
    rates: ServiceRates,
    rng: random.Random,
    n: int,
    *,
    fixed: float,
    per_token: float,
    per_request: float,
    stall_every: int = 0,
    endpoint: str | None = None,
) -> None:
    for i in range(n):
        work = rng.choice((60, 200, 900, 1400, 3000, 6000)) * rng.uniform(0.8, 1.2)
        running = rng.randint(1, 40)
        ttft = fixed + per_token * work + per_request * running * rng.uniform(0.5, 1.5)
        ttft *= rng.uniform(1.0, 1.3)  # steps under way, network: only ever later
        if stall_every and i % stall_every == 0:
            ttft += 2.0  # waited for KV room: far above the line
        itl = 0.008 + per_request * running
        rates.observe(
            work_tokens=work,
            in_flight=running,
            ttft_s=ttft,
            decode_s=itl * 99,
            output_tokens=100,
            running=running,
            endpoint=endpoint,
        )


def test_prefill_speed_is_learned_through_waits_and_late_answers() -> None:
    rates = ServiceRates(memory=300)
    _feed(rates, random.Random(1), 2000, fixed=0.02, per_token=30e-6, per_request=2e-4,
          stall_every=7)  # fmt: skip
    learned = rates.rates()
    assert learned is not None
    # The low quantile of each work bin tracks the line even with 1 request in 7 stalled.
    assert learned.prefill_s_per_token == pytest.approx(30e-6, rel=0.25)
    assert learned.in_flight_s_per_request == pytest.approx(2e-4, rel=0.1)
    assert learned.decode_s == pytest.approx(0.008 * 99 + 2e-4 * 20.5 * 99, rel=0.2)
    assert learned.output_tokens == pytest.approx(100)


def test_nothing_is_learned_before_enough_requests_or_when_prefill_does_not_show() -> None:
    rates = ServiceRates(min_samples=24)
    _feed(rates, random.Random(2), 10, fixed=0.02, per_token=30e-6, per_request=0)
    assert rates.rates() is None  # too few
    flat = ServiceRates()
    rng = random.Random(3)
    for _ in range(500):
        # A machine whose first tokens are all about waiting for a shared CPU: no slope.
        flat.observe(work_tokens=rng.choice((80, 1400)), in_flight=1, ttft_s=rng.uniform(0.1, 1.5))
    assert flat.rates() is None


def test_a_slower_pod_shows_an_excess() -> None:
    rates = ServiceRates()
    rng = random.Random(4)
    _feed(rates, rng, 400, fixed=0.02, per_token=30e-6, per_request=1e-4, endpoint="fast")
    _feed(rates, rng, 200, fixed=0.02, per_token=60e-6, per_request=1e-4, endpoint="slow")
    assert rates.excess("slow") > rates.excess("fast") + 0.01
    rates.forget("slow")
    assert rates.excess("slow") == 0.0


def test_bad_samples_are_ignored() -> None:
    rates = ServiceRates()
    rates.observe(work_tokens=100, in_flight=0, ttft_s=float("nan"))
    rates.observe(work_tokens=-1, in_flight=0, ttft_s=0.1)
    rates.observe(work_tokens=100, in_flight=0, ttft_s=-0.1)
    assert rates.rates() is None
    with pytest.raises(ValueError):
        ServiceRates(memory=1)
