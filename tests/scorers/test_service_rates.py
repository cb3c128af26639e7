"""ServiceRates: the fleet's speeds learned from completed requests, robust to waits and noise."""

from __future__ import annotations

import csv
import random
from pathlib import Path

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


def test_a_slower_pod_shows_its_slowness_as_a_factor() -> None:
    rates = ServiceRates()
    rng = random.Random(4)
    for _ in range(200):  # the pods serve side by side
        _feed(rates, rng, 2, fixed=0.02, per_token=30e-6, per_request=1e-4, endpoint="fast")
        _feed(rates, rng, 1, fixed=0.02, per_token=60e-6, per_request=1e-4, endpoint="slow")
    # Twice the prefill time per token: its first tokens take about 1.5-2 × the fast pod's.
    assert 1.4 < rates.slowness("slow") / rates.slowness("fast") < 2.2
    rates.forget("slow")
    assert rates.slowness("slow") == 1.0


def test_identical_pods_with_noisy_first_tokens_are_not_told_apart() -> None:
    # A shared machine: every first token is late by a random factor up to 3 ×, the same for
    # every pod.  Without a significance test, one pod's streak of late answers made it look
    # 1.3 × slower and repelled its traffic; here no pod's slowness leaves 1 by much, while a
    # pod really twice as slow under the same noise still stands out.
    rates = ServiceRates()
    rng = random.Random(5)

    def noisy(endpoint: str, per_token: float) -> None:
        work = rng.choice((60, 200, 900, 1400, 3000))
        rates.observe(
            work_tokens=work,
            in_flight=1,
            ttft_s=(0.02 + per_token * work) * rng.uniform(1.0, 3.0),
            endpoint=endpoint,
        )

    for _ in range(300):
        for pod in ("a", "b", "c"):
            noisy(pod, 30e-6)
        noisy("slow", 60e-6)
    same = [rates.slowness(pod) for pod in ("a", "b", "c")]
    assert max(same) / min(same) < 1.1
    assert rates.slowness("slow") / max(same) > 1.15


def test_pods_sent_different_sizes_of_request_are_not_told_apart_by_their_mix() -> None:
    # The model fits some sizes better than others: here short requests wait for a whole step
    # the line does not know about.  A pod sent only short requests must not look slower (or a
    # pod sent long ones faster) than its twins for that: on real vLLM-CPU the pod that drew
    # the short cached questions looked fastest, drew more and took 1.4 x the mean.  A pod
    # really 1.5 x as slow still stands out.
    rates = ServiceRates()
    rng = random.Random(6)

    def serve(endpoint: str, work: int, slower: float = 1.0) -> None:
        step = 0.05 if work < 200 else 0.0
        ttft = (0.02 + step + 30e-6 * work) * slower * rng.uniform(1.0, 1.3)
        rates.observe(work_tokens=work, in_flight=1, ttft_s=ttft, endpoint=endpoint)

    for _ in range(400):
        serve("short", rng.choice((60, 100, 150)))
        serve("long", rng.choice((1400, 2000, 3000)))
        serve("mixed", rng.choice((60, 150, 1400, 3000)))
        serve("slow", rng.choice((60, 150, 1400, 3000)), slower=1.5)
    same = [rates.slowness(pod) for pod in ("short", "long", "mixed")]
    assert max(same) / min(same) < 1.1
    assert rates.slowness("slow") / max(same) > 1.3


def test_bad_samples_are_ignored() -> None:
    rates = ServiceRates()
    rates.observe(work_tokens=100, in_flight=0, ttft_s=float("nan"))
    rates.observe(work_tokens=-1, in_flight=0, ttft_s=0.1)
    rates.observe(work_tokens=100, in_flight=0, ttft_s=-0.1)
    assert rates.rates() is None
    with pytest.raises(ValueError):
        ServiceRates(memory=1)


def _feed_steps(rates: ServiceRates, rng: random.Random, *, own_s: float, pool_s: float) -> None:
    """Four pods; a request's inter-token time rises by ``own_s`` per request running on its
    pod and by ``pool_s`` per request running anywhere (pods sharing one machine)."""
    for _ in range(1500):
        pool = [rng.randint(1, 12) for _ in range(4)]
        own = pool[0]
        itl = 0.01 + own_s * own + pool_s * sum(pool)
        work = rng.choice((100, 3000))
        rates.observe(
            work_tokens=work,
            in_flight=own,
            ttft_s=0.02 + 30e-6 * work,
            decode_s=itl * 49,
            output_tokens=50,
            running=own,
            pool_running=sum(pool),
        )


