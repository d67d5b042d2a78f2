"""The fedllm gateway.

ONNX Runtime (1.29 and later, Linux builds) sends usage telemetry to a Microsoft collector from
the moment its library loads; the library reads ORT_DISABLE_TELEMETRY then, so it is set here,
before any gateway module can import onnxruntime. `onnxruntime.disable_telemetry_events()` is
not enough: called before the first session, 1.31.1 still resolves the collector's host
(traced with strace; tests/security/test_no_phoning_home.py). An operator may set the variable
to something else on purpose; it is left alone then.
"""

import os

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
