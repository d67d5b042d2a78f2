#!/usr/bin/env bash
# What `python -m bench.serving_path --mode gpu` needs on the GPU machine beyond the working tree
# is what the federation bench's GPU run needs (the gateway's and the site's wheels the image
# lacks, the GPT-2 tokenizer; its clients use the image's uvloop and psutil): that bench's carry,
# into .fedrealcarry/ (git-ignored). The device command is in bench/serving_path/__init__.py.
#
#     bash bench/serving_path/carry.sh        # here, from the repository root
exec bash "$(dirname "$0")/../federation_real/carry.sh"
