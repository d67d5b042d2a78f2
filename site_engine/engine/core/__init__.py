"""The engine core: scheduling and KV-cache bookkeeping, apart from the worker.

Everything here is plain Python over token ids and block ids: which sequences run this step, how
many tokens each gets, which KV blocks they hold, what the prefix cache and the host tier keep. It
imports no torch and no numpy, so it is unit-tested without a model or a GPU
(tests/unit/engine), and a scheduling change is proved in milliseconds.

The worker side beside it in site_engine/engine/ (the paged engine, the model runner, the models,
the CUDA kernels, LoRA) imports the core, never the reverse: the import-linter contract
`engine-bookkeeping-without-torch` in pyproject.toml holds the whole package to that.
"""
