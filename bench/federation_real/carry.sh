#!/usr/bin/env bash
# Gathers what `python -m bench.federation_real --preset gpu` needs on the GPU machine beyond the
# working tree, into .fedrealcarry/ (git-ignored; carry it): the GPT-2 tokenizer (the sites'
# models and the gateway count with it) and the wheels of the gateway's and the site's imports
# the GPU image lacks, or holds at other versions (grpcio with grpcio-health-checking, protobuf 7
# for the generated stubs). The list is what `python -m gateway` and `python -m site_engine`
# import when they start and serve a SQLite-backed federation (litestar's own sniffio and
# annotated-types included; not its CLI's rich-click, nor polyfactory, Faker, litestar-htmx or
# the site's lazily imported llguidance) less what the image holds; no result files.
#
#     bash bench/federation_real/carry.sh        # here, from the repository root
# then, in the device call (carry [".fedrealcarry"]):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .fedrealcarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
source "$(dirname "$0")/../engine/carry_lib.sh"
WHEELS=(litestar msgspec multipart sniffio annotated-types uvicorn httptools SQLAlchemy greenlet
    aiosqlite alembic Mako psycopg psycopg-binary pyzmq grpcio grpcio-health-checking protobuf)
carry_start .fedrealcarry
carry_wheels "${WHEELS[@]}"
carry_done
# What the device call sends: the tracked tree (bench/results included) plus this folder, at
# most 64 MiB. The wheels are ~19 MiB (grpcio, SQLAlchemy and psycopg-binary ~16 of them).
carry=$(du -sb .fedrealcarry | cut -f1)
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
echo "carry $((carry / 1024)) KiB, tracked tree $((tree / 1024)) KiB"
if (( carry + tree > 64 * 1024 * 1024 )); then
    echo "the tree and .fedrealcarry exceed the 64 MiB a device call sends" >&2
    exit 1
fi
