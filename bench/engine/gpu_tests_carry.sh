#!/usr/bin/env bash
# Copies what `make test-gpu` reads beyond the working tree into .gpucarry/ (git-ignored): the
# GPT-2 tokenizer (FEDLLM_SHARED_DIR: the GPU machine gets the working tree, not ../shared), and
# the wheels the bare GPU image lacks (it holds torch, transformers, triton, numpy, httpx, anyio,
# pyyaml, rich, click, multidict, typing-extensions, h11: /work/.library/device/KINDS.md):
# - the site process tests/gpu/test_site_gpu.py starts: grpcio, grpcio-health-checking and
#   protobuf (the gRPC face and its health service), litestar with what it imports (msgspec,
#   multipart, polyfactory, Faker, rich-click, litestar-htmx, annotated-doc, sniffio), uvicorn
#   and httptools (the OpenAI HTTP face), xxhash (the block hashes).
# Not llguidance: its pinned wheel is not built for the platforms carry_lib.sh asks for, and
# tests/gpu/conftest.py leaves test_structured_output_cuda.py out where it does not import.
#
# Run from the repository root:
#     bash bench/engine/gpu_tests_carry.sh
# carry `.gpucarry` and run
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .gpucarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
#         FEDLLM_SHARED_DIR=$PWD/.gpucarry && make test-gpu
source "$(dirname "$0")/carry_lib.sh"
carry_start .gpucarry
carry_wheels grpcio grpcio-health-checking protobuf litestar litestar-htmx msgspec multipart \
    polyfactory Faker rich-click annotated-doc sniffio uvicorn httptools xxhash
carry_done
