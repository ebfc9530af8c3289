"""Size-aware calibration: the cost model learns how a class slows down on small calls (n_1/2) once its
measurements span sizes, keeps its prior when they do not, and its uncertainty grows with the distance from
what it measured. The reference is a cost model with known parameters (the fit must recover them) and the
size-blind fit of the same measurements."""

import numpy as np
import pytest

from nereus_jax.config import resolve_model
from nereus_jax.elastic.costs import CostModel, Measurement, StageChoice
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.workload import Workload

LLAMA8B = resolve_model("llama3.1-8b")
HW = get_hardware("h100")
TRUE_EFF = {"gemm": 0.7, "attention": 0.5, "memory": 0.8, "collective_intra": 0.6}
TRUE_HALF = {"gemm_rows": 300.0}
WL = Workload.fixed(64, 256, 256)  # 512-token rows: a call of mb sequences is a GEMM of 512 mb rows


def _train(mb: int) -> StageChoice:
    return StageChoice(8, 1, 1, mb)


def _measure(truth: CostModel, mbs) -> list[Measurement]:
    return [Measurement(LLAMA8B, "actor-train", _train(mb), WL,
                        truth.stage_latency(LLAMA8B, "actor-train", _train(mb), WL).total) for mb in mbs]


def _predict(cm: CostModel, mb: int) -> float:
    return cm.stage_latency(LLAMA8B, "actor-train", _train(mb), WL).total


@pytest.fixture(scope="module")
def truth() -> CostModel:
    return CostModel(HW, TRUE_EFF, TRUE_HALF)


RUNS = [("actor-train", StageChoice(8, 1, 1, mb)) for mb in (2, 4, 8)] + \
    [("ref-infer", StageChoice(4, 1, 2, mb)) for mb in (4, 16)] + [("actor-gen", StageChoice(2, 1, 4, 16))]
LENGTHS = [Workload.fixed(64, 128, r) for r in (128, 384, 896)]  # responses growing over a run
SMALL_CALLS = [("actor-train", StageChoice(8, 1, 1, 1)), ("ref-infer", StageChoice(4, 1, 2, 2))]
SHORT = Workload.fixed(64, 64, 64)  # shorter rows than any measured


def test_measurements_that_span_sizes_recover_n_half_and_predict_smaller_calls(truth):
    measured = [Measurement(LLAMA8B, s, c, wl, truth.stage_latency(LLAMA8B, s, c, wl).total)
                for s, c in RUNS for wl in LENGTHS]
    cm = CostModel(HW)
    assert cm.half_sizes["gemm_rows"] == 0.0  # h100: no measured n_1/2, the prior is no size effect
    for _ in range(3):  # a few calibration rounds, as the steps of a run make them
        cm.observe(measured)
    assert cm.half_sizes["gemm_rows"] == pytest.approx(TRUE_HALF["gemm_rows"], rel=0.05)
    assert "gemm_rows" in cm.observed
    for stage, choice in SMALL_CALLS:  # 128-256 rows a call: never measured
        assert cm.stage_latency(LLAMA8B, stage, choice, SHORT).total == \
            pytest.approx(truth.stage_latency(LLAMA8B, stage, choice, SHORT).total, rel=0.02)
    blind = CostModel(HW)
    blind.observe(_measure(truth, (8,)))  # one size: cannot tell a slow class from a size effect
    assert blind.half_sizes["gemm_rows"] == 0.0 and "gemm_rows" not in blind.observed
    assert _predict(blind, 8) == pytest.approx(_predict(truth, 8), rel=0.01)


def test_uncertainty_grows_with_the_distance_from_what_was_measured(truth):
    cm = CostModel(HW)
    cm.observe(_measure(truth, (8,)))

    def sd(model: CostModel, mb: int) -> float:
        features = model.features(LLAMA8B, "actor-train", _train(mb), WL)
        return float(np.sqrt(model.variance(features))) / _predict(model, mb)

    assert sd(cm, 8) < sd(cm, 4) < sd(cm, 1)
    assert sd(cm, 1) > 0.05  # 8x smaller than anything measured: an honest spread
    assert features_reproduce_the_prediction(cm)
    spanned = CostModel(HW)
    spanned.observe(_measure(truth, (1, 2, 4, 8, 16)))
    assert sd(spanned, 1) < sd(cm, 1) / 2  # measured there now
    # a difference of two predictions: shared parameters cancel (same size, the variance of the difference is 0)
    f = cm.features(LLAMA8B, "actor-train", _train(8), WL)
    assert cm.variance(f - f) == 0.0


def features_reproduce_the_prediction(cm: CostModel) -> bool:
    return all(np.isclose(cm.features(LLAMA8B, "actor-train", _train(mb), WL) @ cm.theta(), _predict(cm, mb),
                          rtol=1e-9) for mb in (1, 8))


