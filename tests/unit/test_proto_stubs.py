"""The committed gRPC stubs are exactly what site.proto generates."""

from pathlib import Path

from fedllm_contract.proto.generate import PROTO_DIR, generate_into


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    for generated in generate_into(tmp_path):
        committed = PROTO_DIR / generated.name
        assert committed.is_file(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == generated.read_text(), (
            f"{committed.name} does not match site.proto: run `make proto`"
        )
