"""``bench sglang``'s reading of SGLang's Prometheus text and its report (no SGLang needed)."""

from __future__ import annotations

from aiodatadist_benchmarks.bench.sglang_pd import format_table
from aiodatadist_benchmarks.bench.sglang_servers import metric, stage_sums

TEXT = """# HELP sglang:per_stage_req_latency_seconds The latency of each stage of requests.
sglang:per_stage_req_latency_seconds_bucket{engine_type="unified",stage="prefill_forward",le="0.5"} 2.0
sglang:per_stage_req_latency_seconds_sum{engine_type="unified",model_name="m",stage="prefill_forward"} 1.25
sglang:per_stage_req_latency_seconds_sum{engine_type="unified",model_name="m",stage="prefill_transfer_kv_cache"} 0.008
sglang:per_stage_req_latency_seconds_sum{engine_type="unified",model_name="m",stage="prefill_forward",tp_rank="1"} 0.25
sglang:per_stage_req_latency_seconds_count{engine_type="unified",stage="prefill_forward"} 3.0
sglang:kv_transfer_latency_ms_sum{engine_type="unified"} 8.5
"""


def test_stage_sums_add_every_series_of_a_stage_and_skip_other_samples() -> None:
    assert stage_sums(TEXT) == {"prefill_forward": 1.5, "prefill_transfer_kv_cache": 0.008}
    assert stage_sums("") == {}
    assert metric(TEXT, "sglang:kv_transfer_latency_ms_sum") == 8.5


def test_the_report_lists_each_configuration_s_nonzero_stage_medians() -> None:
    report = {"results": [
        {"config": "single", "request_ms": 500.0, "ttft_d_ms": 498.0, "transfer_ms": None, "rounds": []},
        {"config": "aiodatadist", "identical": True, "request_ms": 540.0, "ttft_d_ms": 536.0, "transfer_ms": 3.6,
         "overhead_ms": 21.5, "rounds": [{"request_ms": 540.0, "transfer_ms": 3.6}],
         "stages_ms": {"D decode_waiting": 520.25, "P prefill_forward": 510.0, "P quick_finish": 0.0}},
    ]}
    lines = format_table(report).splitlines()
    assert lines[-1] == "aiodatadist stages, ms (medians): D decode_waiting 520.2, P prefill_forward 510.0"
    assert not any(line.startswith("single stages") for line in lines)
    assert "P/D overhead ms" in lines[0] and lines[3].split()[:6] == ["aiodatadist", "identical", "540.0", "536.0",
                                                                     "3.6", "21.5"]
