#!/bin/sh
# Entrypoint of the site image: fetches the model weights once, then runs the command (default:
# python -m site_engine).
#   FEDLLM_HF_REPO, FEDLLM_HF_REVISION   Hugging Face repository and revision of the weights
#                                        (HF_TOKEN for gated ones)
#   SITE_MODEL_DIR                       where they go; on a volume, so restarts reuse them
set -eu

if [ -n "${FEDLLM_HF_REPO:-}" ]; then
  model_dir="${SITE_MODEL_DIR:?SITE_MODEL_DIR must name where the weights go}"
  # Written last: a download cut short is resumed on the next start, never served half-done.
  marker="$model_dir/.fedllm-download-complete"
  if [ ! -f "$marker" ]; then
    echo "fetching $FEDLLM_HF_REPO@${FEDLLM_HF_REVISION:-main} into $model_dir"
    hf download "$FEDLLM_HF_REPO" --revision "${FEDLLM_HF_REVISION:-main}" --local-dir "$model_dir" \
      --include '*.json' --include '*.safetensors' --include '*.txt' --include '*.model' \
      --include '*.tiktoken' --include '*.jinja' >/dev/null
    touch "$marker"
  fi
fi
unset HF_TOKEN

exec "$@"
