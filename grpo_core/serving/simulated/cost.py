"""Cost model and completion lengths of a simulated engine (issue 25, item 2).

A decode step of one engine costs ``a + b x running`` seconds (``running``: sequences in the batch), plus
``c x prompt tokens`` of the prompts admitted at that step (prefill, batched into the step). Two calibrations,
both from this project's runs of real vLLM 0.25.1 serving SmolLM2-135M on one H200:

* ``h200`` (default): least squares over ``benchmarks/engine_calibration.py``'s bursts (every rollout 256 tokens,
  8-512 running), ``benchmarks/results/engine_calibration_h200_2026-12-05_1-2engines.json`` ``fit``: a = 2.227 ms,
  b = 15.64 µs per running sequence (docs/benchmarks.md, "Engine calibration on one H200").
* ``h200-client-bound``: the step-cycle model issue 25 fitted to whole training runs of grpo-flow and TRL
  (a = 3 ms, b = 90 µs; DESIGN.md §9). Its b includes the cost of a slow client (httpx's pool, since replaced):
  use it to replay those runs.

The prefill cost ``c`` is not in either fit; 2 µs per prompt token (a 128-token prompt of a 135M model is a
fraction of a decode step) is an assumption, a parameter.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: Where the default calibration comes from (cited in reports and the entry point's ``--help``).
CALIBRATION_SOURCE = "benchmarks/results/engine_calibration_h200_2026-12-05_1-2engines.json"


@dataclass(frozen=True)
class CostModel:
    """Seconds of one engine step: ``a_s + b_s x running + c_s x prefill tokens``, times ``time_scale``.

    Attributes:
        a_s: fixed cost of a decode step, seconds.
        b_s: cost per running sequence per decode step, seconds.
        c_s: prefill cost per prompt token admitted at the step, seconds.
        time_scale: factor applied to every simulated duration (step, weight update, LoRA load): 4 runs the
            engine 4x slower than the calibrated GPU, so a busy CPU box keeps up; rates measured in wall time are
            multiplied by it to read as the GPU's (shares are unchanged).
    """

    a_s: float = 2.227e-3
    b_s: float = 15.64e-6
    c_s: float = 2e-6
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("a_s", "b_s", "c_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0 seconds, got {value!r}")
        if not math.isfinite(self.time_scale) or self.time_scale <= 0:
            raise ValueError(f"CostModel.time_scale must be a finite number > 0, got {self.time_scale!r}")

    def step_s(self, running: int, prefill_tokens: int = 0) -> float:
        """Simulated seconds of one step with ``running`` sequences and ``prefill_tokens`` newly admitted
        prompt tokens (before ``time_scale``)."""
        return self.a_s + self.b_s * running + self.c_s * prefill_tokens


#: Named calibrations (see the module docstring for their sources).
CALIBRATIONS: dict[str, CostModel] = {
    "h200": CostModel(a_s=2.227e-3, b_s=15.64e-6),
    "h200-client-bound": CostModel(a_s=3e-3, b_s=90e-6),
}


def calibration(name: str, time_scale: float = 1.0, c_s: float | None = None) -> CostModel:
    """The named calibration with ``time_scale`` (and ``c_s`` when given).

    Raises:
        ValueError: ``name`` is not one of :data:`CALIBRATIONS`.
    """
    if name not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {name!r}; choose one of {', '.join(CALIBRATIONS)}")
    base = CALIBRATIONS[name]
    return CostModel(base.a_s, base.b_s, base.c_s if c_s is None else c_s, time_scale)


@dataclass(frozen=True)
class LengthDistribution:
    """Completion lengths in tokens, drawn per choice and clipped to ``[1, max_tokens]``.

    Spec strings (``parse``): ``fixed:L``; ``uniform:LO:HI`` (integers, inclusive); ``lognormal:MEDIAN:SIGMA``
    (``exp(N(log MEDIAN, SIGMA))`` rounded). A draw at or above the request's ``max_tokens`` ends with
    ``finish_reason: "length"``, a shorter one with ``"stop"`` (its last token is EOS).
    """

    kind: str
    p1: float
    p2: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        """Read ``fixed:L``, ``uniform:LO:HI`` or ``lognormal:MEDIAN:SIGMA``.

        Raises:
            ValueError: another form or out-of-range numbers, naming the spec and the accepted forms.
        """
        forms = "fixed:L, uniform:LO:HI or lognormal:MEDIAN:SIGMA"
        kind, _, rest = spec.partition(":")
        try:
            numbers = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"completion length spec {spec!r}: numbers expected ({forms})") from None
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if want is None or len(numbers) != want:
            raise ValueError(f"completion length spec {spec!r}: expected {forms}")
        if (
            numbers[0] < 1
            or (kind == "uniform" and numbers[1] < numbers[0])
            or (kind == "lognormal" and numbers[1] < 0)
        ):
            raise ValueError(f"completion length spec {spec!r}: lengths >= 1 (LO <= HI), SIGMA >= 0")
        return cls(kind, *numbers)

    def draw(self, rng: random.Random, max_tokens: int) -> int:
        """One length in ``[1, max_tokens]``."""
        if self.kind == "fixed":
            value = self.p1
        elif self.kind == "uniform":
            value = rng.randint(int(self.p1), int(self.p2))
        else:
            value = round(math.exp(rng.gauss(math.log(self.p1), self.p2)))
        return int(min(max(value, 1), max_tokens))