def test_a_layout_run_before_is_priced_from_its_measurements_after_it_leaves_the_window(truth):
    """Plan A's call ran 30% slower than the shared efficiencies explain (a bias of that layout). Once its
    measurements have left the calibration window and the fit has moved (here: replaced by the truth's
    efficiencies), pricing A again gives what A measured (scaled to another workload by the model), and a
    gain toward A counts A as measured, not guessed."""
    from nereus_jax.elastic.pricing import Pricing
    from nereus_jax.elastic.topology import Topology

    pricing = Pricing(CostModel(HW), Topology.of_job("grpo"), {r: LLAMA8B for r in ("actor", "ref")}, 80e9)
    a, b, never = StageChoice(2, 4, 1, 4), StageChoice(8, 1, 1, 4), StageChoice(4, 2, 1, 4)
    biased = 1.3 * truth.stage_latency(LLAMA8B, "actor-train", a, WL).total
    pricing.calibrate([Measurement(LLAMA8B, "actor-train", a, WL, biased)])
    assert pricing.residual("actor-train", a) == 1.0  # in the window: the fit prices it
    for _ in range(8):
        pricing.calibrate(_measure(truth, [4]))  # plan B: StageChoice(8, 1, 1, 4)
    current = pricing.features({"actor-train": b}, WL)
    sd_known = pricing.gain_sd(current, {"actor-train": a}, WL)
    sd_guess = pricing.gain_sd(current, {"actor-train": never}, WL)
    assert 0 < sd_known < sd_guess
    pricing.cost = CostModel(HW, TRUE_EFF, TRUE_HALF)  # a fit that moved on: residuals follow the new model
    assert pricing.residual("actor-train", a) == pytest.approx(1.3) and pricing.residual("actor-train", never) == 1.0
    assert pricing.stage_seconds({"actor-train": a}, WL)["actor-train"] == pytest.approx(biased, rel=1e-9)
    longer = Workload.fixed(64, 256, 512)
    assert pricing.stage_seconds({"actor-train": a}, longer)["actor-train"] == pytest.approx(
        1.3 * truth.stage_latency(LLAMA8B, "actor-train", a, longer).total)


def test_a_layout_far_from_any_measured_one_carries_more_uncertainty(truth):
    """The fit's covariance says nothing about effects its features miss (a tensor-parallel width never
    measured), so each doubling of tp or pp away from the nearest measured layout adds EXTRAPOLATION_SD of
    the call's seconds to the sd of a gain toward it. Reference: the term computed by hand from the layouts
    measured."""
    from nereus_jax.elastic.pricing import EXTRAPOLATION_SD, Pricing
    from nereus_jax.elastic.topology import Topology

    pricing = Pricing(CostModel(HW), Topology.of_job("grpo"), {r: LLAMA8B for r in ("actor", "ref")}, 80e9)
    measured = StageChoice(2, 1, 4, 4)
    assert pricing.layout_distance("actor-train", StageChoice(8, 1, 1, 4)) == 0.0  # nothing measured: the prior
    pricing.calibrate([Measurement(LLAMA8B, "actor-train", measured, WL,
                                   truth.stage_latency(LLAMA8B, "actor-train", measured, WL).total)])
    near, far = StageChoice(2, 2, 2, 4), StageChoice(8, 2, 1, 4)  # 1 and 3 doublings from tp2 pp1
    assert pricing.layout_distance("actor-train", near) == 1.0 and pricing.layout_distance("actor-train", far) == 3.0
    assert pricing.layout_distance("actor-train", StageChoice(2, 1, 8, 2)) == 0.0  # dp and micro-batch: the fit's
    assert pricing.layout_distance("ref-infer", far) == 0.0  # a model-stage never measured: the prior's

    current = pricing.features({"actor-train": measured}, WL)
    for choice, d in ((near, 1.0), (far, 3.0)):
        seconds = pricing.cost.stage_latency(LLAMA8B, "actor-train", choice, WL).total
        parametric = pricing.cost.variance(current - pricing.features({"actor-train": choice}, WL))
        assert pricing.gain_sd(current, {"actor-train": choice}, WL) == pytest.approx(
            np.sqrt(parametric + (EXTRAPOLATION_SD * d * seconds) ** 2), rel=1e-12)


def test_risk_adjusted_options_rank_a_measured_layout_above_a_slightly_faster_extrapolated_one(truth):
    """The planner's options re-ranked by seconds plus z x the extrapolation sd of their layout (each doubling
    of tp or pp from a measured layout: EXTRAPOLATION_SD of the seconds, the stage's and each rider's).
    Reference: the scores computed by hand; the measured layout comes first where the fit alone would
    extrapolate for a gain smaller than that uncertainty."""
    from nereus_jax.elastic.costs.candidates import StageOptions
    from nereus_jax.elastic.pricing import EXTRAPOLATION_SD, Pricing
    from nereus_jax.elastic.topology import Topology

    pricing = Pricing(CostModel(HW), Topology.of_job("grpo"), {r: LLAMA8B for r in ("actor", "ref")}, 80e9)
    rows = [(10.0, 8, 1e9, 1e9, (8, 1, 1, 4, False)),   # fastest by the fit, 2 doublings from tp 2
            (10.5, 8, 1e9, 1e9, (2, 1, 4, 4, False)),   # the measured layout
            (12.0, 8, 1e9, 1e9, (4, 2, 1, 4, False))]   # 2 doublings
    opts = {"actor-train": StageOptions.build("actor-train", rows)}
    assert pricing.risk_adjusted(opts, 1.0)["actor-train"] is opts["actor-train"]  # nothing measured: as they are
    measured = StageChoice(2, 1, 4, 4)
    pricing.calibrate([Measurement(LLAMA8B, "actor-train", measured, WL,
                                   truth.stage_latency(LLAMA8B, "actor-train", measured, WL).total)])
    ranked = pricing.risk_adjusted(opts, 1.0)["actor-train"]
    by_layout = {(int(r[0]), int(r[1])): float(v) for r, v in zip(ranked.raw, ranked.latency, strict=True)}
    assert by_layout == pytest.approx({(8, 1): 10.0 * (1 + 2 * EXTRAPOLATION_SD), (2, 1): 10.5,
                                       (4, 2): 12.0 * (1 + 2 * EXTRAPOLATION_SD)}, rel=1e-12)
    assert [tuple(int(v) for v in r[:2]) for r in ranked.raw] == [(2, 1), (8, 1), (4, 2)]  # same devices: by score
    assert pricing.risk_adjusted(opts, 0.0)["actor-train"].latency.tolist() == [10.0, 10.5, 12.0]