def test_a_slowdown_shared_by_the_whole_pool_is_not_charged_to_the_pods_own_batch() -> None:
    contended = ServiceRates()
    _feed_steps(contended, random.Random(5), own_s=0.0, pool_s=3e-3)
    learned = contended.rates()
    assert learned is not None
    assert learned.in_flight_s_per_request == pytest.approx(0.0, abs=2e-4)
    independent = ServiceRates()
    _feed_steps(independent, random.Random(6), own_s=2e-3, pool_s=0.0)
    learned = independent.rates()
    assert learned is not None
    assert learned.in_flight_s_per_request == pytest.approx(2e-3, rel=0.05)


def test_with_one_pod_the_pod_is_the_pool() -> None:
    rates = ServiceRates()
    rng = random.Random(7)
    for _ in range(600):
        running = rng.randint(1, 20)
        work = rng.choice((100, 3000))
        rates.observe(
            work_tokens=work,
            in_flight=running,
            ttft_s=0.02 + 30e-6 * work,
            decode_s=(0.01 + 1e-3 * running) * 49,
            output_tokens=50,
            running=running,
            pool_running=running,
        )
    learned = rates.rates()
    assert learned is not None
    assert learned.in_flight_s_per_request == pytest.approx(1e-3, rel=0.05)


def test_prefill_speed_once_trusted_is_kept_while_its_slope_stays_within_the_band() -> None:
    def feed(rates: ServiceRates, rise: float, n: int) -> None:
        # Two work sizes whose first tokens differ by ``rise`` of the smaller one's.
        for i in range(n):
            work = 100 if i % 2 else 1100
            rates.observe(
                work_tokens=work, in_flight=1, ttft_s=0.1 * (1 + rise * (work - 100) / 1000)
            )

    fresh = ServiceRates(memory=50)
    feed(fresh, 0.18, 400)
    assert fresh.rates() is None  # 18 % is not enough to start trusting
    trusted = ServiceRates(memory=50)
    feed(trusted, 0.6, 400)
    assert trusted.rates() is not None
    feed(trusted, 0.18, 400)
    assert trusted.rates() is not None  # nor to stop
    feed(trusted, 0.05, 800)
    assert trusted.rates() is None


def test_a_request_decoding_alone_counts_though_its_batch_rounds_below_one() -> None:
    """The director computes the batch a request decoded in from two large in-flight
    integrals: a request alone comes out as 1 ± 1e-13.  Dropping those (they are half of a
    quiet pool's requests) fitted the step cost on busier requests only."""
    rates = ServiceRates()
    rng = random.Random(8)
    for _ in range(600):
        running = rng.choice((1, 1, 2))  # without the lone requests, no spread to fit
        work = rng.choice((100, 3000))
        rates.observe(
            work_tokens=work,
            in_flight=running - 1,
            ttft_s=0.02 + 30e-6 * work,
            decode_s=(0.01 + 1e-3 * running) * 49,
            output_tokens=50,
            running=running - 1e-13 if running == 1 else running,
            pool_running=running,
        )
    learned = rates.rates()
    assert learned is not None
    assert learned.in_flight_s_per_request == pytest.approx(1e-3, rel=0.05)


def test_a_start_up_stall_does_not_stay_the_fastest_first_token_of_its_size() -> None:
    """A size seen rarely must not keep its first sample as its quantile: on real vLLM-CPU a
    7.8 s start-up stall stayed the "fastest" first token of its bin for the whole run and
    priced prefill at a hundred times its cost."""
    rates = ServiceRates()
    rates.observe(work_tokens=1200, in_flight=0, ttft_s=7.8)
    rng = random.Random(9)
    for i in range(300):
        work = 1200 if i % 20 == 0 else rng.choice((100, 160, 350))  # 15 more of the rare size
        rates.observe(
            work_tokens=work, in_flight=0, ttft_s=(0.02 + 30e-6 * work) * rng.uniform(1.0, 1.2)
        )
    learned = rates.rates()
    assert learned is not None
    assert learned.prefill_s_per_token == pytest.approx(30e-6, rel=0.3)


