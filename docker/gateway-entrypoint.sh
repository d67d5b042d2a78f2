#!/bin/sh
# Entrypoint of the gateway image: turns what the orchestrator passes as environment into the files
# the gateway reads, then runs the command (default: python -m gateway).
#   FEDLLM_FEDERATION_JSON   content of the federation file (gateway/federation.py), written to
#                            $GATEWAY_FEDERATION_FILE
#   FEDLLM_MODELS            {"<model>": {"hf_repo": "...", "hf_revision": "..."}}: each model's
#                            tokenizer is downloaded to models/<model> next to the federation file
#                            (where the rendered file points), unless it is already there
#   FEDLLM_TLS_CA_PEM, FEDLLM_TLS_CERT_PEM, FEDLLM_TLS_KEY_PEM
#                            the federation CA and the gateway's client certificate and key,
#                            written to $FEDLLM_TLS_DIR/{ca,cert,key}.pem (default: tls/ next to
#                            the federation file) for mutual TLS to the sites, and named to the
#                            gateway by GATEWAY_SITE_TLS_CA, _CERT and _KEY (docs/security.md);
#                            all three or none
# These FEDLLM_* variables are removed from the environment before the command starts.
set -eu

state_dir="$(dirname "${GATEWAY_FEDERATION_FILE:?GATEWAY_FEDERATION_FILE must be set}")"

if [ -n "${FEDLLM_FEDERATION_JSON:-}" ]; then
  mkdir -p "$state_dir"
  printf '%s\n' "$FEDLLM_FEDERATION_JSON" >"$GATEWAY_FEDERATION_FILE"
fi
unset FEDLLM_FEDERATION_JSON

if [ -n "${FEDLLM_MODELS:-}" ]; then
  # Parsed first, so that malformed JSON stops the start (set -e) instead of skipping downloads.
  models="$(python -c '
import json, os
for name, model in sorted(json.loads(os.environ["FEDLLM_MODELS"]).items()):
    print(name, model["hf_repo"], model["hf_revision"])
')"
  printf '%s\n' "$models" | while read -r name repo revision; do
    target="$state_dir/models/$name"
    if [ -f "$target/tokenizer.json" ] || [ -f "$target/tokenizer_config.json" ]; then
      continue
    fi
    echo "fetching the tokenizer of $name from $repo@$revision"
    hf download "$repo" --revision "$revision" --local-dir "$target" \
      --include 'tokenizer*' --include 'special_tokens_map.json' --include 'added_tokens.json' \
      --include 'vocab*' --include 'merges.txt' --include '*.tiktoken' --include 'chat_template*' \
      --include 'config.json' --include 'generation_config.json' >/dev/null
  done
fi
# HF_TOKEN stays: one-off tasks of this image (copying a predictor artifact) may need it.
unset FEDLLM_MODELS

tls_dir="${FEDLLM_TLS_DIR:-$state_dir/tls}"
given=0
for entry in FEDLLM_TLS_CA_PEM:ca.pem:GATEWAY_SITE_TLS_CA \
  FEDLLM_TLS_CERT_PEM:cert.pem:GATEWAY_SITE_TLS_CERT FEDLLM_TLS_KEY_PEM:key.pem:GATEWAY_SITE_TLS_KEY; do
  variable="${entry%%:*}"
  rest="${entry#*:}"
  file="$tls_dir/${rest%%:*}"
  setting="${rest#*:}"
  value="$(printenv "$variable" || true)"
  if [ -n "$value" ]; then
    mkdir -p "$tls_dir"
    (umask 077 && printf '%s\n' "$value" >"$file.new" && mv -f "$file.new" "$file")
    export "$setting=$file"
    given=$((given + 1))
  fi
  unset "$variable"
done
unset FEDLLM_TLS_DIR
if [ "$given" -ne 0 ] && [ "$given" -ne 3 ]; then
  echo "FEDLLM_TLS_CA_PEM, FEDLLM_TLS_CERT_PEM and FEDLLM_TLS_KEY_PEM: all three or none" >&2
  exit 1
fi

exec "$@"
