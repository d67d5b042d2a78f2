"""The fedllm gateway.

ONNX Runtime (1.29 and later, Linux builds) sends usage telemetry to a Microsoft collector from
the moment its library loads; the library reads ORT_DISABLE_TELEMETRY then, so it is set here,
before any gateway module can import onnxruntime. `onnxruntime.disable_telemetry_events()` is
not enough: called before the first session, 1.31.1 still resolves the collector's host
(traced with strace; tests/security/test_no_phoning_home.py). An operator may set the variable
to something else on purpose; it is left alone then.

gRPC's C core reads GRPC_EXPERIMENTS once, when grpc loads, so it is set here too. The gateway's
channels to its sites run on gRPC's older client I/O path (`-event_engine_client`): each site
chunk took fewer thread hops to reach the event loop, 0.52 -> 0.37 ms of CPU per 9-message
Generate call and -0.06 / -0.10 ms of a lone request's latency (non-stream / stream TTFT), c=32
unchanged (bench/results/gateway_overhead/grpc_client_path.md). An operator's own GRPC_EXPERIMENTS
wins.
"""

import os

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client")