def test_the_step_price_is_that_of_the_steps_not_of_the_prefills_chunked_into_them() -> None:
    """A request's time per token also holds the prefills of the requests that arrived on its
    pod while it decoded, more of them the more requests run there: the mean rises by far more
    per running request than a step does.  The cost charges those prefills already, so ``s``
    is the rise of the fast steps, the low quantile."""
    rates = ServiceRates()
    rng = random.Random(10)
    for _ in range(1500):
        running = rng.randint(1, 4)
        itl = (0.002 + 1e-3 * running) * rng.uniform(1.0, 1.1)
        if rng.random() < 0.2 * (running - 1):  # others' prefills shared this one's steps
            itl += rng.uniform(0.01, 0.05)
        work = rng.choice((100, 3000))
        rates.observe(
            work_tokens=work,
            in_flight=running - 1,
            ttft_s=0.02 + 30e-6 * work,
            decode_s=itl * 49,
            output_tokens=50,
            running=running,
            pool_running=running + rng.randint(0, 4),
        )
    learned = rates.rates()
    assert learned is not None
    # The mean rises by ~7 ms per running request; the fast steps by 1 ms (1.05 ms at the
    # 20th percentile of the ±10 % spread).
    assert learned.in_flight_s_per_request == pytest.approx(1.05e-3, rel=0.15)


def test_on_real_vllm_cpu_steps_the_price_of_a_running_request_is_steady() -> None:
    """Eight runs of the real-fleet benchmark (3 vLLM-CPU servers on 2 cores, 4 clients): the
    time per token of every request, as the EPP saw it (tests/data/README.md).  Most answers
    of a request alone arrived in one burst (10 µs to 1 ms per token against steps of
    3-10 ms), in one run most answers of two and three running requests too; the mean rises
    by 9-30 ms per running request, chunked prefills included.  The learned step price stays
    within 1-2.6 ms through every run, near the 1.1 ms a server measured alone adds per
    running request (simulator/data/vllm-cpu-tiny-llama3.json)."""
    path = Path(__file__).parent.parent / "data" / "vllm-cpu-step-samples.csv"
    with path.open(encoding="utf-8") as samples:
        rows = [tuple(map(float, row)) for row in list(csv.reader(samples))[1:]]
    rates = ServiceRates()
    seen = []
    for i, (running, pool, itl) in enumerate(rows):
        rates.observe(
            work_tokens=100 if i % 2 else 1500,
            in_flight=0,
            ttft_s=0.05 if i % 2 else 0.09,
            decode_s=itl * 31,
            output_tokens=32,
            running=running,
            pool_running=pool,
        )
        if i % 60 == 59 and i > 120:
            learned = rates.rates()
            assert learned is not None
            seen.append(learned.in_flight_s_per_request)
    assert min(seen) > 0.9e-3 and max(seen) < 3e-3


def _feed_episodes(rates: ServiceRates, rng: random.Random, n: int, own_s: float) -> None:
    """One pod whose steps rise by ``own_s`` per running request, seen through episodes of 16
    requests that each share a batch size and a slowdown of the whole machine (a neighbour's
    burst): by chance, some episodes of large batches are slow ones."""
    for i in range(n):
        if i % 16 == 0:
            batch, slowdown = rng.randint(1, 4), rng.lognormvariate(0.0, 0.5)
        running = batch + rng.uniform(-0.3, 0.3)
        itl = (0.005 + own_s * running) * slowdown * rng.uniform(1.0, 1.2)
        work = rng.choice((100, 3000))
        rates.observe(
            work_tokens=work,
            in_flight=batch - 1,
            ttft_s=0.02 + 30e-6 * work,
            decode_s=itl * 31,
            output_tokens=32,
            running=running,
            pool_running=running,
        )


def test_the_step_price_comes_with_its_standard_error() -> None:
    """The error is unknown (infinite) until each of the four consecutive folds of the window
    holds enough requests to fit; then it is the folds' spread.  Steps that rise clearly with
    the batch show a price well beyond it; steps that do not rise at all, seen through a
    machine's slow and fast episodes, tilt the fit by chance, but show no price beyond two
    errors."""
    early = ServiceRates()
    _feed_episodes(early, random.Random(20), 40, own_s=1e-3)
    learned = early.rates()
    assert learned is not None and learned.in_flight_s_error == float("inf")

    clear = ServiceRates()
    _feed_episodes(clear, random.Random(21), 600, own_s=5e-3)
    learned = clear.rates()
    assert learned is not None
    assert 0 < 2 * learned.in_flight_s_error < learned.in_flight_s_per_request

    tilted, shown = 0, 0
    for seed in range(10):
        flat = ServiceRates()
        _feed_episodes(flat, random.Random(30 + seed), 600, own_s=0.0)
        learned = flat.rates()
        assert learned is not None
        tilted += learned.in_flight_s_per_request > 0
        shown += learned.in_flight_s_per_request > 2 * learned.in_flight_s_error
    assert tilted >= 3  # what the error is for
    assert shown <= 1
