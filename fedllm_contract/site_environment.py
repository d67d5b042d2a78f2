"""The environment a site-engine process gets from whatever starts it (the gateway's local
actuator and its warm pool, devtools' launcher): only what a site needs, never its starter's
secrets (docs/security.md, issue 67).

A site started with the starter's whole environment held the gateway's admin token, its metrics
token and its database URL (with the database's password), readable in /proc/<pid>/environ by
the site's user and by anything the site runs. A site reads only its own settings (`SITE_*`),
where its data lives (`FEDLLM_SHARED_DIR`, `FEDLLM_MODEL_CACHE`, `HF_HOME`...) and what its
runtime reads (the interpreter, torch, CUDA, the tokenizers' threads, the locale): those pass;
anything else stays behind, and a name that looks like a secret stays behind even under a
passing prefix (HF_TOKEN). A start adds its own on top (a slot's CUDA_VISIBLE_DEVICES), which
the operator chose and which pass whole.
"""

from __future__ import annotations

from collections.abc import Mapping

# Names a site process may inherit as they are.
_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "LANGUAGE", "TZ",
        "TMPDIR", "TEMP", "TMP", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SSL_CERT_FILE",
        "SSL_CERT_DIR", "FEDLLM_SHARED_DIR", "FEDLLM_MODEL_CACHE", "FEDLLM_DATA_DIR",
    }
)  # fmt: skip
# Prefixes of the settings of a site and of what it runs on: the interpreter, torch and its
# kernels (CUDA, cuDNN, cuBLAS, NCCL, Triton), Hugging Face's libraries and their caches, the
# CPU thread pools, the locale and the XDG folders (caches).
_PREFIXES = (
    "SITE_", "LC_", "PYTHON", "CUDA_", "CUDNN_", "CUBLAS_", "NVIDIA_", "NCCL_", "TORCH",
    "PYTORCH_", "TRITON_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "LLGUIDANCE_", "OMP_",
    "MKL_", "OPENBLAS_", "KMP_", "RAYON_", "XDG_",
)  # fmt: skip
# A part of a name that says it holds a secret, whatever its prefix (SITE_* aside: a site's own
# settings name files, SITE_TLS_KEY the path of its key).
_SECRET_PARTS = frozenset(
    {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "KEY", "APIKEY",
     "AUTH", "URL", "DSN"}
)  # fmt: skip


def site_may_inherit(name: str) -> bool:
    if name.startswith("SITE_"):
        return True
    if not (name in _NAMES or name.startswith(_PREFIXES)):
        return False
    return not _SECRET_PARTS.intersection(name.upper().split("_"))


def site_environment(
    parent: Mapping[str, str], added: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What of `parent` (the starter's environment) a site may inherit, with `added` (the
    start's own: a slot's environment, a test's SITE_* settings) on top."""
    inherited = {name: value for name, value in parent.items() if site_may_inherit(name)}
    return {**inherited, **(added or {})}
