"""A load report's per-class entries (issue 52) on the wire: the gateway's gRPC client maps them
once into LoadView, skipping a class it does not know, and reads interactive load from them."""

from __future__ import annotations

from fedllm_contract.priority import Priority
from fedllm_contract.proto import site_pb2
from fedllm_contract.proto.options import priority_from_proto, priority_to_proto
from gateway.sites.grpc_client import _load_from_proto
from gateway.sites.interface import ClassLoadView


def test_every_class_round_trips_and_an_unknown_value_reads_as_none() -> None:
    for priority in Priority:
        assert priority_from_proto(priority_to_proto(priority)) is priority
    assert priority_to_proto(Priority.BATCH) == site_pb2.PRIORITY_BATCH
    assert priority_from_proto(9) is None


def test_class_entries_map_into_the_load_view() -> None:
    entry = site_pb2.LoadReport.ClassLoad
    report = site_pb2.LoadReport(
        queued_requests=3,
        running_requests=4,
        by_class=[
            entry(priority=site_pb2.PRIORITY_INTERACTIVE, queued_requests=1, running_requests=1),
            entry(
                priority=site_pb2.PRIORITY_BATCH,
                queued_requests=2,
                running_requests=3,
                queued_prompt_tokens=40,
                running_tokens=50,
                predicted_remaining_tokens=60,
            ),
            # A class a newer site knows and this gateway does not: left out.
            entry(priority=7, queued_requests=5),  # type: ignore[arg-type]
        ],
    )
    view = _load_from_proto(report)
    assert view.by_class == (
        ClassLoadView(Priority.INTERACTIVE, 1, 1, 0, 0, 0),
        ClassLoadView(Priority.BATCH, 2, 3, 40, 50, 60),
    )
    assert view.interactive_requests == 2


def test_a_report_without_classes_counts_everything_as_interactive() -> None:
    view = _load_from_proto(site_pb2.LoadReport(queued_requests=3, running_requests=4))
    assert view.by_class == ()
    assert view.interactive_requests == 7
